"""Training for length: curricula of sequence lengths, the long-document corpus, and a long step that
really trains a tiny model (many chunks and windows per sequence)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

from linearize.convert import data
from linearize.convert.pipeline import _stage_data, apply_overrides
from linearize.convert.plan import plan_layers
from linearize.convert.recipes import Recipe, Stage, parse_recipe
from linearize.convert.swap import linearize_model, new_parameters
from linearize.convert.train import attention_transfer, measure_layer_errors, phase_of, plan_phases, tokens_after


def test_curriculum_splits_the_budget_and_keeps_tokens_per_step():
    stage = Stage(tokens=8192, seq_len=[256, 1024, 2048], batch_size=8)
    rows = [torch.zeros(10, n, dtype=torch.long) for n in (256, 1024, 2048)]
    phases = plan_phases(rows, stage, world=1)
    assert [p.batch_size for p in phases] == [8, 2, 1]  # 2048 tokens per step at every length
    assert [p.steps for p in phases] == [2, 2, 2]  # 8192 / 3 tokens each, rounded up to whole steps
    assert phase_of(phases, 0)[0] is phases[0] and phase_of(phases, 3) == (phases[1], 1)
    assert tokens_after(phases, 6, world=1) == 6 * 2048
    assert tokens_after(phases, 3, world=2) == 3 * 4096
    with pytest.raises(IndexError):
        phase_of(phases, 6)


def test_a_budget_below_one_row_per_length_drops_the_longer_lengths(caplog):
    rows = [torch.zeros(4, n, dtype=torch.long) for n in (2048, 4096)]
    phases = plan_phases(rows, Stage(tokens=2048, seq_len=[2048, 4096], batch_size=1), world=1)
    assert [(p.rows.shape[1], p.steps) for p in phases] == [(2048, 1)]  # not 2048 + 4096 tokens for a 2048 budget
    assert "training on [2048] only (8,192 tokens would take all)" in caplog.text
    phases = plan_phases(rows, Stage(tokens=8192, seq_len=[2048, 4096], batch_size=1), world=1)
    assert [(p.rows.shape[1], p.steps) for p in phases] == [(2048, 2), (4096, 1)]


def test_recipe_and_cli_take_a_length_curriculum():
    recipe = apply_overrides(Recipe(), {"transfer.seq_len": [512, 4096]})
    assert recipe.transfer.seq_lens == [512, 4096] and recipe.finetune.seq_lens == [512]
    with pytest.raises(ValueError, match="transfer.seq_len"):
        parse_recipe({"transfer": {"seq_len": [512, 1]}})
    with pytest.raises(ValueError, match="transfer.seq_len"):
        parse_recipe({"transfer": {"seq_len": "long"}})


def test_bad_seq_len_flag_is_one_line_exit_2(linearize_main):
    code, _, err = linearize_main("--model", "llama", "--seq-len", "512,0")
    assert code == 2 and "--seq-len" in err.strip().splitlines()[-1] and "512,4096" in err


def test_long_corpus_has_long_documents_and_keeps_heldout_text_out(tiny_tokenizer):
    docs = list(data.load_texts(data.EMBEDDED_LONG))
    assert docs[0] == data.train_text() and len(docs) > 30
    assert sorted(len(d) for d in docs[1:])[len(docs) // 2] > 100_000  # typical play: ~40K tokens
    held_out = data.britannica_text()
    assert held_out[:2000] not in "".join(docs) and data.heldout_text()[:2000] not in "".join(docs)
    assert list(data.load_texts(data.EMBEDDED_LONG, split="validation")) == [data.heldout_text(), held_out]
    assert data.eval_text("britannica") == held_out
    with pytest.raises(ValueError, match="pydoc, britannica"):
        data.eval_text("wiki")


def test_stage_data_gives_one_shuffled_tensor_per_length(tiny_tokenizer):
    stage = Stage(tokens=4096, seq_len=[64, 512], dataset=data.EMBEDDED_LONG)
    phases = _stage_data(stage, tiny_tokenizer, seed=0)
    assert [p.shape for p in phases] == [(32, 64), (4, 512)]
    again = _stage_data(stage, tiny_tokenizer, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(phases, again))
    assert not torch.equal(_stage_data(stage, tiny_tokenizer, seed=1)[1], phases[1])


def test_long_sequence_transfer_step_trains_a_tiny_model(tiny_llama_dir, tiny_tokenizer):
    """Sequences of 384 tokens: 6 chunks of 64 and dozens of window hand-overs per row, on a curriculum."""
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    settings = {**Recipe().linear_attention(), "window": 16, "sink": 2, "rope_features": False}
    types = plan_layers(4, linear_layers=[0, 1, 3])
    student = linearize_model(teacher, types, settings, "tiny")
    before = {k: v.detach().clone() for k, v in new_parameters(student).items()}
    stage = dataclasses.replace(Recipe().transfer, tokens=3 * 384, seq_len=[96, 384], batch_size=4, lr=1e-2)
    rows = _stage_data(stage, tiny_tokenizer, seed=0)
    long_rows = rows[1][:2]
    error_before = sum(measure_layer_errors(student, long_rows).values())
    result = attention_transfer(student, rows, stage, Accelerator(cpu=True), None)
    assert result.steps == 4 and result.tokens == 4 * 384
    assert all(torch.isfinite(torch.tensor([loss for _, loss in result.curve])))
    assert sum(measure_layer_errors(student, long_rows).values()) < error_before
    after = new_parameters(student)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_lora_on_every_layer_adapts_the_softmax_layers_too(tiny_llama_dir, tiny_tokenizer, monkeypatch):
    import peft

    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    settings = {**Recipe().linear_attention(), "window": 16, "sink": 2}
    student = linearize_model(teacher, plan_layers(4, linear_layers=[0, 1]), settings, "tiny")
    wrapped = []
    real = peft.get_peft_model
    monkeypatch.setattr(peft, "get_peft_model", lambda model, config: wrapped.append(config) or real(model, config))
    stage = dataclasses.replace(Recipe().finetune, tokens=256, seq_len=64, batch_size=2, loss="ce", lora_layers="all")
    from linearize.convert.train import lora_finetune

    lora_finetune(student, _stage_data(stage, tiny_tokenizer, seed=0), stage, Accelerator(cpu=True), None)
    assert "(0|1|2|3)" in wrapped[0].target_modules
    with pytest.raises(ValueError, match="finetune.lora_layers"):
        parse_recipe({"finetune": {"lora_layers": "some"}})


def test_late_weight_reaches_every_linear_layer_for_the_stage_only(tiny_llama_dir, tiny_tokenizer, monkeypatch):
    from linearize.modeling import modeling_linearize

    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    settings = {**Recipe().linear_attention(), "window": 16, "sink": 2}
    student = linearize_model(teacher, plan_layers(4, linear_layers=[0, 1, 3]), settings, "tiny")
    seen = []
    real = modeling_linearize.transfer_mse
    monkeypatch.setattr(modeling_linearize, "transfer_mse", lambda out, ref, w=0.0: seen.append(w) or real(out, ref, w))
    stage = dataclasses.replace(Recipe().transfer, tokens=128, seq_len=64, batch_size=2, late_weight=2.0)
    attention_transfer(student, _stage_data(stage, tiny_tokenizer, seed=0), stage, Accelerator(cpu=True), None)
    assert seen and len(seen) % 3 == 0 and set(seen) == {2.0}  # every linear layer, every pass
    assert {m.transfer_late_weight for m in student.modules() if hasattr(m, "transfer_late_weight")} == {0.0}
    with pytest.raises(ValueError, match="transfer.late_weight"):
        parse_recipe({"transfer": {"late_weight": -1}})
    with pytest.raises(ValueError, match="transfer.late_weight"):
        parse_recipe({"finetune": {"late_weight": 1.0}})
