"""Softmax over a sliding window and attention sinks in plain PyTorch: the softmax half of a linear layer.

A linear layer with a window mixes two attentions per head: this exact softmax over the last `window`
keys of each query (plus up to `sink` first tokens once they have left the window), and the linear
state, which holds every key that has left the window. The functions here compute the softmax half's
*unnormalized* terms, laid out like a normalized GLA output so the two halves join with one max:

    terms [B, H, T, D + 1] = [sum_j exp(s_j - c) v_j, sum_j exp(s_j - c)]      c [B, H, T, 1] = max_j s_j

Shapes (head-first): q [B, H, T, D]; k, v [B, Hkv, L, D] with the queries the last T of the L keys;
H is a multiple of Hkv (GQA), a group's queries read their KV head without copies. Sinks are kept as
(keys [B, Hkv, S, D], values [B, Hkv, S, D], positions [B, S], -1 for an empty slot).

`window_softmax_terms` is the training and prefill form, O(T * window) in blocks of queries;
`window_step_terms` is one decoding query against a ring of exactly `window` keys. Both match a dense
softmax under the band-plus-sinks mask (tests/kernels/test_window_torch.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .gla_torch import step_bmm
from .ops import with_normalizer

UNBLOCKED_QUERIES = 16  # up to this many queries score all their keys at once, with no blocks


def shift_into_state(x: torch.Tensor, new: int, window: int, dim: int = 2) -> torch.Tensor:
    """What enters the linear state at each of the `new` last steps of x: step t admits token t - window.

    x holds the (at most `window`) tokens before the new ones, oldest first, then the new ones, along
    `dim`; steps that admit nothing get zeros. With a full window of past tokens this is a slice.
    """
    missing = window - (x.shape[dim] - new)
    if missing > 0:
        x = torch.cat([x.new_zeros(*x.shape[:dim], missing, *x.shape[dim + 1 :]), x], dim=dim)
    return x.narrow(dim, 0, new)


@functools.lru_cache(maxsize=32)
def window_band(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """[queries, keys] bool: the last `queries` of `keys` positions see the `window` keys up to themselves."""
    query_pos = torch.arange(keys - queries, keys, device=device)[:, None]
    key_pos = torch.arange(keys, device=device)[None, :]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def sink_visibility(sink_positions: torch.Tensor, q_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, 1, 1, T, S]: a query sees a filled sink slot once that token has left its window."""
    sinks = sink_positions[:, None, None, None, :]
    return (sinks >= 0) & (sinks <= (q_positions - window).to(sinks.dtype)[:, None])


def sink_leaving(sink_positions: torch.Tensor, q_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T]: whether the token leaving the window at each query is a sink (it stays out of the state)."""
    leaving = (q_positions - window).to(sink_positions.dtype)
    return (leaving[None, :, None] == sink_positions[:, None, :]).any(-1)


WINDOW_BLOCK = 64  # queries per block of the window's softmax: each attends window + block keys


def window_block(window: int) -> int:
    """Queries per block: the largest divisor of the window up to WINDOW_BLOCK, or the whole window
    when that is small (then each query attends 2 * window keys, half of them masked)."""
    block = max(d for d in range(1, min(window, WINDOW_BLOCK) + 1) if window % d == 0)
    return block if block >= 16 or block == window else window


WINDOW_GROUP_TOKENS = 512  # queries whose window scores exist at once


def _window_group_terms(
    q_blocks: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, valid: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window softmax terms and row max of consecutive query blocks [B, Hkv, G, n, b, D] (scaled); the
    key blocks, values (with the normalizer column) and validity run from m = window / b blocks before
    the first to the last."""
    n, b = q_blocks.shape[3], q_blocks.shape[4]
    m = k_blocks.shape[3] - n
    # Query block i sees key blocks i .. i + m here: scores for the m + 1 of them side by side, one matmul each.
    scores = torch.cat([q_blocks @ k_blocks[:, :, :, j : j + n].transpose(-1, -2) for j in range(m + 1)], dim=-1)
    row = torch.arange(b, device=q_blocks.device)[:, None]
    col = torch.arange(window + b, device=q_blocks.device)[None, :]
    keys_valid = torch.cat([valid[:, :, :, j : j + n] for j in range(m + 1)], dim=-1)
    scores.masked_fill_(~(((col > row) & (col <= row + window)) & keys_valid), float("-inf"))
    c = scores.amax(-1, keepdim=True).clamp_min(-1e4)
    # In place when nothing will backpropagate through the scores (prefill, scoring, stage 1): one tensor fewer.
    weights = (scores - c).exp() if scores.requires_grad else scores.sub_(c).exp_()
    terms = sum(weights[..., j * b : (j + 1) * b] @ v_blocks[:, :, :, j : j + n] for j in range(m + 1))
    return terms, c


