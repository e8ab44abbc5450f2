"""Performer (FAVOR+) attention (issue 2): exact FAVOR+ math, convergence to softmax, and the real teacher.

- On tiny inputs the layer equals a dense, stabilizer-free FAVOR+ computation (with and without the
  softmax window), in fp64 and in every form: the stabilizers and the window mixing are exact.
- On moderate kernels (|q'|^2 = |k'|^2 ~ 1.44) the error to softmax shrinks with the feature count M.
- On the embedded SmolLM2 (slow) we measure the relative error of one softmax layer's output when
  it is replaced by Performer features, no training, for M in 64..4096. Run with `pytest -s` to see
  the table.
"""

from __future__ import annotations

import copy

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, repeat_kv

from linearize.convert.data import heldout_text
from linearize.convert.swap import student_config
from linearize.modeling.configuration_linearize import LinearizeConfig
from linearize.modeling.families import FAMILIES
from linearize.modeling.modeling_linearize import LinearAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIN = "linear_attention"


def performer_config(M: int, window: int = 0, seed: int = 0, D: int = 16, chunk_size: int = 16) -> LinearizeConfig:
    return LinearizeConfig(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=D,
        layer_types=[LIN],
        linear_attention={
            "kind": "performer",
            "feature_map": "performer",
            "feature_dim": M,
            "window": window,
            "seed": seed,
            "chunk_size": chunk_size,
        },
    )


def performer_layer(config: LinearizeConfig, index: int = 0, attention: torch.nn.Module | None = None) -> LinearAttention:
    """A Llama attention module (random, or a copy of the teacher's) converted to this config's linear layer."""
    attention = LlamaAttention(config.base_config(), index) if attention is None else copy.deepcopy(attention)
    return LinearAttention.convert(attention, config, index, FAMILIES["llama"])


def project(layer: LinearAttention, hidden: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, ...]:
    """RoPE'd q, k and v, as the layer's window and the teacher's softmax see them."""
    q, k, v = layer.project(hidden)
    return (*layer.apply_rotary(q, k, *position_embeddings), v)


