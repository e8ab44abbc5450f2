"""The hybrid model (issue 2): equal forms, cached generation, a cache that does not grow, swaps, errors.

Everything here runs on tiny random configs (hidden 32, 4 heads / 2 KV heads, vocab 128) in fp32
on one CPU thread; the embedded 135M model is only used by test_export.py and test_performer.py.
"""

from __future__ import annotations

import copy
import math
import re
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_linearize, tiny_fields
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
)

from linearize.convert.swap import check_supported, linearize_model
from linearize.modeling.configuration_linearize import STATES, LinearizeConfig
from transformers.models.llama.modeling_llama import repeat_kv

import linearize.modeling.cache_linearize as cache_linearize
import linearize.modeling.cpu_layout_linearize as cpu_layout_linearize
import linearize.modeling.decoding_linearize as decoding_linearize
import linearize.modeling.modeling_linearize as modeling_linearize
from linearize.modeling.cpu_layout_linearize import GateUpMLP, SplitGemvLinear, still_fused
from linearize.modeling.cache_linearize import LinearizeCacheLayer, ReservedDynamicLayer
from linearize.modeling.decoding_linearize import SoftmaxAttentionConfig, split_decode_attention
from linearize.modeling.modeling_linearize import (
    HedgehogFeatureMap,
    LinearAttention,
    LinearizeForCausalLM,
    TaylorFeatureMap,
    transfer_mse,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIN, FULL = "linear_attention", "full_attention"
VOCAB = 128


# ----------------------------------------------------------------------------------------------
# helpers


@torch.no_grad()
def randomize_new_parameters(model: LinearizeForCausalLM, seed: int = 0) -> None:
    """Give the linear layers' own parameters non-trivial values, so the test exercises them.

    The low-rank gate gets log-decays spread from ~0 down past the MIN_LOG_DECAY clamp (decays
    vary per token, head and channel), Hedgehog maps move off identity, window mixes off 0.5.
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen, dtype=p.dtype)

    for module in model.modules():
        if not isinstance(module, LinearAttention):
            continue
        if module.gate is not None:
            module.gate.up.weight.copy_(rand(module.gate.up.weight) * 2.0)
            module.gate.up.bias.copy_(torch.rand(module.gate.up.bias.shape, generator=gen) * -100.0 + 10.0)
        for name in ("feature_map_q", "feature_map_k"):
            fmap = getattr(module, name, None)
            if fmap is not None:
                fmap.weight.add_(rand(fmap.weight) * 0.3)
                if hasattr(fmap, "bias"):
                    fmap.bias.copy_(rand(fmap.bias) * 0.3)
        if hasattr(module, "write_strength"):  # delta rule write strengths from ~0 to ~1
            module.write_strength.proj.weight.copy_(rand(module.write_strength.proj.weight) * 2.0)
            module.write_strength.proj.bias.copy_(rand(module.write_strength.proj.bias))
        if hasattr(module, "conv"):
            module.conv.weight.add_(rand(module.conv.weight) * 0.3)
        if hasattr(module, "window_factor"):
            module.window_factor.copy_(rand(module.window_factor))


def make_model(layer_types, linear_attention, seed: int = 0, **overrides) -> LinearizeForCausalLM:
    model = make_tiny_linearize(layer_types, linear_attention, seed=seed, **overrides)
    randomize_new_parameters(model, seed)
    return model


def set_form(model: torch.nn.Module, form: str | None) -> None:
    for module in model.modules():
        if isinstance(module, LinearAttention):
            module.form = form


def forward_backward(model, ids, mask, weights, form):
    """Logits and the gradients of a fixed random projection of them, with every linear layer in `form`."""
    set_form(model, form)
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    (logits * weights).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    set_form(model, None)
    return logits.detach(), grads


def assert_forms_equal(model, ids, mask=None, forms=("chunk", "recurrent")):
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(*ids.shape, VOCAB, generator=gen) * valid[..., None]
    ref_logits, ref_grads = forward_backward(model, ids, mask, weights, "parallel")
    assert torch.isfinite(ref_logits[valid]).all()
    # every parameter takes part: the new ones (gates, feature maps, window mix) included
    missing = [name for name, p in model.named_parameters() if name not in ref_grads]
    assert not missing, f"no gradient reaches {missing}"
    for form in forms:
        logits, grads = forward_backward(model, ids, mask, weights, form)
        torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=1e-5, atol=1e-5, msg=lambda m: f"{form}: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            scale = max(1.0, ref.abs().max().item())
            torch.testing.assert_close(
                grads[name], ref, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{form}, grad of {name}: {m}"
            )


def left_padded(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenizer-free left padding: (input_ids, attention_mask)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def random_ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# 1. the three forms compute the same thing, forward and backward

DELTA = {"kind": "deltanet", "feature_map": "identity", "normalize": False, "gate": "lowrank"}
DELTA_NORMALIZED = {"kind": "deltanet", "feature_map": "hedgehog", "normalize": True, "gate": "lowrank"}
FORM_CASES = {
    "gla-hedgehog-lowrank": ([LIN, FULL, LIN], {"gate": "lowrank", "chunk_size": 16}),
    "gla-hedgehog-lowrank-window4": ([LIN, FULL, LIN], {"gate": "lowrank", "window": 4, "chunk_size": 16}),
    "gla-hedgehog-lowrank-window4-sink2": ([LIN, FULL, LIN], {"gate": "lowrank", "window": 4, "sink": 2, "chunk_size": 16}),
    "gla-hedgehog-key-window8-chunk32": ([LIN, LIN], {"gate": "key", "window": 8, "chunk_size": 32}),
    "gla-elu-key-window8": ([LIN, LIN], {"feature_map": "elu", "gate": "key", "window": 8, "chunk_size": 16}),
    "gla-elu-nogate": ([LIN, LIN], {"feature_map": "elu", "gate": "none", "chunk_size": 16}),
    "gla-identity-unnormalized-lowrank": (
        [LIN, FULL],
        {"feature_map": "identity", "normalize": False, "gate": "lowrank", "chunk_size": 16},
    ),
    "gla-identity-unnormalized-nogate": (
        [LIN, LIN],
        {"feature_map": "identity", "normalize": False, "gate": "none", "chunk_size": 32},
    ),
    "gla-taylor-retnet": ([LIN, FULL], {"feature_map": "taylor", "feature_dim": 4, "gate": "retnet", "chunk_size": 16}),
    "gla-taylor-lowrank-window4": (
        [LIN, LIN],
        {"feature_map": "taylor", "feature_dim": 4, "gate": "lowrank", "window": 4, "chunk_size": 16},
    ),
    "deltanet-identity-lowrank": ([LIN, FULL], {**DELTA, "chunk_size": 16}),
    "deltanet-identity-retnet-conv3": ([LIN, LIN], {**DELTA, "gate": "retnet", "conv_size": 3, "chunk_size": 16}),
    "deltanet-hedgehog-key-window4-sink2-conv4": (
        [LIN, FULL],
        {**DELTA, "feature_map": "hedgehog", "gate": "key", "window": 4, "sink": 2, "conv_size": 4, "chunk_size": 16},
    ),
    "deltanet-window4-unrotated": ([LIN, LIN], {**DELTA, "window": 4, "rope_features": False, "chunk_size": 32}),
    "deltanet-normalized-hedgehog-window4-sink2": (
        [LIN, FULL],
        {**DELTA_NORMALIZED, "window": 4, "sink": 2, "rope_features": False, "chunk_size": 16},
    ),
    "deltanet-normalized-elu-retnet": ([LIN, LIN], {**DELTA_NORMALIZED, "feature_map": "elu", "gate": "retnet", "chunk_size": 16}),
    "performer": ([LIN, FULL], {"kind": "performer", "feature_map": "performer", "chunk_size": 16}),
    "performer-window4": (
        [LIN, LIN],
        {"kind": "performer", "feature_map": "performer", "feature_dim": 48, "window": 4, "chunk_size": 16},
    ),
    "performer-window4-sink3": (
        [LIN, LIN],
        {"kind": "performer", "feature_map": "performer", "feature_dim": 48, "window": 4, "sink": 3, "chunk_size": 16},
    ),
    "gla-hedgehog-lowrank-window4-sink2-unrotated": (
        [LIN, FULL, LIN],
        {"gate": "lowrank", "window": 4, "sink": 2, "chunk_size": 16, "rope_features": False},
    ),
}


@pytest.mark.parametrize("T", [1, 7, 37, 70])
@pytest.mark.parametrize("case", list(FORM_CASES))
def test_forms_equal(case, T):
    """parallel == chunk == recurrent (logits and all parameter gradients), batch 2, GQA, odd lengths."""
    layer_types, settings = FORM_CASES[case]
    model = make_model(layer_types, settings, seed=T)
    assert_forms_equal(model, random_ids(2, T, seed=T))


@pytest.mark.parametrize("case", list(FORM_CASES))
def test_forms_equal_with_left_padding(case):
    """Same, with a left-padded batch (padding longer than the window and than a chunk) and the default form."""
    layer_types, settings = FORM_CASES[case]
    model = make_model(layer_types, settings, seed=3)
    ids, mask = left_padded([random_ids(37, seed=1), random_ids(9, seed=2), random_ids(20, seed=3)])
    assert_forms_equal(model, ids, mask, forms=("chunk", "recurrent", None))


@pytest.mark.parametrize("gate", ["retnet", "lowrank"])
@torch.no_grad()
def test_normalized_delta_rule_without_erase_is_gla(gate):
    """The normalized delta rule keeps GLA's state, write and decay (GLA's own per-channel low-rank gate,
    same weights): with its erase near zero it is GLA, and the erase is what sets it apart."""
    settings = {"feature_map": "hedgehog", "gate": gate, "window": 4, "sink": 2, "chunk_size": 16}
    gla = make_model([LIN, FULL, LIN], settings, seed=1)
    delta = make_tiny_linearize([LIN, FULL, LIN], {**settings, "kind": "deltanet", "normalize": True})
    missing, unexpected = delta.load_state_dict(gla.state_dict(), strict=False)
    assert not unexpected and missing and all(".write_strength." in name for name in missing)
    ids = random_ids(2, 37)
    erases = [m.write_strength.proj.bias for m in delta.modules() if isinstance(m, LinearAttention)]
    for bias in erases:
        bias.fill_(math.log(1e-5))
    torch.testing.assert_close(delta(ids).logits, gla(ids).logits, rtol=1e-4, atol=1e-4)
    for bias in erases:
        bias.fill_(0.0)
    assert (delta(ids).logits - gla(ids).logits).abs().max() > 1e-2


def test_decays_really_vary():
    """The form tests' gates are not trivial: decays span from ~1 down to the clamp, per token and channel."""
    model = make_model([LIN, FULL, LIN], FORM_CASES["gla-hedgehog-lowrank"][1])
    layer = model.model.layers[0]
    attn = layer.self_attn
    hidden = layer.input_layernorm(model.model.embed_tokens(random_ids(2, 37)))  # what the gate sees
    g = attn.gate(hidden)
    assert g.shape == (2, 2, 37, 2 * attn.head_dim)
    assert g.max() > -0.01 and g.min() <= -4.99
    assert g.std(dim=2).mean() > 0.1  # varies over time
    assert g.std(dim=-1).mean() > 0.1  # varies over channels


