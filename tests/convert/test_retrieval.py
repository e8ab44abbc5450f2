"""Retrieval placement: the probe documents, the attention-on-facts score against eager attention, the plan."""

import json

import torch
from transformers import AutoModelForCausalLM

from linearize.convert import retrieval
from linearize.convert.data import heldout_text, train_text
from linearize.convert.pipeline import convert
from linearize.convert.recipes import load_recipe

WINDOW = 16
SETTINGS = {"kind": "gla", "feature_map": "hedgehog", "window": WINDOW, "sink": 2}


def test_probe_tokens_point_at_the_fact_and_the_answer(tiny_tokenizer):
    text = "Some text here. The pass key is 40712. Remember it. More filler text. The pass key is"
    ids, fact, queries = retrieval.probe_tokens(tiny_tokenizer, text, "40712")
    assert "40712" in tiny_tokenizer.decode([ids[i] for i in fact]).replace(" ", "")
    written = tiny_tokenizer(" 40712", add_special_tokens=False)["input_ids"]
    assert ids[-len(written) :] == written
    # the logits at `queries` predict the answer's tokens
    assert [ids[q + 1] for q in queries] == written


def test_probe_documents_are_deterministic_and_put_facts_beyond_the_window(tiny_tokenizer):
    haystack = retrieval.haystack_text([train_text()], 50_000)
    docs = retrieval.probe_documents(tiny_tokenizer, 512, WINDOW, haystack)
    assert docs == retrieval.probe_documents(tiny_tokenizer, 512, WINDOW, haystack)
    assert len(docs) == len(retrieval.needles.TASKS) * len(retrieval.PROBE_DEPTHS) * retrieval.PROBE_SAMPLES
    held = heldout_text()[1000:1100]
    for ids, fact, queries in docs:
        assert fact and queries[0] - max(fact) > 2 * WINDOW - 16  # the fact sits outside the window
        assert held not in tiny_tokenizer.decode(ids)  # training text, never the held-out slice
    # depths whose fact would fall inside two windows are left out, and tasks too long for the length
    assert retrieval.probe_depths(100, 40) == [0.0]
    assert retrieval.probe_documents(tiny_tokenizer, 100, 60, haystack) == []
    short = retrieval.probe_documents(tiny_tokenizer, 256, WINDOW, haystack)  # no room for four needles
    assert 0 < len(short) < len(docs)


def test_attention_on_facts_matches_the_teachers_own_attention_weights(tiny_llama_dir, tiny_tokenizer):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    haystack = retrieval.haystack_text([train_text()], 50_000)
    docs = retrieval.probe_documents(tiny_tokenizer, 512, WINDOW, haystack, tasks=["passkey", "niah_multikey"])[::3]
    rng = torch.get_rng_state()
    scores = retrieval.attention_on_facts(teacher, SETTINGS, docs)
    assert torch.equal(torch.get_rng_state(), rng)  # the student trained after the probe starts as without it
    expected = torch.zeros(teacher.config.num_hidden_layers, dtype=torch.float64)
    with torch.no_grad():
        for ids, fact, queries in docs:
            attentions = teacher(torch.tensor([ids]), output_attentions=True).attentions
            for layer, weights in enumerate(attentions):  # [1, H, T, T]
                expected[layer] += weights[0][:, queries][:, :, fact].sum(-1).mean(-1).sum().double()
    expected /= len(docs)
    assert sorted(scores) == list(range(teacher.config.num_hidden_layers))
    torch.testing.assert_close(torch.tensor([scores[i] for i in sorted(scores)], dtype=torch.float64), expected)
    assert all(s > 0 for s in scores.values())


def test_retrieval_placement_keeps_the_highest_scoring_layer_softmax(tmp_path, tiny_llama_dir, tiny_tokenizer):
    recipe = load_recipe("smollm2-gla")
    recipe.layers.placement, recipe.layers.ratio, recipe.layers.measured = "retrieval", "3:1", None
    recipe.attention.window, recipe.attention.sink = WINDOW, 2
    recipe.transfer.tokens = recipe.finetune.tokens = 0
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    _, report = convert(teacher, tiny_tokenizer, recipe=recipe, output=tmp_path / "out", measure=False)
    scores = {int(k): v for k, v in report.retrieval_scores.items()}
    assert sorted(scores) == [0, 1, 2, 3] and not report.layer_errors
    best = max(scores, key=scores.get)
    assert report.layer_types[best] == "full_attention" and report.layer_types.count("full_attention") == 1
    assert dict(report.rows())["softmax layers by retrieval score"] == f"{best} ({scores[best]:.2f})"
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["retrieval_scores"] == report.retrieval_scores
    # the recipe as run keeps the scored plan, so it repeats without probing
    assert f"measured: [{', '.join(str(i) for i in range(4) if i != best)}]" in saved["recipe_yaml"]


def test_retrieval_placement_spreads_when_the_context_cannot_reach_past_the_window(
    tmp_path, tiny_llama_dir, tiny_tokenizer, caplog
):
    recipe = load_recipe("smollm2-gla")  # window 512: the tiny model's whole 512-token context
    recipe.layers.placement, recipe.layers.measured = "retrieval", None
    recipe.transfer.tokens = recipe.finetune.tokens = 0
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    _, report = convert(teacher, tiny_tokenizer, recipe=recipe, measure=False)
    assert report.plan == "LLLS" and report.retrieval_scores == {}
    assert "the softmax layers are spread instead" in caplog.text