def causal_softmax(q, k, v, scaling: float) -> torch.Tensor:
    """Exact causal softmax attention with GQA: q [B, H, T, D], k/v [B, Hkv, T, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    T = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scaling
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def dense_favor(q, k, v, projection, window: int) -> torch.Tensor:
    """Textbook FAVOR+ (no stabilizers), causal, normalized; the last `window` keys exactly by exp(q.k/sqrt(D))."""
    B, H, T, D = q.shape
    groups = H // k.shape[1]
    k, v, projection = repeat_kv(k, groups), repeat_kv(v, groups), projection.repeat_interleave(groups, dim=0)
    M = projection.shape[1]

    def phi(x):
        x = x * D**-0.25
        logits = torch.einsum("bhtd,hmd->bhtm", x, projection) - 0.5 * x.pow(2).sum(-1, keepdim=True)
        return torch.exp(logits) / math.sqrt(M)

    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    in_window = (j <= i) & (j > i - window)
    in_state = j <= i - window
    weights = torch.where(in_state, phi(q) @ phi(k).transpose(-1, -2), torch.zeros(()))
    weights = weights + torch.where(in_window, torch.exp((q @ k.transpose(-1, -2)) * D**-0.5), torch.zeros(()))
    return (weights @ v) / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("form", ["parallel", "chunk", "recurrent"])
@pytest.mark.parametrize("window", [0, 4])
def test_performer_layer_is_exact_favor_plus(window, form):
    config = performer_config(M=40, window=window, D=16)
    torch.manual_seed(0)
    layer = performer_layer(config).double().eval()
    layer.form = form
    rotary = LlamaRotaryEmbedding(config.base_config())
    hidden = torch.randn(2, 37, config.hidden_size, dtype=torch.float64)
    position_embeddings = rotary(hidden, torch.arange(37)[None])
    position_embeddings = tuple(x.double() for x in position_embeddings)
    with torch.no_grad():
        got, _ = layer(hidden, position_embeddings)
        q, k, v = project(layer, hidden, position_embeddings)
        expected = dense_favor(q, k, v, layer.performer_projection.double(), window)
        expected = layer.o_proj(expected.transpose(1, 2).reshape(2, 37, -1))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_performer_random_features_are_a_saved_buffer():
    config = performer_config(M=32)
    layer = performer_layer(config)
    assert "performer_projection" in layer.state_dict()
    other = performer_layer(performer_config(M=32, seed=1))
    assert not torch.equal(layer.performer_projection, other.performer_projection)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(layer.performer_projection, other.performer_projection)
    # same seed, same features: a rebuilt model draws the same matrix
    assert torch.equal(performer_layer(config).performer_projection, layer.performer_projection)


def test_performer_converges_to_softmax_on_moderate_kernels():
    """|q'|^2 = |k'|^2 ~ 1.44: FAVOR+ variance is moderate and the error to exact softmax falls roughly as 1/sqrt(M)."""
    D, T = 16, 128
    gen = torch.Generator().manual_seed(0)
    size = 1.2 * D**0.25 / D**0.5  # q' = q D^(-1/4) has |q'|^2 ~ 1.44 on average
    q = torch.randn(1, 4, T, D, generator=gen, dtype=torch.float64) * size
    k = torch.randn(1, 2, T, D, generator=gen, dtype=torch.float64) * size
    v = torch.randn(1, 2, T, D, generator=gen, dtype=torch.float64)
    exact = causal_softmax(q, k, v, D**-0.5)
    uniform = causal_softmax(q * 0, k, v, D**-0.5)
    baseline = ((uniform - exact).norm() / exact.norm()).item()
    errors = {}
    for M in (64, 256, 1024, 4096):
        runs = []
        for seed in range(3):
            layer = performer_layer(performer_config(M=M, seed=seed, D=D)).double()
            with torch.no_grad():
                out = layer._attend(None, q, k, v, q, k, None, None)
            runs.append(((out - exact).norm() / exact.norm()).item())
        errors[M] = sum(runs) / len(runs)
    print(f"\nsynthetic |q'|^2=|k'|^2~1.44, D={D}, T={T}: uniform-attention baseline {baseline:.4f}")
    print("  " + "  ".join(f"M={M}: {e:.4f}" for M, e in errors.items()))
    values = list(errors.values())
    assert all(a > b for a, b in zip(values, values[1:])), errors
    assert errors[4096] < errors[64] / 3
    assert errors[4096] < 0.12
    assert errors[4096] < 0.35 * baseline


# ----------------------------------------------------------------------------------------------
# the real teacher: one softmax layer of SmolLM2-135M replaced by Performer features, no training

LAYER = 5
TOKENS = 512
FEATURES = (64, 256, 1024, 4096)
CONFIGS = ((0, 0), (64, 0), (64, 4))  # (window, attention sinks)
SEEDS = (0, 1)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def performer_table(embedded_teacher):
    """{(window, sink, M): mean relative error over SEEDS} for layer LAYER, plus reference baselines."""
    teacher, tokenizer, _ = embedded_teacher
    ids = tokenizer(heldout_text(), return_tensors="pt")["input_ids"][:, :TOKENS]
    assert ids.shape[1] == TOKENS
    attn = teacher.model.layers[LAYER].self_attn
    captured = {}

    def capture(module, args, kwargs):
        captured.update(kwargs)
        raise _Captured

    handle = attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            teacher(ids, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    hidden, position_embeddings = captured["hidden_states"], captured["position_embeddings"]
    with torch.no_grad():
        reference = attn(**captured)[0]  # the teacher's softmax layer output (after o_proj)

    table: dict = {}
    n = teacher.config.num_hidden_layers
    for window, sink in CONFIGS:
        for M in FEATURES:
            errors = []
            for seed in SEEDS:
                layer_types = ["full_attention"] * n
                layer_types[LAYER] = LIN
                settings = {"kind": "performer", "feature_map": "performer", "feature_dim": M}
                settings.update(window=window, sink=sink, seed=seed)
                config = student_config(teacher.config, layer_types, settings)
                layer = performer_layer(config, LAYER, attn).eval()
                with torch.no_grad():
                    errors.append(relative_error(layer(hidden, position_embeddings)[0], reference))
            table[window, sink, M] = sum(errors) / len(errors)

    # context: what trivial replacements of the same layer score
    with torch.no_grad():
        q, k, v = project(layer, hidden, position_embeddings)
        T = q.shape[2]
        groups = layer.num_key_value_groups

        def output(o):
            return layer.o_proj(o.transpose(1, 2).reshape(1, T, -1))

        table["softmax via student projections"] = relative_error(
            output(causal_softmax(q, k, v, layer.scaling)), reference
        )
        table["uniform causal average"] = relative_error(output(causal_softmax(q * 0, k, v, 1.0)), reference)
        scores = (q @ repeat_kv(k, groups).transpose(-1, -2)) * layer.scaling
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        local = (j <= i) & (j > i - 64)
        weights = scores.masked_fill(~local, float("-inf")).softmax(-1)
        local_softmax = output(weights @ repeat_kv(v, groups))
        table["softmax over the last 64 tokens only"] = relative_error(local_softmax, reference)
        sink = (j <= i) & ((j > i - 64) | (j == 0))  # plus the first token, the usual attention sink
        weights = scores.masked_fill(~sink, float("-inf")).softmax(-1)
        table["softmax over token 0 + the last 64 tokens"] = relative_error(
            output(weights @ repeat_kv(v, groups)), reference
        )
        table["|q'|^2 mean"] = (q.pow(2).sum(-1) / math.sqrt(q.shape[-1])).mean().item()
        table["|k'|^2 mean"] = (k.pow(2).sum(-1) / math.sqrt(k.shape[-1])).mean().item()

    lines = [f"\nPerformer vs softmax, SmolLM2-135M layer {LAYER}, {TOKENS} held-out tokens, mean of seeds {SEEDS}"]
    lines.append("  window sink " + "".join(f"  M={M:<6}" for M in FEATURES))
    for window, sink in CONFIGS:
        lines.append(f"  {window:>6} {sink:>4} " + "".join(f"  {table[window, sink, M]:<8.4f}" for M in FEATURES))
    for key, value in table.items():
        if isinstance(key, str):
            lines.append(f"  {key}: {value:.4f}")
    print("\n".join(lines))
    return table


class _Captured(Exception):
    """Stops the teacher's forward once the layer's input is captured."""


@pytest.mark.slow
def test_performer_error_on_the_real_teacher(performer_table):
    table = performer_table
    assert table["softmax via student projections"] < 1e-5  # the comparison itself is exact
    for window, sink in CONFIGS:
        errors = [table[window, sink, M] for M in FEATURES]
        assert all(math.isfinite(e) for e in errors)
        assert errors[-1] < errors[0], f"window {window}, sink {sink}: error does not fall with M: {errors}"
        assert errors[-1] < 1.5, f"window {window}, sink {sink}: error at M={FEATURES[-1]} is {errors[-1]:.3f}"
    # the shipped recipe's setting: window plus attention sinks gets well below the window alone
    assert table[64, 4, FEATURES[-1]] < 0.8 * table[64, 0, FEATURES[-1]]


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=(
        "FAVOR+ cannot approximate SmolLM2's trained attention without training: the estimator's relative "
        "variance grows like exp(|q'|^2 + |k'|^2) with |q'|^2 ~ 21 and |k'|^2 ~ 35 at layer 5, so M <= 4096 is far "
        "too few features (DESIGN.md section 3 claims it approximates the teacher's softmax)"
    ),
)
def test_performer_approximates_the_teacher_without_training(performer_table):
    assert performer_table[0, 0, FEATURES[-1]] < 0.5