def dense_linear_attention(layer: LinearAttention, hidden: torch.Tensor, q, k, v, q_feat=None, k_feat=None) -> torch.Tensor:
    """The layer's math written out densely (no chunks, no states): o_i = sum_j A_ij v_j / sum_j A_ij.

    A key j enters the decaying state when it leaves the window (step j + W) and is decayed by every
    later step: A_ij = (1 - w) phi(q_i).(phi(k_j) * exp(b_i - b_{j+W})) for j <= i - W; the last W
    keys get w * exp(q_i.k_j / sqrt(D) - c_i) with c_i their max score (LoLCATs); w = sigmoid(window_factor).
    The first S tokens (attention sinks) always take the softmax side and never enter the state.
    The feature maps see q_feat/k_feat (q/k before RoPE) when given, else the RoPE'd q/k.
    """
    groups, W, S = layer.kv_groups, layer.window, layer.sink
    T = q.shape[2]
    g = layer._decay(hidden, k)
    fq = layer._query_features(q if q_feat is None else q_feat)
    fk = layer._key_features(k if k_feat is None else k_feat)
    b = torch.zeros_like(fk) if g is None else g.to(fk.dtype).expand_as(fk).contiguous()
    b = repeat_kv(b.cumsum(2), groups)
    fk, k, v = repeat_kv(fk, groups), repeat_kv(k, groups), repeat_kv(v, groups)
    entered = b[:, :, (torch.arange(T) + W).clamp(max=T - 1)]  # b at the step key j enters the state
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    decay = torch.exp(b[:, :, :, None, :] - entered[:, :, None, :, :])
    linear = torch.einsum("bhif,bhjf,bhijf->bhij", fq, fk, decay).masked_fill(~((j <= i - W) & (j >= S)), 0.0)
    if layer.map_name == "identity":
        linear = linear * layer.scaling
    if not layer.normalize:
        return linear @ v
    if W:
        scores = (q @ k.transpose(-1, -2)) * layer.scaling
        scores = scores.masked_fill(~((j <= i) & ((j > i - W) | (j < S))), float("-inf"))
        window = torch.exp(scores - scores.amax(-1, keepdim=True))
        w = torch.sigmoid(layer.window_factor)[None, :, None, None]
        weights = (1 - w) * linear + w * window
    else:
        weights = linear
    return (weights @ v) / weights.sum(-1, keepdim=True)


DENSE_CASES = {
    "hedgehog-lowrank": ([LIN], {"gate": "lowrank"}),
    "hedgehog-lowrank-window4": ([LIN], {"gate": "lowrank", "window": 4}),
    "elu-key-window8": ([LIN], {"feature_map": "elu", "gate": "key", "window": 8}),
    "hedgehog-lowrank-window4-sink2": ([LIN], {"gate": "lowrank", "window": 4, "sink": 2}),
    "elu-nogate-window4": ([LIN], {"feature_map": "elu", "gate": "none", "window": 4}),
    "identity-unnormalized-lowrank": ([LIN], {"feature_map": "identity", "normalize": False}),
    "hedgehog-lowrank-window4-sink2-unrotated": ([LIN], {"gate": "lowrank", "window": 4, "sink": 2, "rope_features": False}),
    "hedgehog-lowrank-unrotated": ([LIN], {"gate": "lowrank", "rope_features": False}),
}


@pytest.mark.parametrize("form", ["parallel", "chunk", "recurrent"])
@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_linear_layer_matches_dense_math(case, form):
    """An independent check of what the forms agree on: decays, window hand-over, mixing, GQA (fp32)."""
    check_dense_math(*DENSE_CASES[case], form)


def test_window_blocks_follow_the_window():
    from linearize.kernels.window_torch import window_block

    assert [window_block(w) for w in (512, 64, 96, 100, 8, 4, 97, 34)] == [64, 64, 48, 50, 8, 4, 97, 34]


@pytest.mark.parametrize("settings", [{"window": 12, "sink": 2}, {"window": 12, "feature_map": "elu", "gate": "key"}])
def test_window_blocks_smaller_than_the_window_give_the_same_layer(settings, monkeypatch):
    """Queries in blocks of 4 against a 12-token window (3 key blocks back), scored 8 queries at a time (and
    recomputed so in backward): the dense math, and the forms agree on outputs and gradients."""
    from linearize.kernels import window_torch

    monkeypatch.setattr(window_torch, "window_block", lambda window: 4)
    monkeypatch.setattr(window_torch, "WINDOW_GROUP_TOKENS", 8)
    check_dense_math([LIN], {"gate": "lowrank", **settings}, "chunk")
    model = make_model([LIN, FULL, LIN], {"gate": "lowrank", **settings, "chunk_size": 16}, seed=3)
    ids, mask = left_padded([random_ids(37, seed=1), random_ids(9, seed=2), random_ids(20, seed=3)])
    assert_forms_equal(model, ids, mask, forms=("chunk", "recurrent", None))


