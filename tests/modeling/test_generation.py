"""Cached generation equals recomputation: greedy and sampled tokens, left padding, prefill in pieces,
padding inside a decode, and the positions of an all-linear continuation."""

from __future__ import annotations

import pytest
import torch
from hybrid import FULL, LIN, NEW, PLANS, PROMPT, VOCAB, greedy_by_recomputation, left_padded, make_model, random_ids
from transformers.cache_utils import DynamicCache

from linearize.modeling.modeling_linearize import LinearAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=list(PLANS), scope="module")
def plan_model(request):
    layer_types, settings = PLANS[request.param]
    return make_model(layer_types, settings, seed=7)


@torch.no_grad()
def test_greedy_cached_equals_recomputation(plan_model):
    ids = random_ids(1, PROMPT, seed=11)
    out = plan_model.generate(
        ids, max_new_tokens=NEW, do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True
    )
    expected, expected_logits = greedy_by_recomputation(plan_model, ids, NEW)
    assert out.sequences[0, PROMPT:].tolist() == expected[0].tolist()
    for step, (got, want) in enumerate(zip(out.logits, expected_logits, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
    uncached = plan_model.generate(ids, max_new_tokens=NEW, do_sample=False, use_cache=False)
    assert uncached[0, PROMPT:].tolist() == expected[0].tolist()


@torch.no_grad()
def test_sampling_gives_valid_seeded_tokens(plan_model):
    ids = random_ids(2, PROMPT, seed=12)
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        out = plan_model.generate(
            ids, max_new_tokens=NEW, do_sample=True, top_k=5, output_logits=True, return_dict_in_generate=True
        )
        runs.append(out)
    new = runs[0].sequences[:, PROMPT:]
    assert new.shape == (2, NEW)
    assert torch.equal(new, runs[1].sequences[:, PROMPT:]), "same seed, different samples"
    assert ((new >= 0) & (new < VOCAB)).all()
    for step, logits in enumerate(runs[0].logits):
        top = logits.topk(5, dim=-1).indices
        assert (top == new[:, step : step + 1]).any(-1).all(), f"step {step}: sampled a token outside the top 5"


@torch.no_grad()
def test_left_padded_batch_equals_rows_alone(plan_model):
    rows = [random_ids(PROMPT, seed=21), random_ids(6, seed=22), random_ids(13, seed=23)]
    ids, mask = left_padded(rows)
    batch = plan_model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    for i, row in enumerate(rows):
        alone = plan_model.generate(row[None], max_new_tokens=16, do_sample=False)
        assert batch[i, ids.shape[1] :].tolist() == alone[0, len(row) :].tolist(), f"row {i} (length {len(row)})"


@torch.no_grad()
def test_prefill_in_pieces_equals_one_pass(plan_model):
    """A cache continued by single tokens before and after its window fills (the window's ring turns in
    place), then a long chunk from a ring that does not start at slot 0 (chunked form from a state,
    window across the seam), then a token."""
    ids = random_ids(2, 51, seed=31)
    full = plan_model(ids, use_cache=False).logits
    cache = DynamicCache(config=plan_model.config)
    pieces = []
    for start, end in [(0, 2), (2, 3), (3, 4), (4, 20), (20, 21), (21, 22), (22, 23), (23, 50), (50, 51)]:
        mask = torch.ones(2, end, dtype=torch.long)
        out = plan_model(ids[:, start:end], attention_mask=mask, cache=cache, use_cache=True)
        cache = out.cache
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_padding_inside_a_decode_is_masked_once_the_window_has_moved_on(plan_model):
    """A mask with holes stepped token by token: the steps that see only real tokens (CPU, no autograd)
    skip reading and writing the ring's validity, and a hole that comes after them is still masked, in
    the window while it is there and in the state after it leaves, by steps and by a chunk after them."""
    ids = random_ids(2, 30, seed=32)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, 3] = mask[1, 14] = mask[0, 15] = 0
    full = plan_model(ids, attention_mask=mask, use_cache=False).logits
    cache = DynamicCache(config=plan_model.config)
    pieces = []
    for start, end in [(0, 3), *((t, t + 1) for t in range(3, 16)), (16, 21), *((t, t + 1) for t in range(21, 30))]:
        pieces.append(plan_model(ids[:, start:end], attention_mask=mask[:, :end], cache=cache).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, dim=1)[real], full[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padded", [False, True], ids=["real", "left-padded"])
@pytest.mark.parametrize("rope_features", [True, False], ids=["rotated", "unrotated"])
@torch.no_grad()
def test_steps_while_the_sinks_are_inside_the_window_equal_one_pass(padded, rope_features, monkeypatch):
    """Stepped token by token from a prompt shorter than sinks + window, every step takes the in-place
    `_gla_step`: it hides a sink's own copy while the ring still holds the sink, keeps a sink leaving the
    ring out of the state (also where no validity is read, the rows all real), and gives one pass's logits
    before, while and after the sinks leave; left-padded, the rows' sinks sit at different positions."""
    model = make_model([LIN, FULL, LIN], {"window": 4, "sink": 3, "chunk_size": 16, "rope_features": rope_features}, seed=7)
    ids = random_ids(2, 16, seed=33)
    mask = torch.ones(2, 16, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    full = model(ids, attention_mask=mask, use_cache=False).logits
    steps = []
    gla_step = LinearAttention._gla_step
    monkeypatch.setattr(LinearAttention, "_gla_step", lambda self, *args: steps.append(args[9]) or gla_step(self, *args))
    cache = DynamicCache(config=model.config)
    prompt = 5 if padded else 3  # the sinks are full after it
    pieces = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
    for t in range(prompt, 16):
        pieces.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, dim=1)[real], full[real], rtol=1e-4, atol=1e-4)
    assert sorted(steps) == sorted(list(range(prompt, 16)) * 2), "every step of both linear layers in place"


@torch.no_grad()
def test_all_linear_continuation_counts_its_own_positions():
    """No softmax layer holds a KV length: positions continue from the linear layers' own count."""
    model = make_model([LIN, LIN], {"window": 4, "chunk_size": 16})
    ids = random_ids(1, 12)
    full = model(ids, use_cache=False).logits
    cache = DynamicCache(config=model.config)
    model(ids[:, :7], cache=cache, use_cache=True)
    step = model(ids[:, 7:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(step, full[:, 7:], rtol=1e-5, atol=1e-5)


def test_a_cache_without_linear_layers_is_refused():
    model = make_model([LIN, FULL], {"chunk_size": 16})
    with pytest.raises(ValueError, match=r"DynamicCache\(config=model.config\)"):
        model(random_ids(1, 5), cache=DynamicCache(), use_cache=True)
