"""Stage 2's losses against hand computations from full logits.

The KL is distillation's KL(teacher || student) = sum_v p_teacher (log p_teacher - log p_student),
taken at every position t that has a next token in its row (t < T - 1), with the teacher's and the
student's distributions from the same position, averaged over those B * (T - 1) positions. The CE is
-log p_student(token t + 1) at position t, averaged the same way. Both are made a chunk of positions
at a time, so a chunk boundary anywhere must leave the value and the gradient unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from linearize.convert.plan import plan_layers
from linearize.convert.recipes import Recipe
from linearize.convert.swap import linearize_model
from linearize.convert.train import lora_finetune, next_token_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B, T, HIDDEN, VOCAB = 2, 9, 16, 37


@pytest.fixture(scope="module")
def head_model() -> LlamaForCausalLM:
    """Only the output head matters here: logits = lm_head(hidden), with weights large enough that the
    distributions are far from uniform (near uniform ones would make KL nearly symmetric)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).requires_grad_(False)
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    return model


def states(seed: int) -> torch.Tensor:
    """Final hidden states [B, T, HIDDEN]."""
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed))


def full_logits(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(hidden).double()


def kl_reference(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions 0..T-2 of KL(teacher || student), both read at the same position."""
    teacher = torch.log_softmax(teacher_logits[:, :-1], -1)
    student = torch.log_softmax(student_logits[:, :-1], -1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def ce_reference(student_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean over positions 0..T-2 of -log p_student(ids[t + 1]) read at position t."""
    logp = torch.log_softmax(student_logits, -1)
    return -torch.stack([logp[b, t, ids[b, t + 1]] for b in range(B) for t in range(T - 1)]).mean()


def test_kl_is_teacher_to_student_at_the_same_position(head_model):
    teacher = states(2)
    student = teacher + states(1)  # near the teacher, as in distillation: a misaligned teacher is far
    s_logits, t_logits = full_logits(head_model, student), full_logits(head_model, teacher)
    expected = kl_reference(t_logits, s_logits)
    got = next_token_loss(head_model, student, target=teacher)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    # The reference tells apart the mistakes it guards against: the reverse direction, and a teacher
    # read one position late or early.
    reverse = kl_reference(s_logits, t_logits)
    late = kl_reference(t_logits[:, 1:], s_logits[:, :-1])
    early = kl_reference(t_logits[:, :-1], s_logits[:, 1:])
    for wrong in (reverse, late, early):
        assert abs(wrong.item() - expected.item()) > 0.05 * expected.item()


def test_kl_is_zero_only_for_the_teacher_itself(head_model):
    teacher = states(2)
    assert next_token_loss(head_model, teacher.clone(), target=teacher).item() == pytest.approx(0.0, abs=1e-5)
    shifted = torch.cat([teacher[:, :1], teacher[:, :-1]], dim=1)  # the teacher's states, one position late
    assert next_token_loss(head_model, shifted, target=teacher).item() > 0.1


def test_the_last_position_has_no_next_token_and_is_left_out(head_model):
    student, teacher = states(1), states(2)
    ids = torch.randint(VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    kl = next_token_loss(head_model, student, target=teacher)
    ce = next_token_loss(head_model, student, labels=ids)
    last_changed = student.clone(), teacher.clone()
    for x in last_changed:
        x[:, -1] = torch.randn(B, HIDDEN)
    assert next_token_loss(head_model, last_changed[0], target=last_changed[1]).item() == pytest.approx(kl.item(), rel=1e-6)
    assert next_token_loss(head_model, last_changed[0], labels=ids).item() == pytest.approx(ce.item(), rel=1e-6)
    first_label_changed = ids.clone()
    first_label_changed[:, 0] = (ids[:, 0] + 1) % VOCAB  # position 0 is a label for no prediction
    assert next_token_loss(head_model, student, labels=first_label_changed).item() == pytest.approx(ce.item(), rel=1e-6)
    first_changed = teacher.clone()
    first_changed[:, 0] = torch.randn(B, HIDDEN)
    assert next_token_loss(head_model, student, target=first_changed).item() != pytest.approx(kl.item(), rel=1e-3)


def test_ce_predicts_the_next_token(head_model):
    student = states(1)
    logits = full_logits(head_model, student)
    ids = torch.randint(VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    ids[:, 1:] = logits[:, :-1].argmax(-1)  # each next token is the student's likeliest guess for it
    expected = ce_reference(logits, ids)
    assert next_token_loss(head_model, student, labels=ids).item() == pytest.approx(expected.item(), rel=1e-5)
    same_position = ce_reference(logits, torch.cat([ids[:, :1], ids[:, :-1]], dim=1))  # the label one position late
    assert same_position.item() > 2 * expected.item()


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_chunk_boundaries_change_neither_the_value_nor_the_gradient(head_model, loss):
    """B * (T - 1) = 16 positions: chunks of 3, 5 and 7 cut rows in the middle, 8 at the row boundary."""
    teacher = states(2)
    ids = torch.randint(VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    expected = kl_reference(full_logits(head_model, teacher), full_logits(head_model, states(1)))
    if loss == "ce":
        expected = ce_reference(full_logits(head_model, states(1)), ids)
    reference_grad = None
    for chunk in (16, 1, 3, 5, 7, 8, 256):
        student = states(1).requires_grad_(True)
        kwargs = {"labels": ids} if loss == "ce" else {"target": teacher}
        value = next_token_loss(head_model, student, chunk=chunk, **kwargs)
        value.backward()
        assert value.item() == pytest.approx(expected.item(), rel=1e-5), chunk
        if reference_grad is None:
            reference_grad = student.grad
        torch.testing.assert_close(student.grad, reference_grad, rtol=1e-5, atol=1e-7)
        assert not student.grad[:, -1].any()  # the last position predicts nothing


def test_kl_gradient_reaches_the_student_only_and_matches_the_reference(head_model):
    student, teacher = states(1).requires_grad_(True), states(2).requires_grad_(True)
    next_token_loss(head_model, student, target=teacher, chunk=5).backward()
    assert teacher.grad is None  # the teacher is a fixed target
    ref_student = states(1).double().requires_grad_(True)
    with torch.no_grad():
        t_logits = full_logits(head_model, states(2))
    s_logits = torch.nn.functional.linear(ref_student, head_model.lm_head.weight.double())
    kl_reference(t_logits, s_logits).backward()
    torch.testing.assert_close(student.grad, ref_student.grad.float(), rtol=1e-4, atol=1e-6)


# ---- the loss lora_finetune trains on, from the models themselves ---------------------------------


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_finetune_trains_on_the_hand_computed_loss(tiny_llama_dir, loss):
    """Stage 2's first recorded loss (LoRA starts as the identity) is the hand computation from the full
    logits of the teacher (the original model) and the student (the linearized one): the student's and
    the teacher's forwards are not swapped, and the teacher really has softmax attention back."""
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).requires_grad_(False)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(30)  # sharper distributions: the KL's direction then shows
    settings = {**Recipe().linear_attention(), "window": 4, "sink": 1}
    student = linearize_model(teacher, plan_layers(4, linear_layers=[0, 1, 2]), settings, "tiny")
    rows, seq_len = 2, 12
    ids = torch.randint(teacher.config.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t_logits = teacher(ids, use_cache=False).logits.double()
        s_logits = student(ids, use_cache=False).logits.double()
    t_ref = torch.log_softmax(t_logits[:, :-1], -1)
    s_ref = torch.log_softmax(s_logits[:, :-1], -1)
    if loss == "kl":
        expected = (t_ref.exp() * (t_ref - s_ref)).sum(-1).mean()
        swapped = (s_ref.exp() * (s_ref - t_ref)).sum(-1).mean()  # the student's and teacher's passes swapped
        assert abs(swapped.item() - expected.item()) > 0.1 * expected.item()
    else:
        expected = -s_ref.gather(-1, ids[:, 1:, None]).mean()
    stage = dataclasses.replace(
        Recipe().finetune, tokens=rows * seq_len, seq_len=seq_len, batch_size=rows, loss=loss, lr=1e-3, lora_rank=2
    )
    result = lora_finetune(student, ids, stage, Accelerator(cpu=True), None)
    assert result.steps == 1
    assert result.curve[0][1] == pytest.approx(expected.item(), rel=1e-4)