@torch.no_grad()
def check_dense_math(layer_types: list[str], settings: dict, form: str) -> None:
    model = make_model(layer_types, {**settings, "chunk_size": 16}, seed=9)
    layer = model.model.layers[0]
    attn = layer.self_attn
    attn.form = form
    ids = random_ids(2, 37, seed=9)
    hidden = layer.input_layernorm(model.model.embed_tokens(ids))
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(37)[None])
    got, weights = attn(hidden, position_embeddings)
    assert weights is None
    q_raw, k_raw, v = attn.project(hidden)
    q, k = attn.apply_rotary(q_raw, k_raw, *position_embeddings)
    unrotated = not settings.get("rope_features", True)
    expected = dense_linear_attention(attn, hidden, q, k, v, *((q_raw, k_raw) if unrotated else (None, None)))
    if unrotated:  # the check must be able to fail: RoPE'd features give another answer
        assert not torch.allclose(got, attn.o_proj(dense_linear_attention(attn, hidden, q, k, v).transpose(1, 2).reshape(2, 37, -1)), atol=1e-4)
    expected = attn.o_proj(expected.transpose(1, 2).reshape(2, 37, -1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("gate", ["lowrank", "key"])
@torch.no_grad()
def test_parallel_form_runs_in_other_dtypes(gate, dtype):
    """The gates return fp32 log-decays; the parallel reference must accept them next to fp64/bf16 q, k, v."""
    model = make_model([LIN, FULL], {"gate": gate, "chunk_size": 16}).to(dtype)
    ids = random_ids(2, 37)
    set_form(model, "chunk")
    chunk = model(ids, use_cache=False).logits.float()
    set_form(model, "parallel")
    parallel = model(ids, use_cache=False).logits.float()
    tol = 1e-9 if dtype == torch.float64 else 5e-2
    torch.testing.assert_close(parallel, chunk, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------
# 2. cached generation

PLANS = {
    "linear": ([LIN, FULL, LIN], {"chunk_size": 16}),
    "window": ([LIN, FULL, LIN], {"window": 4, "chunk_size": 16}),
    "window_sinks": ([LIN, FULL, LIN], {"window": 4, "sink": 3, "chunk_size": 16}),
    "window_sinks_unrotated": ([LIN, FULL, LIN], {"window": 4, "sink": 3, "chunk_size": 16, "rope_features": False}),
    "linear_unrotated": ([LIN, FULL, LIN], {"chunk_size": 16, "rope_features": False}),
    "all_linear": ([LIN, LIN, LIN], {"chunk_size": 16}),
    "deltanet_window_sinks_conv": ([LIN, FULL, LIN], {**DELTA, "window": 4, "sink": 2, "conv_size": 4, "chunk_size": 16}),
    "deltanet_normalized_window_sinks": ([LIN, FULL, LIN], {**DELTA_NORMALIZED, "window": 4, "sink": 2, "chunk_size": 16}),
    "gla_taylor_retnet": ([LIN, FULL, LIN], {"feature_map": "taylor", "feature_dim": 4, "gate": "retnet", "chunk_size": 16}),
    "all_hybrid_performer": ([LIN, LIN, LIN], {"kind": "performer", "feature_map": "performer", "window": 4}),
}
PROMPT = 21  # > RECURRENT_MAX_TOKENS (prefill takes the chunked path), > window, not a multiple of the chunk
NEW = 24


@pytest.fixture(params=list(PLANS), scope="module")
def plan_model(request):
    layer_types, settings = PLANS[request.param]
    return make_model(layer_types, settings, seed=7)


@torch.no_grad()
def greedy_by_recomputation(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding that recomputes the whole sequence every step (no cache)."""
    seq, all_logits = ids, []
    for _ in range(steps):
        logits = model(seq, use_cache=False).logits[:, -1]
        all_logits.append(logits)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=-1)
    return seq[:, ids.shape[1] :], all_logits


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


# ----------------------------------------------------------------------------------------------
# 3. the cache of linear layers does not grow


def recurrent_bytes(layer) -> int:
    states = getattr(layer, "recurrent_states", {}) or {}
    return sum(t.numel() * t.element_size() for t in states.values() if isinstance(t, torch.Tensor))


def kv_bytes(layer) -> int:
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or keys.numel() == 0:
        return 0
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()


@pytest.mark.parametrize("kind", ["gla", "performer", "gla-sinks", "deltanet"])
@torch.no_grad()
def test_cache_does_not_grow(kind):
    window = 4
    settings = {"window": window, "chunk_size": 16}
    if kind == "performer":
        settings.update(kind="performer", feature_map="performer")
    if kind == "gla-sinks":
        settings.update(sink=2)
    if kind == "deltanet":
        settings.update(DELTA, sink=2, conv_size=4)
    model = make_model([LIN, LIN, FULL], settings, seed=5)
    prompt = random_ids(1, 9, seed=41)
    caches = {}
    for n in (10, 1000):
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True)
        assert out.sequences.shape[1] == 9 + n
        caches[n] = out.cache
    short, long = caches[10].layers, caches[1000].layers
    # layer 0: linear -> a fixed-size state, no KV at all
    assert type(long[0]) is LinearizeCacheLayer
    assert recurrent_bytes(short[0]) == recurrent_bytes(long[0]) > 0
    assert kv_bytes(short[0]) == kv_bytes(long[0]) == 0
    if kind == "performer":  # the key stabilizer is the second state
        assert all(isinstance(long[0].recurrent_states[i], torch.Tensor) for i in (0, 1))
    # layer 1: the same fixed state, the window's last `window` keys/values among its states
    assert type(long[1]) is LinearizeCacheLayer
    assert recurrent_bytes(short[1]) == recurrent_bytes(long[1])
    window_kv = long[1].recurrent_states[STATES["window_kv"]]
    assert window_kv.shape[2:4] == (2, window)
    if kind in ("gla-sinks", "deltanet"):  # the two sink tokens' keys/values and positions, a fixed size too
        assert long[1].recurrent_states[STATES["sink_kv"]].shape[2:4] == (2, 2)
        assert long[1].recurrent_states[STATES["sink_positions"]].shape[1] == 2
    # layer 2: softmax -> an ordinary KV cache that grows with every token (appended in place)
    assert type(long[2]) is ReservedDynamicLayer and isinstance(long[2], DynamicLayer)
    assert long[2].keys.shape[2] == 9 + 1000 - 1
    assert kv_bytes(long[2]) > 50 * kv_bytes(short[2]) > 0


@pytest.mark.parametrize("kind", ["gla-sinks", "deltanet", "performer"])
@torch.no_grad()
def test_a_decoding_step_never_waits_on_the_device_and_keeps_its_state_buffer(kind):
    """Once the prompt is in (sinks full), a decoding step of the linear layers reads no tensor value on the
    host (no .item(), bool() or int() of a tensor: each is a device sync on CUDA) and updates the recurrent
    state and the window's ring where the cache holds them (static addresses, as CUDA graphs need). The
    one read allowed is the model's look at a CPU mask (`_note_padding`), which a CUDA mask never gets."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    settings = {"window": 4, "sink": 2, "chunk_size": 16}
    if kind == "deltanet":
        settings.update(DELTA, conv_size=4)
    if kind == "performer":
        settings.update(kind="performer", feature_map="performer", sink=0)
    model = make_model([LIN, LIN], settings, seed=5)  # all linear: positions come from the cache too
    prompt = random_ids(2, 12, seed=3)
    cache = DynamicCache(config=model.config)
    model(prompt, attention_mask=torch.ones_like(prompt), cache=cache)
    states = cache.layers[0].recurrent_states
    addresses = [states[STATES[name]].data_ptr() for name in ("memory", "window_kv")]

    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                callers = [frame.name for frame in traceback.extract_stack()]
                self.reads.append("_note_padding" if "_note_padding" in callers else callers[-2])
            return func(*args, **(kwargs or {}))

    mask = torch.ones(2, 13, dtype=torch.long)
    with HostReads() as mode:
        model(random_ids(2, 1, seed=4), attention_mask=mask, cache=cache)
    assert mode.reads == ["_note_padding"]
    assert [states[STATES[name]].data_ptr() for name in ("memory", "window_kv")] == addresses


@pytest.mark.parametrize("kind", ["gla-sinks", "deltanet", "performer"])
@torch.no_grad()
def test_a_reset_cache_starts_over(kind):
    """cache.reset() (how generate reuses a cache) zeros the buffers in place; the linear layers then start a new
    sequence at position 0, with empty sinks, window and state, as with a fresh cache."""
    settings = {"window": 4, "sink": 2, "chunk_size": 16}
    if kind == "deltanet":
        settings.update(DELTA, conv_size=4)
    if kind == "performer":
        settings.update(kind="performer", feature_map="performer", sink=0)
    model = make_model([LIN, LIN], settings, seed=5)

    def run(cache) -> torch.Tensor:
        logits = [model(random_ids(2, 9, seed=1), cache=cache).logits]
        logits += [model(random_ids(2, 1, seed=2 + t), cache=cache).logits for t in range(3)]
        return torch.cat(logits, dim=1)

    cache = DynamicCache(config=model.config)
    first = run(cache)
    model(random_ids(2, 7, seed=9), cache=cache)  # more tokens, then start over
    cache.reset()
    torch.testing.assert_close(run(cache), first)


STEP_CASES = {
    "sinks": {"window": 4, "sink": 2},
    "sinks-unrotated": {"window": 4, "sink": 2, "rope_features": False},
    "no-sinks": {"window": 4},
    "elu-key-gate": {"window": 4, "sink": 1, "feature_map": "elu", "gate": "key"},
    "identity-no-gate": {"window": 4, "feature_map": "identity", "gate": "none"},
    "taylor-retnet": {"window": 4, "sink": 2, "feature_map": "taylor", "feature_dim": 4, "gate": "retnet"},
}


@pytest.mark.parametrize("case", list(STEP_CASES))
@torch.no_grad()
def test_the_in_place_gla_step_equals_the_general_path(case, monkeypatch):
    """Once the window runs, GLA's decoding steps take `_gla_step`; each gives the general path's logits
    and leaves the same cache (state, ring, its unrotated keys), padded rows included."""
    model = make_model([LIN, FULL, LIN], {**STEP_CASES[case], "chunk_size": 16}, seed=9)
    # The short row's last padding leaves the window during decoding (where no sinks hold it back).
    ids, mask = left_padded([random_ids(11, seed=51), random_ids(2, seed=52)])
    cache = DynamicCache(config=model.config)
    model(ids, attention_mask=mask, cache=cache)
    taken = []
    monkeypatch.setattr(LinearAttention, "_gla_step", lambda self, *a, _f=LinearAttention._gla_step: taken.append(1) or _f(self, *a))
    general = copy.deepcopy(cache)
    for t in range(6):  # past a full turn of the ring
        token = random_ids(2, 1, seed=60 + t)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        fast = model(token, attention_mask=mask, cache=cache).logits
        with monkeypatch.context() as m:
            m.setattr(LinearAttention, "_steps_in_place", lambda *a: False)
            slow = model(token, attention_mask=mask, cache=general).logits
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    assert len(taken) >= 2 * 2 if STEP_CASES[case].get("sink") else len(taken) == 6 * 2, "the in-place step was taken"
    # A beam reorder replaces the states; the next step reads the new ones, to the same logits.
    cache.reorder_cache(torch.tensor([1, 0])), general.reorder_cache(torch.tensor([1, 0]))
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    fast = model(random_ids(2, 1, seed=70), attention_mask=mask, cache=cache).logits
    with monkeypatch.context() as m:
        m.setattr(LinearAttention, "_steps_in_place", lambda *a: False)
        slow = model(random_ids(2, 1, seed=70), attention_mask=mask, cache=general).logits
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    for index in (0, 2):
        got, want = cache.layers[index].recurrent_states, general.layers[index].recurrent_states
        for name, slot in STATES.items():
            if isinstance(want.get(slot), torch.Tensor):
                torch.testing.assert_close(got[slot], want[slot], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def cache_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    """Every tensor a hybrid cache holds: the linear layers' states, the softmax layers' views and their rooms."""
    found = []
    for layer in cache.layers:
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            found += [x for x in values if isinstance(x, torch.Tensor)]
    return found


@pytest.mark.parametrize("settings", [{"window": 4, "sink": 2}, {**DELTA, "window": 4, "sink": 2}], ids=["gla", "deltanet"])
@torch.no_grad()
def test_a_step_written_in_place_runs_in_inference_mode_and_leaves_ordinary_tensors(settings, monkeypatch):
    """An eager decoding step whose cache is only written in place (`_gla_step` in every linear layer, the
    softmax rooms made) runs under inference mode; the cache and the outputs stay ordinary tensors, so a
    later prompt outside inference mode continues the same cache. Other steps run as called."""
    monkeypatch.setattr(cache_linearize, "RESERVE_MIN", 1)  # the softmax room grows during the steps
    model = make_model([LIN, FULL, LIN], {**settings, "chunk_size": 16}, seed=3)
    modes = []
    model.linear_attentions[0].register_forward_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    ids = random_ids(1, 9, seed=70)
    cache = DynamicCache(config=model.config)
    model(ids, cache=cache)
    for t in range(5):
        token = random_ids(1, 1, seed=71 + t)
        out = model(token, cache=cache, output_hidden_states=True)
        ids = torch.cat([ids, token], dim=1)
        assert not out.logits.is_inference() and not any(h.is_inference() for h in out.hidden_states)
    out.logits.add_(1.0)  # an ordinary tensor takes in-place changes
    assert modes[0] is False and modes[1:] == [settings.get("kind") != "deltanet"] * 5
    assert not any(x.is_inference() for x in cache_tensors(cache))
    more = random_ids(1, 3, seed=80)
    cached = model(more, cache=cache).logits  # a prompt of several tokens: no inference mode, in-place writes
    full = model(torch.cat([ids, more], dim=1)).logits[:, -3:]
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_a_reserved_softmax_cache_appends_in_place_and_honours_outside_changes():
    """`ReservedDynamicLayer` returns what transformers' `DynamicLayer` returns for the same updates, writes
    decoding tokens into its reserved room without copying, and takes crop / beam reorder / reset as the truth."""
    gen = torch.Generator().manual_seed(0)

    def kv(batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 2, tokens, 8, generator=gen), torch.randn(batch, 2, tokens, 8, generator=gen)

    reserved, plain = ReservedDynamicLayer(), DynamicLayer()

    def update(batch: int, tokens: int) -> torch.Tensor:
        k, v = kv(batch, tokens)
        got, want = reserved.update(k, v), plain.update(k, v)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        assert reserved.get_seq_length() == plain.get_seq_length()
        return got[0]

    first = update(3, 300)
    room = first.data_ptr()
    for _ in range(20):
        assert update(3, 1).data_ptr() == room, "a decoding token is written in place"
    update(3, 200)  # past the room: reserved again, still equal
    reserved.crop(-5), plain.crop(-5)
    update(3, 1)
    beams = torch.tensor([2, 0, 0])
    reserved.reorder_cache(beams), plain.reorder_cache(beams)
    update(3, 2)
    reserved.reset(), plain.reset()
    assert reserved.get_seq_length() == 0
    update(1, 4)


@torch.no_grad()
def test_softmax_layers_of_a_fresh_cache_get_the_reserved_layer():
    model = make_model([LIN, FULL], {"chunk_size": 16})
    cache = DynamicCache(config=model.config)
    assert type(cache.layers[1]) is DynamicLayer
    model(random_ids(1, 5), cache=cache)
    assert type(cache.layers[1]) is ReservedDynamicLayer and cache.layers[1].get_seq_length() == 5


def bmm_calls(monkeypatch) -> list[int]:
    """Count `torch.bmm` calls: the split GEMV's product, which nothing else on these paths uses."""
    calls, bmm = [], torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *args, **kwargs: calls.append(1) or bmm(*args, **kwargs))
    return calls


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_the_split_gemv_equals_the_linear_layer(rows, bias, monkeypatch):
    torch.set_num_threads(2)
    calls = bmm_calls(monkeypatch)
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 20, bias=bias)
    split = copy.deepcopy(plain)
    monkeypatch.setattr(cpu_layout_linearize, "SPLIT_GEMV_MIN", 0)
    subclass = type("QuantizedLinear", (torch.nn.Linear,), {})(48, 20)  # owns its layout: left alone
    cpu_layout_linearize.lay_out_for_cpu_decode(torch.nn.Sequential(split, subclass), column_major=True)
    assert type(split) is SplitGemvLinear and split.weight.t().is_contiguous() and torch.equal(split.weight, plain.weight)
    assert type(subclass).__name__ == "QuantizedLinear" and subclass.weight.is_contiguous()
    x = torch.randn(rows, 1, 48)
    with torch.no_grad():
        torch.testing.assert_close(split(x), plain(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == (rows <= cpu_layout_linearize.SPLIT_GEMV_ROWS), "the split product runs for decoding-sized batches only"
    x.requires_grad_(True)
    y = split(x)
    assert len(calls) == (rows <= cpu_layout_linearize.SPLIT_GEMV_ROWS), "autograd takes nn.Linear's path"
    grads = torch.autograd.grad(y.square().sum(), [x, split.weight])
    want = torch.autograd.grad(plain(x).square().sum(), [x, plain.weight])
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_cpu_decoding_lays_weights_out_column_major_and_saving_puts_them_back(tmp_path, monkeypatch):
    """The first decoding step stores the large weights column-major (values, parameters and the tied
    head unchanged) and decodes through the split GEMV; saving and training see row-major weights."""
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_layout_linearize, "SPLIT_GEMV_MIN", 1024)
    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16}, tie_word_embeddings=True)
    before = {name: p for name, p in model.named_parameters()}
    ids = random_ids(1, PROMPT, seed=11)
    expected, expected_logits = greedy_by_recomputation(model, ids, NEW)
    assert not model.cpu_decode_layout, "prefill alone leaves the layout alone"
    calls = bmm_calls(monkeypatch)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, PROMPT:].tolist() == expected[0].tolist()
    for got, want in zip(out.logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    linear = model.model.layers[0].self_attn
    projections = [linear.q_proj, linear.k_proj, linear.v_proj]
    large = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() >= 1024]
    assert model.cpu_decode_layout and large and calls
    mlps = [layer.mlp for layer in model.model.layers]
    fused = [*linear.fused_parts, *(proj for mlp in mlps for proj in (mlp.gate_proj, mlp.up_proj))]
    assert all(type(m) is SplitGemvLinear and m.weight.t().is_contiguous() for m in large if m not in fused)
    # The linear layer's q/k/v weights and its gate's first projection are column slices of one column-major
    # tensor: one product a step.
    columns = linear.qkv_columns
    assert columns is not None and columns.is_contiguous()
    assert linear.fused_parts == (*projections, linear.gate.down)
    names = ("q_proj", "k_proj", "v_proj", "gate.down")
    assert torch.equal(columns.t(), torch.cat([before[f"model.layers.0.self_attn.{n}.weight"] for n in names]))
    offsets = [proj.weight.data_ptr() - columns.data_ptr() for proj in linear.fused_parts]
    widths = [proj.out_features for proj in linear.fused_parts]
    assert offsets == [4 * sum(widths[:i]) for i in range(len(widths))]
    # So are every MLP's gate and up weights (the family's MLP computes down(act(gate(x)) * up(x))).
    assert all(isinstance(mlp, GateUpMLP) and mlp.gate_up_columns is not None for mlp in mlps)
    assert all(still_fused(mlp.gate_up_columns, (mlp.gate_proj, mlp.up_proj)) for mlp in mlps)
    assert {name: p for name, p in model.named_parameters()} == before, "the same parameter objects"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert all(m.weight.is_contiguous() for m in large) and not model.cpu_decode_layout and linear.qkv_columns is None
    assert all(mlp.gate_up_columns is None for mlp in mlps)
    reloaded = LinearizeForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    model.generate(ids, max_new_tokens=2, do_sample=False)
    assert model.cpu_decode_layout and linear.qkv_columns is not None
    model.train()
    assert all(m.weight.is_contiguous() for m in large) and not model.cpu_decode_layout and linear.qkv_columns is None
    model.eval()


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 3])
def test_hedgehog_step_follows_its_parameters(batch):
    """A step's Hedgehog map (one token per row, no autograd) uses [W, -W] and [b, -b] made once: it must
    equal `hedgehog`, and be made again when a parameter changes in place or is replaced."""
    from linearize.kernels.feature_maps import hedgehog

    torch.manual_seed(0)
    fmap = HedgehogFeatureMap(3, 8, 8)
    with torch.no_grad():
        fmap.weight.normal_()
        fmap.bias.normal_()
    x = torch.randn(batch, 3, 1, 8)

    def check() -> None:
        with torch.no_grad():
            torch.testing.assert_close(fmap(x), hedgehog(x, fmap.weight, fmap.bias), rtol=1e-6, atol=1e-7)

    check()
    made = fmap._signed_cache[2]
    check()
    assert fmap._signed_cache[2] is made  # kept while nothing changed
    with torch.no_grad():
        fmap.weight.mul_(2.0)
    check()
    fmap.bias.data = torch.randn(3, 8)
    check()
    with torch.inference_mode():  # as an in-place decoding step runs it
        torch.testing.assert_close(fmap(x), hedgehog(x, fmap.weight, fmap.bias), rtol=1e-6, atol=1e-7)
    with torch.inference_mode():  # parameters made as accelerate's offload hooks load them: no version to key on
        fmap.weight.data, fmap.bias.data = fmap.weight * 0.5, fmap.bias + 1.0
        torch.testing.assert_close(fmap(x), hedgehog(x, fmap.weight, fmap.bias), rtol=1e-6, atol=1e-7)
        fmap.weight.mul_(3.0)
        torch.testing.assert_close(fmap(x), hedgehog(x, fmap.weight, fmap.bias), rtol=1e-6, atol=1e-7)


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 3])
def test_a_steps_paired_hedgehog_maps_equal_the_two_maps(batch):
    """A decoding step runs phi(q) and phi(k) as one product over both maps' signed weights, joined once:
    it must equal the two maps apart, and follow a change to either."""
    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16})
    linear = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, linear.n_heads, 1, linear.head_dim, generator=gen)
    k = torch.randn(batch, linear.n_kv_heads, 1, linear.head_dim, generator=gen)

    def check() -> None:
        fq, fk = linear._step_features(q, k)
        torch.testing.assert_close(fq, linear.feature_map_q(q), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fk, linear.feature_map_k(k), rtol=1e-6, atol=1e-7)

    check()
    made = linear._paired_maps_cache[2]
    check()
    assert linear._paired_maps_cache[2] is made
    linear.feature_map_k.weight.mul_(2.0)
    check()
    linear.feature_map_q.bias.data = torch.randn_like(linear.feature_map_q.bias)
    check()
    linear.feature_map_k.to(torch.float64)  # maps of another dtype (or on another device, offloaded) run apart
    made = linear._paired_maps_cache[2]
    check()
    assert linear._paired_maps_cache[2] is made


