"""The window-and-sinks softmax (kernels/window_torch.py) against a dense softmax under a hand-built mask."""

import math

import pytest
import torch

from linearize.kernels import window_torch
from linearize.kernels.window_torch import update_sinks, window_softmax_terms, window_step_terms


def dense_reference(q, k, v, allowed, scaling):
    """Softmax attention over every key under `allowed` [B, H, T, L], computed head by head with no blocks."""
    B, H, T, D = q.shape
    groups = H // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("bhtd,bhld->bhtl", q, k) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def band_and_sinks_mask(valid, T, window, sink):
    """[B, 1, T, L]: query at position p sees real keys j with p - window < j <= p, and the first `sink` real
    tokens of its row once they are at or before p - window (then they have left the window)."""
    B, L = valid.shape
    allowed = torch.zeros(B, 1, T, L, dtype=torch.bool)
    for b in range(B):
        real = [j for j in range(L) if valid[b, j]]
        sinks = set(real[:sink])
        for t in range(T):
            p = L - T + t
            for j in real:
                allowed[b, 0, t, j] = (p - window < j <= p) or (j in sinks and j <= p - window)
    return allowed


def split(terms, c):
    """Normalized output and log of the softmax's denominator from the (terms, max) layout."""
    return terms[..., :-1] / terms[..., -1:], terms[..., -1:].log().squeeze(-1) + c.squeeze(-1)


@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("T", [5, 40])  # 5: every key scored at once; 40: blocks of queries
def test_window_softmax_terms_match_a_dense_masked_softmax(T, sink, monkeypatch):
    monkeypatch.setattr(window_torch, "WINDOW_GROUP_TOKENS", 8)  # several groups of query blocks
    torch.manual_seed(0)
    B, H, Hkv, L, D, window = 2, 4, 2, 45, 8, 12
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, :4] = False  # row 1 is left-padded: its sinks are its first real tokens
    positions = torch.arange(L - T, L)
    sinks = None
    if sink:
        sinks = update_sinks(None, k, v, torch.arange(L), valid, sink)
        assert sinks[2][1].tolist() == [4.0, 5.0, 6.0]
    terms, c = window_softmax_terms(q, k, v, valid, window, 1 / math.sqrt(D), sinks, positions)
    out, lse = split(terms, c)
    allowed = band_and_sinks_mask(valid, T, window, sink)
    want, want_lse = dense_reference(q, k, v, allowed, 1 / math.sqrt(D))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    if sink:  # the check can fail: without the sinks the answer differs
        without, _ = split(*window_softmax_terms(q, k, v, valid, window, 1 / math.sqrt(D)))
        assert not torch.allclose(without, want, atol=1e-3)


def test_window_step_terms_match_a_dense_softmax_over_a_shuffled_ring():
    torch.manual_seed(1)
    B, H, Hkv, W, S, D = 2, 6, 3, 10, 4, 8
    q = torch.randn(B, H, 1, D)
    k, v = torch.randn(B, Hkv, W, D), torch.randn(B, Hkv, W, D)
    sink_k, sink_v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    key_valid = torch.rand(B, W) > 0.3
    sink_visible = torch.tensor([[True, False, True, True], [False, False, True, False]])
    order = torch.randperm(W)  # a ring holds its keys in any order
    terms, c = window_step_terms(q, k[:, :, order], v[:, :, order], key_valid[:, order], 0.5, (sink_k, sink_v), sink_visible)
    out, lse = split(terms, c)
    allowed = torch.cat([key_valid, sink_visible], -1)[:, None, None, :].expand(B, H, 1, W + S)
    want, want_lse = dense_reference(q, torch.cat([k, sink_k], 2), torch.cat([v, sink_v], 2), allowed, 0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_update_sinks_keeps_the_first_real_tokens_across_calls():
    """Sinks fill over two calls (a prefill, then a step) and stay once full; padding never takes a slot."""
    B, Hkv, D = 2, 1, 2
    k = torch.arange(B * 3 * D, dtype=torch.float).view(B, Hkv, 3, D)
    valid = torch.tensor([[True, True, True], [False, False, True]])
    sinks = update_sinks(None, k, k, torch.arange(3), valid, count=2)
    assert sinks[2].tolist() == [[0.0, 1.0], [2.0, -1.0]]
    step = torch.full((B, Hkv, 1, D), 99.0)
    sinks = update_sinks(sinks, step, step, torch.tensor([3]), torch.ones(B, 1, dtype=torch.bool), count=2)
    assert sinks[2].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    torch.testing.assert_close(sinks[0][0, 0], k[0, 0, :2])
    assert sinks[0][1, 0].tolist() == [k[1, 0, 2].tolist(), [99.0, 99.0]]
