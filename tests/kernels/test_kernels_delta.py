"""The gated delta rule in PyTorch: the chunked (UT transform) form against the step-by-step reference.

fp32, forward and backward, with GQA, a decay per head or per key channel, a starting state and
padded (b = 0, g = 0) steps; the reference itself is checked against the update written out,
S_t = S_{t-1} diag(a_t) (I - b_t k_t k_t^T) + b_t v_t k_t^T (the state as [V, K]).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linearize.kernels.delta_torch import delta_chunked, delta_recurrent
from linearize.kernels.gla_torch import MIN_LOG_DECAY
from linearize.kernels.ops import gated_delta_rule

TOL = {"rtol": 1e-5, "atol": 1e-5}


def make_inputs(
    B: int, HQ: int, H: int, T: int, K: int, V: int, *, decay: str | None = "head", state: bool = True, seed: int = 0
):
    """decay: "head" (g [B, H, T, 1]), "channel" (g [B, H, T, K], the gate's floor MIN_LOG_DECAY reached) or None."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.requires_grad_()

    padded = torch.rand(B, 1, T, generator=gen) < 0.2  # steps that write nothing and do not decay
    beta = torch.rand(B, H, T, generator=gen).masked_fill(padded, 0.0)
    g = None
    if decay is not None:
        channels = K if decay == "channel" else 1
        g = F.logsigmoid(torch.randn(B, H, T, channels, generator=gen) * 3 + 2).clamp_min(MIN_LOG_DECAY)
        g = g.masked_fill(padded[..., None], 0.0)
    return {
        "q": leaf(F.normalize(torch.randn(B, HQ, T, K, generator=gen), dim=-1)),
        "k": leaf(F.normalize(torch.randn(B, H, T, K, generator=gen), dim=-1)),
        "v": leaf(torch.randn(B, H, T, V, generator=gen)),
        "beta": leaf(beta),
        "g": None if g is None else leaf(g),
        "initial_state": leaf(torch.randn(B, H, K, V, generator=gen) * 0.5) if state else None,
    }


def outputs_and_grads(fn, inputs: dict, **kwargs):
    o, state = fn(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], inputs["g"], initial_state=inputs["initial_state"], **kwargs)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    leaves = [x for x in inputs.values() if x is not None]
    return [o, state, *torch.autograd.grad(loss, leaves)]


SHAPES = [(1, 2, 2, 1, 16, 16), (2, 4, 2, 37, 16, 8), (2, 6, 2, 100, 32, 16), (1, 2, 1, 131, 16, 24)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-HQ{}-H{}-T{}-K{}-V{}".format(*s))
@pytest.mark.parametrize("decay", ["head", "channel", None], ids=["per-head", "per-channel", "ungated"])
@pytest.mark.parametrize("state", [True, False], ids=["h0", "no-h0"])
def test_chunked_equals_recurrent(shape, decay, state):
    inputs = make_inputs(*shape, decay=decay, state=state)
    want = outputs_and_grads(delta_recurrent, inputs, scale=0.8)
    for chunk_size in (16, 32, 64):  # per channel, 16-step sub-chunks meet through their first row
        got = outputs_and_grads(delta_chunked, inputs, scale=0.8, chunk_size=chunk_size)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("decay", ["head", "channel"])
@torch.no_grad()
def test_reference_is_the_written_out_update(decay):
    inputs = make_inputs(1, 2, 1, 9, 4, 3, decay=decay)
    q, k, v, beta, g, h0 = (inputs[n] for n in ("q", "k", "v", "beta", "g", "initial_state"))
    o, final = delta_recurrent(q, k, v, beta, g, initial_state=h0)
    S = h0[0, 0].T.clone()  # [V, K]
    for t in range(9):
        kt, vt, bt, at = k[0, 0, t], v[0, 0, t], beta[0, 0, t], g[0, 0, t].exp().expand(4)
        S = S @ torch.diag(at) @ (torch.eye(4) - bt * torch.outer(kt, kt)) + bt * torch.outer(vt, kt)
        for head in range(2):  # both query heads read the one KV head's state
            torch.testing.assert_close(o[0, head, t], S @ q[0, head, t], **TOL)
    torch.testing.assert_close(final[0, 0], S.T, **TOL)


@pytest.mark.parametrize("decay", ["head", "channel"])
def test_prefill_then_steps_continue_the_sequence(decay):
    inputs = make_inputs(2, 4, 2, 40, 16, 16, decay=decay, state=False)
    names = ("q", "k", "v", "beta", "g")
    full, _ = gated_delta_rule(*(inputs[n] for n in names), mode="chunk", chunk_size=16)
    first, state = gated_delta_rule(*(inputs[n][:, :, :33] for n in names), mode="chunk", chunk_size=16)
    rest, _ = gated_delta_rule(*(inputs[n][:, :, 33:] for n in names), initial_state=state, mode="recurrent")
    torch.testing.assert_close(torch.cat([first, rest], dim=2), full, **TOL)


def test_long_sequence_stays_bounded():
    """With unit keys and b in (0, 1) the state never grows past the values it stores: no blow-up at 4K."""
    inputs = make_inputs(1, 2, 2, 4096, 16, 16, decay=None, state=False)
    with torch.no_grad():
        o, state = gated_delta_rule(*(inputs[n] for n in ("q", "k", "v", "beta", "g")), mode="chunk")
    assert torch.isfinite(o).all() and state.abs().max() < 50