@torch.no_grad()
def test_only_an_mlp_computing_the_gated_formula_takes_the_fused_product():
    """`gate_up_mlp_class` checks each MLP class once against down(act(gate(x)) * up(x)); a class that computes
    anything else keeps its own forward, and a fused MLP whose weights were replaced falls back to it."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16})
    mlp = model.model.layers[0].mlp
    assert type(mlp) is LlamaMLP

    class ScaledMLP(LlamaMLP):
        def forward(self, x):
            return 0.5 * super().forward(x)

    other = copy.deepcopy(mlp)
    other.__class__ = ScaledMLP
    assert cpu_layout_linearize.gate_up_mlp_class(other) is None
    gated = cpu_layout_linearize.gate_up_mlp_class(mlp)
    assert gated is not None and issubclass(gated, GateUpMLP) and issubclass(gated, LlamaMLP)
    x = torch.randn(1, 1, mlp.gate_proj.in_features)
    want = mlp(x)
    mlp.__class__ = gated
    mlp.gate_up_columns = cpu_layout_linearize.fuse_columns((mlp.gate_proj, mlp.up_proj))
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.contiguous() * 2  # replaced: the columns are stale
    torch.testing.assert_close(mlp(x), LlamaMLP.forward(mlp, x))
    assert mlp.gate_up_columns is None


def test_a_fused_projection_left_stale_by_a_conversion_is_dropped():
    """A round trip through float64 gives the q/k/v parameters new fp32 tensors: the old fused columns,
    of the same dtype again, must not serve the next step (a changed weight shows it), and are dropped."""
    torch.set_num_threads(2)
    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16})
    ids = random_ids(1, PROMPT, seed=13)
    model.generate(ids, max_new_tokens=2, do_sample=False)
    linear = model.model.layers[0].self_attn
    assert linear.qkv_columns is not None
    model.double().float()
    with torch.no_grad():
        linear.q_proj.weight.mul_(1.5)
    expected, expected_logits = greedy_by_recomputation(model, ids, NEW)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, PROMPT:].tolist() == expected[0].tolist()
    for got, want in zip(out.logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert linear.qkv_columns is None


@pytest.mark.parametrize(
    "layer_types, kind",
    [([LIN, FULL], {}), ([LIN, LIN], {}), ([LIN, FULL], DELTA)],
    ids=["hybrid", "all-linear", "deltanet-hybrid"],
)
@torch.no_grad()
def test_compiled_decoding_generates_what_the_eager_model_does(layer_types, kind, monkeypatch):
    """After `compile_decoding`, generate's steps past the filling sinks run one torch.compile graph
    without graph breaks (the position symbolic from the first) and give the eager model's tokens
    and logits; the weights stay row-major, and the softmax layers keep their reserved, in-place caches.
    The delta rule's steps (the general path, not `_gla_step`) keep one graph too."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(2)
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(cpu_layout_linearize, "SPLIT_GEMV_MIN", 1024)
    model = make_model(layer_types, {**kind, "window": 4, "sink": 4, "chunk_size": 16}, tie_word_embeddings=True)
    ids = random_ids(1, 3, seed=12)  # the first step fills the last sink: it stays eager (a host sync)
    expected, expected_logits = greedy_by_recomputation(model, ids, NEW)
    assert model.compile_decoding() is model
    steps = []
    compiled = model.compiled_step
    model.compiled_step = lambda *args, **kwargs: steps.append(1) or compiled(*args, **kwargs)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, 3:].tolist() == expected[0].tolist()
    for got, want in zip(out.logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(steps) == NEW - 2, "every step once the sinks are full runs the compiled graph"
    assert not counters["graph_break"], dict(counters["graph_break"])
    # The position is symbolic from the first compiled step (STEP_SIZES), and the same step serves while the
    # sinks are inside the window and after (it masks them itself): one graph for 22 positions, none made
    # when the ring wraps to its first slot (5 times here).
    assert counters["stats"]["unique_graphs"] == 1, "one graph, not one per position or regime"
    large = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() >= 1024]
    assert large and all(type(m) is SplitGemvLinear and m.weight.is_contiguous() for m in large)
    assert not model.cpu_decode_layout
    assert any(type(layer) is cache_linearize.ReservedDynamicLayer for layer in out.cache.layers) == (FULL in layer_types)
    assert not any(x.is_inference() for x in cache_tensors(out.cache)), "the graph ran in inference mode, writing in place"