def window_softmax_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    window: int,
    scaling: float,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    q_positions: torch.Tensor | None = None,
    sinks_visible: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalized softmax over the last `window` keys of each query and the sinks before it: O(T * window).

    q [B, H, T, D] are the last T of the L keys k, v [B, Hkv, L, D]; key_valid [B, L]; `sinks` as
    `update_sinks` keeps them, seen by queries at absolute `q_positions` [T] (`sinks_visible`: the
    caller knows every slot is filled and out of every query's window, so no mask). Returns the terms
    [B, H, T, D + 1] (sum exp(s - c) v, then sum exp(s - c): the layout of a normalized GLA output)
    and the row max c [B, H, T, 1].
    """
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    groups = H // Hkv
    if T <= UNBLOCKED_QUERIES:  # a short step (a single decoding token takes `window_step_terms`): no blocks
        allowed = window_band(T, L, window, q.device) & key_valid[:, None, None, None, :]
        masked = 0  # keys before this many are all visible
        if sinks is not None:
            k, v = torch.cat([sinks[0], k], dim=2), torch.cat([sinks[1], v], dim=2)
            if sinks_visible:
                masked = sinks[0].shape[2]
            else:
                allowed = torch.cat([sink_visibility(sinks[2], q_positions, window), allowed], dim=-1)
        # A group's queries are the rows of one matmul against their KV head: no key copies.
        scores = (q.reshape(B, Hkv, groups * T, D) @ k.transpose(-1, -2)).view(B, Hkv, groups, T, -1) * scaling
        scores[..., masked:].masked_fill_(~allowed, float("-inf"))
        c = scores.amax(-1, keepdim=True).clamp_min(-1e4)
        terms = (scores - c).exp().view(B, Hkv, groups * T, -1) @ with_normalizer(v)
        return terms.view(B, H, T, D + 1), c.view(B, H, T, 1)
    b = window_block(window)
    m = window // b  # key blocks before a query block that its queries can reach
    front = (-L) % b + window  # empty blocks in front, so every query block has m predecessors
    n = (L + front) // b - m  # query blocks: the last n of the padded sequence's n + m blocks
    q_blocks = F.pad(q * scaling, (0, 0, front + L - T, 0)).view(B, Hkv, groups, n + m, b, D)[:, :, :, m:]
    k_blocks = F.pad(k, (0, 0, front, 0)).view(B, Hkv, 1, n + m, b, D)
    v_blocks = F.pad(with_normalizer(v), (0, 0, front, 0)).view(B, Hkv, 1, n + m, b, D + 1)
    valid = F.pad(key_valid, (front, 0), value=False).view(B, 1, 1, n + m, 1, b)
    # Scores exist for WINDOW_GROUP_TOKENS queries at a time and are recomputed in backward.
    per = max(1, WINDOW_GROUP_TOKENS // b)
    parts = []
    for first in range(0, n, per):
        last = min(n, first + per)
        group = (q_blocks[:, :, :, first:last], *(x[:, :, :, first : last + m] for x in (k_blocks, v_blocks, valid)))
        if torch.is_grad_enabled() and any(x.requires_grad for x in group):
            parts.append(checkpoint(_window_group_terms, *group, window, use_reentrant=False))
        else:
            parts.append(_window_group_terms(*group, window))
    terms, c = (torch.cat([part[i] for part in parts], dim=3) for i in (0, 1))

    def unblock(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B, H, n * b, -1)[:, :, -T:]

    terms, c = unblock(terms), unblock(c)
    if sinks is None:
        return terms, c
    # The sinks before each query's window join with one shared max.
    sink_k, sink_v, sink_pos = sinks
    scores = (q.view(B, Hkv, groups, T, D) @ sink_k.unsqueeze(2).transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~sink_visibility(sink_pos, q_positions, window), float("-inf")).view(B, H, T, -1)
    c_new = torch.maximum(c, scores.amax(-1, keepdim=True))
    sink_terms = ((scores - c_new).exp().view(B, Hkv, groups, T, -1) @ with_normalizer(sink_v).unsqueeze(2)).view(B, H, T, D + 1)
    return terms * (c - c_new).exp() + sink_terms, c_new


def window_step_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    scaling: float,
    sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    sink_visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`window_softmax_terms` for one decoding query whose window is exactly the W keys given, in any order.

    q [B, H, 1, D]; k, v [B, Hkv, W, D] and the sinks' keys and values [B, Hkv, S, D] may be strided
    views of the cache: nothing is copied (the normalizer is the weights' sum, not a column of ones on
    v). key_valid [B, W], or None when every key is real; sink_visible [B, S], or None when every sink
    is visible. Each op here runs once per layer and token, so the scores are 3D batched matmuls over
    (row, KV head), a group's queries the rows of one matmul, and ring and sinks share one max.
    """
    B, H, _, D = q.shape
    Hkv, W = k.shape[1], k.shape[2]
    q = (q * scaling).view(B * Hkv, H // Hkv, D)
    scores = step_bmm(q, k.reshape(B * Hkv, W, D).transpose(1, 2))
    if key_valid is not None:
        scores.view(B, -1, W).masked_fill_(~key_valid[:, None], float("-inf"))
    if sinks is not None:
        S = sinks[0].shape[2]
        sink_scores = step_bmm(q, sinks[0].reshape(B * Hkv, S, D).transpose(1, 2))
        if sink_visible is not None:
            sink_scores.view(B, -1, S).masked_fill_(~sink_visible[:, None], float("-inf"))
        scores = torch.cat([scores, sink_scores], dim=-1)
    c = scores.amax(-1, keepdim=True).clamp_min_(-1e4)
    weights = scores.sub_(c).exp_()
    num = step_bmm(weights[..., :W], v.reshape(B * Hkv, W, D))
    if sinks is not None:
        num = step_bmm(weights[..., W:], sinks[1].reshape(B * Hkv, S, D), add=num)
    return torch.cat([num, weights.sum(-1, keepdim=True)], dim=-1).view(B, H, 1, D + 1), c.view(B, H, 1, 1)


def update_sinks(
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    count: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the first `count` real tokens of each row (attention sinks): their keys, values and positions.

    `sinks` is (keys [B, Hkv, S, D], values, positions [B, S] with -1 for an empty slot) or None;
    k, v [B, Hkv, T, D] are new tokens at absolute `positions` [T], `valid` [B, T] marks real ones.
    Rows whose sinks are full keep them (a new token's slot is past the end and discarded).
    """
    B, Hkv, T, D = k.shape
    if sinks is None:
        sinks = (k.new_zeros(B, Hkv, count, D), v.new_zeros(B, Hkv, count, D), k.new_full((B, count), -1.0))
    sink_k, sink_v, sink_pos = sinks
    filled = (sink_pos >= 0).sum(-1, keepdim=True)
    slot = filled + valid.long().cumsum(-1) - 1  # the sink slot each new real token would take
    slot = torch.where(valid & (slot < count), slot, torch.full_like(slot, count))  # slot `count` discards
    index = slot[:, None, :, None].expand(B, Hkv, T, D)
    sink_k = torch.cat([sink_k, k.new_zeros(B, Hkv, 1, D)], 2).scatter(2, index, k)[:, :, :count]
    sink_v = torch.cat([sink_v, v.new_zeros(B, Hkv, 1, D)], 2).scatter(2, index, v)[:, :, :count]
    new_pos = positions.to(sink_pos.dtype)[None].expand(B, T)
    sink_pos = torch.cat([sink_pos, sink_pos.new_full((B, 1), -1.0)], 1).scatter(1, slot, new_pos)[:, :count]
    return sink_k, sink_v, sink_pos
