"""The linear layer and the hybrid model: the three forms compute the same thing, the layer matches dense
math, teachers in memory swap exactly, and bad settings are refused.

Everything here runs on tiny random configs (hidden 32, 4 heads / 2 KV heads, vocab 128) in fp32 on one
CPU thread. Cached generation: test_generation.py; the cache: test_cache.py; the decoding runtime and
CPU layouts: test_decoding.py; their shared helpers: hybrid.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_linearize, tiny_fields
from hybrid import (
    DELTA,
    DELTA_NORMALIZED,
    FULL,
    LIN,
    PLANS,
    VOCAB,
    assert_forms_equal,
    left_padded,
    make_model,
    random_ids,
    randomize_new_parameters,
    set_form,
)
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import repeat_kv

import linearize.modeling.modeling_linearize as modeling_linearize
from linearize.convert.swap import check_supported, linearize_model
from linearize.modeling.configuration_linearize import LinearizeConfig
from linearize.modeling.modeling_linearize import LinearAttention, LinearizeForCausalLM, TaylorFeatureMap, transfer_mse

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