def test_symbolic_step_sizes_keeps_the_users_dynamic_sources_and_needs_none_from_an_older_torch(monkeypatch):
    """The compiled step runs with STEP_SIZES added to whatever dynamic sources the user set, restored after;
    a torch without `dynamic_sources` gets the step itself (it then compiles as Dynamo decides)."""
    seen = []
    step = decoding_linearize.symbolic_step_sizes(lambda x: seen.append(torch.compiler.config.dynamic_sources) or x)
    with torch.compiler.config.patch(dynamic_sources="L['mine']"):
        assert step(3) == 3
        assert torch.compiler.config.dynamic_sources == "L['mine']"
    assert seen == ["L['mine']," + decoding_linearize.STEP_SIZES]
    monkeypatch.setattr(torch.compiler, "config", types.SimpleNamespace())
    assert decoding_linearize.symbolic_step_sizes(abs) is abs


@torch.no_grad()
def test_compiled_decoding_of_a_padded_batch_through_growing_rooms(monkeypatch):
    """Two rows, one left-padded (the softmax layer's step takes SDPA's masked path inside the graph),
    past two growths of the reserved room: the eager model's tokens and logits."""
    torch.set_num_threads(2)
    torch._dynamo.reset()
    monkeypatch.setattr(cache_linearize, "RESERVE_MIN", 4)
    model = make_model([LIN, FULL, LIN], {"window": 4, "sink": 2, "chunk_size": 16})
    ids = random_ids(2, 9, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = model.generate(ids, **kwargs)
    got = model.compile_decoding().generate(ids, **kwargs)
    assert got.sequences.tolist() == want.sequences.tolist()
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    softmax = got.cache.layers[1]
    assert type(softmax) is cache_linearize.ReservedDynamicLayer and softmax.room[0].shape[-2] > 9 + 4 + 1
    assert not any(x.is_inference() for x in cache_tensors(got.cache)), "the rooms grew outside inference mode"


def calls_an_extern_kernel(codes: list[str]) -> bool:
    """Whether inductor's generated code leaves any product to an extern (library) kernel."""
    return any(re.search(r"extern_kernels\.\w+\(", code) for code in codes)


@pytest.mark.parametrize("prompt", [12, 3], ids=["sinks-behind", "sinks-in-window"])
@pytest.mark.parametrize("layer_types", [[LIN, LIN], [LIN, FULL]], ids=["all-linear", "hybrid"])
@torch.no_grad()
def test_the_compiled_step_fuses_its_products_and_writes_the_rings_in_place(layer_types, prompt, monkeypatch):
    """On CPU, compiled: after inductor's reinplacing no functional scatter is left, so each ring's
    new slot, and a softmax layer's new token in its reserved room, is written in place where a
    scatter would rewrite the whole buffer every token (COMPILED_STEP_OPTIONS), from a prompt past sinks
    + window and from one that starts with the sinks inside it; a full room grows outside the graph. All-linear, no extern BLAS call is left either (the small products are `step_bmm`'s fused
    multiply-and-sum, the small linears the split GEMV's)."""
    import torch._inductor.fx_passes.post_grad as post_grad
    from torch._inductor.utils import run_and_get_code

    from torch._dynamo.utils import counters

    torch.set_num_threads(2)
    torch._dynamo.reset()
    counters.clear()
    left, reinplace = [], post_grad.reinplace_inplaceable_ops

    def reinplace_and_record(*args) -> None:
        reinplace(*args)
        functional = (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default)
        left.extend(
            n.target
            for n in args[-1].nodes
            if n.op == "call_function" and ("scatter" in str(n.target) or n.target in functional)
        )

    monkeypatch.setattr(post_grad, "reinplace_inplaceable_ops", reinplace_and_record)
    # rope_features off: keys wait in the window unrotated, so a second ring (the payload) is written too.
    monkeypatch.setattr(cache_linearize, "RESERVE_MIN", 4)
    model = make_model(layer_types, {"window": 4, "sink": 2, "chunk_size": 16, "rope_features": False})
    cache = DynamicCache(config=model.config)
    ids = random_ids(1, prompt, seed=13)
    token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
    model.compile_decoding()
    steps = 16  # the softmax room grows at least twice

    def decode() -> None:
        nonlocal token, ids
        for _ in range(steps):
            ids = torch.cat([ids, token], 1)
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)

    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would skip the passes
        _, codes = run_and_get_code(decode)
    assert codes and cache.layers[0].recurrent_states[STATES["window_payload"]] is not None
    assert not left, f"slot writes left as whole-buffer scatters: {left}"
    # One graph: the position and the room's capacity are symbolic from the first step (STEP_SIZES), and
    # the step masks sinks still inside the window itself, so neither the next positions, nor the sinks
    # leaving the window, nor its wraps (4 here), nor the room's growths compile again.
    assert counters["stats"]["unique_graphs"] == 1
    if FULL in layer_types:
        softmax = cache.layers[1]
        assert type(softmax) is cache_linearize.ReservedDynamicLayer and softmax.keys.shape[-2] == ids.shape[1]
        assert softmax.room[0].shape[-2] > 16, "the room grew"
        assert softmax.keys.untyped_storage().data_ptr() == softmax.room[0].untyped_storage().data_ptr()
        want = model(ids).logits[:, -1:].argmax(-1)
        assert torch.equal(token, want)
    else:
        assert not calls_an_extern_kernel(codes), "a product left to an extern kernel"


@torch.no_grad()
def test_compiled_split_gemv_fuses_every_one_row_product():
    """Compiled, a one-row product over a row-major weight fuses into inductor's own reduction at any size
    (no library GEMV: its speed over row-major weights varies 3x between CPUs); several rows keep nn.Linear's
    path. Both give nn.Linear's answer."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    for rows, out_features, extern in [(1, 48, False), (1, 1 << 17, False), (3, 48, True)]:  # 4M elements: a head
        x = torch.randn(rows, 1, 32)
        layer = torch.nn.Linear(32, out_features)
        want = layer(x)
        layer.__class__ = SplitGemvLinear
        with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would return no code
            got, codes = run_and_get_code(torch.compile(layer, dynamic=False), x)
        torch.testing.assert_close(got, want)
        assert codes
        assert calls_an_extern_kernel(codes) == extern, (rows, out_features)


def sdpa_calls(monkeypatch) -> list[int]:
    calls, sdpa = [], decoding_linearize.sdpa_attention_forward
    monkeypatch.setattr(decoding_linearize, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    return calls


@pytest.mark.parametrize("keys", [40, 43])
@pytest.mark.parametrize("scaling", [None, 0.3])
@torch.no_grad()
def test_split_decode_attention_equals_sdpa(keys, scaling, monkeypatch):
    """One query over a long GQA cache (keys past the blocks' multiple, a reserved cache's strided view): SDPA's answer."""
    monkeypatch.setattr(decoding_linearize, "SPLIT_DECODE_MIN_KEYS", 32)
    torch.manual_seed(0)
    room = torch.randn(2, 2, 2, 64, 8)  # [B, Hkv, k | v, room, D]
    key, value = room[:, :, 0, :keys], room[:, :, 1, :keys]
    query = torch.randn(2, 6, 1, 8)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 3
    want, _ = decoding_linearize.sdpa_attention_forward(module, query, key, value, None, scaling=scaling)
    calls = sdpa_calls(monkeypatch)
    got, weights = split_decode_attention(module, query, key, value, None, scaling=scaling)
    assert not calls and weights is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mask = torch.ones(2, 1, 1, keys, dtype=torch.bool)
    split_decode_attention(module, query, key, value, mask, scaling=scaling)
    split_decode_attention(module, torch.cat([query, query], 2), key, value, None, scaling=scaling)
    assert len(calls) == 2, "a mask or another query count is SDPA's"


@torch.no_grad()
def test_split_decode_attention_compiled_is_one_grouped_product(monkeypatch):
    """Inside a compiled graph, one query over a short strided GQA cache: SDPA's answer, from two
    products for all heads (not SDPA, nor the eager path's per-head blocks unrolled)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    room = torch.randn(2, 2, 2, 64, 8)
    key, value = room[:, :, 0, :40], room[:, :, 1, :40]
    query = torch.randn(2, 6, 1, 8)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 3
    want, _ = decoding_linearize.sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    calls = sdpa_calls(monkeypatch)
    graphs = []

    def record(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(split_decode_attention, backend=record, fullgraph=True)
    got, weights = compiled(module, query, key, value, None, scaling=0.3)
    assert not calls and weights is None
    products = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in (torch.matmul, torch.bmm)]
    assert len(products) == 2, [n.target for n in graphs[0].graph.nodes]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_softmax_layers_see_split_decode_for_sdpa_and_follow_the_model(monkeypatch):
    monkeypatch.setattr(decoding_linearize, "SPLIT_DECODE_MIN_KEYS", 4)
    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16}, attn_implementation="sdpa")
    softmax = model.model.layers[1].self_attn
    assert isinstance(softmax.config, SoftmaxAttentionConfig) and softmax.config.base is model.model.config
    assert model.config._attn_implementation == "sdpa"
    assert softmax.config._attn_implementation == decoding_linearize.SPLIT_DECODE
    assert softmax.config.hidden_size == model.config.hidden_size
    ids = random_ids(1, PROMPT, seed=11)
    expected, expected_logits = greedy_by_recomputation(model, ids, NEW)
    calls = []
    split = decoding_linearize.split_decode_attention
    interface = decoding_linearize.AttentionInterface
    interface.register(decoding_linearize.SPLIT_DECODE, lambda *a, **k: calls.append(a[1].shape[2]) or split(*a, **k))
    try:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    finally:
        interface.register(decoding_linearize.SPLIT_DECODE, split)
    assert out.sequences[0, PROMPT:].tolist() == expected[0].tolist() and calls.count(1) == NEW - 1
    for got, want in zip(out.logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    model.set_attn_implementation("eager")
    assert softmax.config._attn_implementation == "eager"


# ----------------------------------------------------------------------------------------------
# 6. teachers in memory swap exactly (every family: tests/modeling/test_families.py)


def _base(**extra):
    return tiny_fields(vocab_size=VOCAB, num_hidden_layers=3, max_position_embeddings=256, initializer_range=0.2, **extra)


TEACHERS = {
    "llama-bias-tied": lambda: LlamaForCausalLM(
        LlamaConfig(**_base(attention_bias=True, mlp_bias=True, tie_word_embeddings=True))
    ),
    "qwen2-qkv-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**_base())),
}


def make_teacher(name: str):
    torch.manual_seed(0)
    teacher = TEACHERS[name]().eval()
    with torch.no_grad():  # biases and norm weights off their trivial init, so reusing them is tested
        for pname, p in teacher.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0, 0.5)
            elif "norm" in pname:
                p.uniform_(0.5, 1.5)
    return teacher


@torch.no_grad()
def test_transfer_mode_passes_the_teacher_output_on():
    """Stage 1: linear layers in `transfer` mode output the teacher's softmax result and record their MSE to it."""
    teacher = make_teacher("llama-bias-tied")
    student = linearize_model(teacher, [LIN, FULL, LIN], {"window": 4, "chunk_size": 16}).eval()
    randomize_new_parameters(student)
    linear = [m for m in student.modules() if isinstance(m, LinearAttention)]
    for module in linear:
        module.transfer = True
    ids, mask = left_padded([random_ids(23, seed=1), random_ids(12, seed=2)])
    valid = mask.bool()
    got = student(ids, attention_mask=mask, use_cache=False).logits[valid]
    torch.testing.assert_close(got, teacher(ids, attention_mask=mask).logits[valid], rtol=1e-5, atol=1e-5)
    losses = [module.transfer_loss for module in linear]
    assert all(loss is not None and torch.isfinite(loss) and loss > 0 for loss in losses)
    for module in linear:
        module.transfer = False
    assert not torch.allclose(student(ids, attention_mask=mask).logits[valid], got, atol=1e-3)


@pytest.mark.parametrize("settings", [{"window": 8, "sink": 2}, {**DELTA, "window": 8, "sink": 2, "conv_size": 4}], ids=["gla", "deltanet"])
@torch.no_grad()
def test_a_context_within_the_window_is_the_teachers_softmax(settings):
    """Until a token leaves the window the state is empty, and whatever the new parameters hold, a converted
    layer is its teacher's softmax: GLA through the shared normalizer, the delta rule because its output is
    added to the window's (a convex mix would shrink the softmax by the window factor)."""
    teacher = make_teacher("llama-bias-tied")
    student = linearize_model(copy.deepcopy(teacher), [LIN, FULL, LIN], {**settings, "chunk_size": 16}).eval()
    randomize_new_parameters(student)
    ids, mask = left_padded([random_ids(8, seed=1), random_ids(5, seed=2)])
    valid = mask.bool()
    torch.testing.assert_close(
        student(ids, attention_mask=mask).logits[valid], teacher(ids, attention_mask=mask).logits[valid], rtol=1e-5, atol=1e-5
    )
    longer = random_ids(1, 12, seed=3)  # past the window the state takes part
    assert not torch.allclose(student(longer).logits[0, -1], teacher(longer).logits[0, -1], atol=1e-3)


@pytest.mark.parametrize("sink", [0, 4], ids=["no-sinks", "sinks-inside"])
@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_scoring_inside_the_window_takes_one_softmax_and_keeps_every_logit(sink, side, monkeypatch):
    """A padded batch that fits the window (how lm-eval scores) runs one SDPA call per linear layer, no state
    work, and its logits at real tokens equal the general path's (window blocks, empty GLA state, shared
    normalizer) and the teacher's on each row alone. A cache it fills continues exactly past the window."""
    teacher = make_teacher("llama-bias-tied")
    student = linearize_model(copy.deepcopy(teacher), [LIN, FULL, LIN], {"window": 16, "sink": sink, "chunk_size": 16}).eval()
    randomize_new_parameters(student)
    rows = [random_ids(14, seed=1), random_ids(9, seed=2), random_ids(5, seed=3)]
    ids, mask = left_padded(rows)
    if side == "right":
        ids, mask = ids.flip(1), mask.flip(1)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
    valid = mask.bool()
    calls = []
    inside = LinearAttention._inside_window
    monkeypatch.setattr(LinearAttention, "_inside_window", lambda self, *a: calls.append(1) or inside(self, *a))
    fast = {use_cache: student(ids, attention_mask=mask, use_cache=use_cache).logits for use_cache in (False, True)}
    assert len(calls) == 4  # two linear layers, with and without a cache
    monkeypatch.setattr(modeling_linearize, "SDPA_GROUPS", False)  # torch < 2.5: KV heads repeated for SDPA
    fast["repeated"] = student(ids, attention_mask=mask, use_cache=False).logits
    monkeypatch.setattr(LinearAttention, "_has_gla_step", lambda self: False)  # the general path
    general = student(ids, attention_mask=mask, use_cache=False).logits
    for logits in fast.values():
        torch.testing.assert_close(logits[valid], general[valid], rtol=1e-5, atol=1e-5)
    for i, row in enumerate(rows):
        alone = teacher(row[None]).logits[0]
        torch.testing.assert_close(fast[False][i][valid[i]], alone, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    # a prefill inside the window, then steps and a chunk that carry tokens out of it: as one pass
    longer = random_ids(2, 30, seed=4)
    full = student(longer, use_cache=False).logits
    cache, pieces = None, []
    for start, end in [(0, 12), (12, 13), (13, 14), (14, 30)]:
        out = student(longer[:, start:end], cache=cache, use_cache=True)
        cache = out.cache
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)


def test_transfer_mse_leans_toward_late_positions():
    """`late_weight` 0 is the plain MSE; above 0 an error at the end counts more than the same error at the start."""
    teacher = torch.randn(2, 10, 6)
    early, late = teacher.clone(), teacher.clone()
    early[:, 1] += 1.0
    late[:, 8] += 1.0
    torch.testing.assert_close(transfer_mse(early, teacher), F.mse_loss(early, teacher))
    torch.testing.assert_close(transfer_mse(early, teacher, 0.0), transfer_mse(late, teacher, 0.0))
    weights = 1 + 3.0 * torch.arange(10) / 10
    torch.testing.assert_close(transfer_mse(late, teacher, 3.0), F.mse_loss(late, teacher) * 10 * weights[8] / weights.sum())
    assert transfer_mse(late, teacher, 3.0) > transfer_mse(early, teacher, 3.0)
    uniform = torch.full_like(teacher, 0.5)
    torch.testing.assert_close(transfer_mse(teacher + uniform, teacher, 3.0), F.mse_loss(teacher + uniform, teacher))


@pytest.mark.parametrize("plan", ["linear", "window"])
@torch.no_grad()
def test_bfloat16_model_runs_close_to_fp32(plan):
    layer_types, settings = PLANS[plan]
    model = make_model(layer_types, settings, seed=7)
    ids = random_ids(2, 37)
    reference = model(ids, use_cache=False).logits
    low = copy.deepcopy(model).to(torch.bfloat16)
    logits = low(ids, use_cache=False).logits.float()
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, reference, rtol=0.05, atol=0.05)
    out = low.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 42)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16},
    ],
    ids=lambda r: r["rope_type"],
)
@torch.no_grad()
def test_rope_variants_are_reused_exactly(rope):
    """Scaled RoPE of the teacher (longer input than max_position_embeddings for `dynamic`)."""
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(**{**_base(), "max_position_embeddings": 32}, rope_parameters=rope)).eval()
    student = linearize_model(teacher, [FULL] * 3).eval()
    ids = random_ids(1, 48)
    torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# 5. errors


def test_unsupported_architecture_lists_supported_families():
    teacher = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64))
    with pytest.raises(ValueError, match="gpt2") as info:
        linearize_model(teacher, [FULL, FULL])
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        assert family in str(info.value)
    with pytest.raises(ValueError, match="llama"):
        check_supported(teacher.config)


def tiny_config(layer_types, settings=None) -> LinearizeConfig:
    return LinearizeConfig(**tiny_fields(vocab_size=VOCAB, layer_types=layer_types, linear_attention=settings))


@pytest.mark.parametrize(
    "layer_types, pattern",
    [
        ([LIN], r"layer_types has 1 entries but the model has 2 layers"),
        ([LIN, FULL, LIN], r"3 entries"),
        (
            ["full", "linear"],
            r"unknown layer types \['full', 'linear'\].*full_attention.*linear_attention",
        ),
        ([FULL, "sliding_attention"], r"unknown layer types \['sliding_attention'\]"),
        ([FULL, "hybrid_sliding"], r"unknown layer types \['hybrid_sliding'\]"),
    ],
)
def test_bad_layer_types_raise_clear_value_error(layer_types, pattern):
    with pytest.raises(ValueError, match=pattern):
        tiny_config(layer_types)


def test_bad_layer_plan_through_swap():
    teacher = make_teacher("qwen2-qkv-bias")
    with pytest.raises(ValueError, match="layer_types"):
        linearize_model(teacher, [LIN, FULL])


@pytest.mark.parametrize(
    "layer_types, settings, pattern",
    [
        ([LIN, LIN], {"kind": "mamba"}, r"kind='mamba'.*gla.*performer.*deltanet"),
        ([LIN, LIN], {"feature_map": "rbf"}, r"feature_map='rbf'.*hedgehog, elu, identity, taylor or performer"),
        ([LIN, LIN], {"gate": "sigmoid"}, r"gate='sigmoid'.*lowrank, key, retnet or none"),
        (
            [LIN, LIN],
            {"kind": "deltanet", "feature_map": "identity"},
            r"deltanet with normalize=true keeps GLA's normalizer, which needs positive features: use feature_map hedgehog",
        ),
        ([LIN, LIN], {"kind": "deltanet", "feature_map": "performer", "normalize": False}, r"does not take performer features"),
        ([LIN, LIN], {"conv_size": 4}, r"conv_size is a deltanet setting"),
        ([LIN, LIN], {**DELTA, "conv_size": 1}, r"conv_size=1: use 0 \(no convolution\) or a kernel size of at least 2"),
        ([LIN, LIN], {"kind": "performer", "feature_map": "elu"}, r"feature_map='performer'"),
        ([LIN, LIN], {"kind": "performer", "feature_map": "performer", "normalize": False}, r"normalize=true"),
        ([LIN, LIN], {"window": 4, "normalize": False}, r"window needs normalize=true"),
        ([LIN, LIN], {"sink": 2}, r"sinks live in the softmax window"),
        ([LIN, LIN], {"decay_init": [0.9, 1.0]}, r"decay_init=\[0.9, 1.0\].*two decays in \(0, 1\)"),
    ],
)
def test_bad_linear_attention_settings_raise(layer_types, settings, pattern):
    with pytest.raises(ValueError, match=pattern):
        tiny_config(layer_types, settings)


# The following three pin down gaps in the settings validation (see the report of issue 2).


def test_unknown_linear_attention_key_is_rejected():
    """A typo in a setting must not be silently ignored (it would train with the default instead)."""
    with pytest.raises(ValueError, match="gate_rnk"):
        tiny_config([LIN, LIN], {"gate_rnk": 4})


@pytest.mark.parametrize("window", [-3, 2.5])
def test_bad_window_value_is_rejected(window):
    with pytest.raises(ValueError, match="window"):
        tiny_config([LIN, LIN], {"window": window})


def test_gla_gate_with_performer_features_is_used_or_rejected():
    """kind=gla + feature_map=performer + a gate: the gate must either act or be refused, not be dead weight."""
    try:
        config = tiny_config([LIN, LIN], {"kind": "gla", "feature_map": "performer", "gate": "lowrank"})
    except ValueError:
        return
    model = LinearizeForCausalLM(config)
    model(random_ids(1, 20)).logits.sum().backward()
    dead = [n for n, p in model.named_parameters() if ".gate." in n and p.grad is None]
    assert not dead, f"parameters that never affect the output: {dead}"


@pytest.mark.parametrize("decay_init", [(0.995, 0.9998), (0.98, 0.999)])
def test_gate_starts_at_its_decay_range_in_a_converted_student(decay_init):
    """The base init runs on the gate's Linear children first; it must not pin the decays at sigmoid(0)**(1/16)."""
    teacher = make_teacher("llama-bias-tied")
    layer_types = [LIN] + [FULL] * (teacher.config.num_hidden_layers - 1)
    student = linearize_model(teacher, layer_types, {"decay_init": list(decay_init)})
    gate = student.model.layers[0].self_attn.gate
    decay = torch.exp(F.logsigmoid(gate.up.bias.double()) / gate.normalizer).view(gate.heads, gate.channels)
    expected = torch.linspace(*decay_init, gate.channels, dtype=torch.float64)
    torch.testing.assert_close(decay, expected.expand_as(decay), rtol=0, atol=1e-6)
    assert gate.up.weight.abs().max() == 0  # data-independent at first: every token decays alike


def test_the_normalization_the_kernel_tests_check_is_the_one_the_model_ships(tiny_linearize, monkeypatch):
    """The layer hands its normalizer to ops (normalize=True): divided there without a window; with one, undivided
    terms come back (divide=False) to mix with the window's, and ops' own normalize_output divides."""
    from linearize.kernels import ops
    from linearize.modeling import modeling_linearize

    calls = []
    real = ops.gated_linear_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("normalize", False), kwargs.get("divide", True)))
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling_linearize, "gated_linear_attention", spy)
    ids = torch.randint(3, 100, (1, 12))
    for window, expected in ((0, (True, True)), (4, (True, False))):
        calls.clear()
        model = tiny_linearize(["linear_attention", "full_attention"], {"window": window})
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all()
        assert calls == [expected]
    assert modeling_linearize.normalize_output is ops.normalize_output and modeling_linearize.with_normalizer is ops.with_normalizer


def test_taylor_kernel_is_the_second_order_exp_over_its_feature_count() -> None:
    """phi(q).phi(k) = (1 + u + u^2 / 2) / F with u = q'.k' / sqrt(d): per token, about what Hedgehog adds
    to a normalizer that the state shares with the window's softmax."""
    torch.manual_seed(0)
    d, D = 4, 8
    fmap = TaylorFeatureMap(heads=2, head_dim=D, dim=d)
    with torch.no_grad():
        fmap.weight.normal_()
    q, k = torch.randn(1, 2, 5, D, dtype=torch.float64), torch.randn(1, 2, 5, D, dtype=torch.float64)
    fmap = fmap.double()
    kernel = fmap(q) @ fmap(k).transpose(-1, -2)
    radius = 2.0**0.5 * d**0.25
    qp, kp = (F.normalize(torch.einsum("bhtd,hde->bhte", x, fmap.weight), dim=-1) * radius for x in (q, k))
    u = qp @ kp.transpose(-1, -2) / d**0.5
    torch.testing.assert_close(kernel, (1 + u + u**2 / 2) / (1 + d + d * d))
