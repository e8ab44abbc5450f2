"""Gated linear attention in plain PyTorch: the parallel reference, the chunked form and the recurrence.

All three compute the same thing. With `b_t = sum_{r<=t} g_r` (per key channel):

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T          o_t = scale * q_t^T S_t

Shapes (head-first): q [B, HQ, T, K], k [B, H, T, K], v [B, H, T, V], state [B, H, K, V]; the
log-decay g <= 0 is [B, H, T, K] (per key channel), [B, H, T, 1] (one per head) or None. HQ is a multiple of H (GQA): query head `h` reads the
state of key/value head `h // (HQ // H)`, so keys and values are never repeated.

Precondition of the chunked form with per-channel decay: g >= MIN_LOG_DECAY. Inside a 16-token sub-chunk the decay is
factored around one reference point, which stays in fp32 range only while 15 steps of decay sum to
more than about -88; the model clamps its gates accordingly. A per-head decay needs no such bound:
its intra-chunk decay matrix is formed directly, with the future masked before exponentiating.
"""

from __future__ import annotations

import torch

MIN_LOG_DECAY = -5.0
SUB_CHUNK = 16


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs accumulate in fp32; fp32 and fp64 keep their own precision."""
    return torch.promote_types(dtype, torch.float32)


def _group(q: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, HQ, ...] -> [B, H, G, ...] so a group of query heads shares one key/value head."""
    return q.view(q.shape[0], heads, q.shape[1] // heads, *q.shape[2:])


def gla_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked quadratic form, O(T^2 K) memory: the ground truth the other forms are tested against."""
    B, HQ, T, K = q.shape
    H = k.shape[1]
    g = torch.zeros_like(k) if g is None else g.expand_as(k)
    b = g.cumsum(-2)
    qg = _group(q, H) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    diff = b[:, :, :, None, :] - b[:, :, None, :, :]
    decay = torch.where(causal[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
    scores = torch.einsum("bhgtk,bhsk,bhtsk->bhgts", qg, k, decay)
    o = scores @ v.unsqueeze(2)
    final = torch.einsum("bhsk,bhsv->bhkv", k * (b[:, :, -1:] - b).exp(), v)
    if initial_state is not None:
        o = o + (qg * b.exp().unsqueeze(2)) @ initial_state.unsqueeze(2)
        final = final + b[:, :, -1].exp().unsqueeze(-1) * initial_state
    return o.reshape(B, HQ, T, -1), final


def gla_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence: O(1) memory per step, used for decoding a few tokens."""
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    acc = _accumulator(q.dtype)
    state = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    qg, k, v = _group(q, H).to(acc) * scale, k.to(acc), v.to(acc)
    outs = []
    for t in range(T):
        if g is not None:
            state = g[:, :, t].to(acc).exp().unsqueeze(-1) * state
        state = state + k[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        outs.append(qg[:, :, :, t : t + 1] @ state.unsqueeze(2))
    o = torch.cat(outs, dim=3).reshape(B, HQ, T, V)
    return o.to(q.dtype), state


def gla_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel form, linear in T: matmuls inside chunks, one cheap state scan across them."""
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    C = max(SUB_CHUNK, chunk_size - chunk_size % SUB_CHUNK)
    dtype, acc = q.dtype, _accumulator(q.dtype)
    pad = (-T) % C
    q, k, v = (torch.nn.functional.pad(x.to(acc), (0, 0, 0, pad)) for x in (q, k, v))
    g = torch.zeros_like(k[..., :1]) if g is None else torch.nn.functional.pad(g.to(acc), (0, 0, 0, pad))
    N = (T + pad) // C
    q = _group(q, H).reshape(B, H, -1, N, C, K) * scale
    k, g = k.view(B, H, N, C, K), g.view(B, H, N, C, g.shape[-1])
    v = v.view(B, H, N, C, V)
    b = g.cumsum(-2)

    # Chunk states: each chunk's own contribution, then a scan that carries the state across chunks.
    b_last = b[:, :, :, -1:]
    local = (k * (b_last - b).exp()).transpose(-1, -2) @ v
    chunk_decay = b_last.squeeze(-2).exp().unsqueeze(-1)
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    entering = []
    for n in range(N):
        entering.append(state)
        state = chunk_decay[:, :, n] * state + local[:, :, n]
    o = (q * b.exp().unsqueeze(2)) @ torch.stack(entering, dim=2).unsqueeze(2)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if g.shape[-1] == 1:
        diff = b[..., :, None, 0] - b[..., None, :, 0]
        decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
        scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * decay.unsqueeze(2)
        o = o + scores @ v.unsqueeze(2)
        return o.reshape(B, HQ, N * C, V)[:, :, :T].to(dtype), state

    # Inside a chunk: one reference point per query sub-chunk (its first position) keeps every
    # exponent in range; keys after the sub-chunk are masked before exponentiating.
    m, c = C // SUB_CHUNK, SUB_CHUNK
    b_sub = b.view(B, H, N, m, c, K)
    ref = b_sub[:, :, :, :, :1]  # [B, H, N, m, 1, K]
    q_sub = q.view(B, H, -1, N, m, c, K) * (b_sub - ref).exp().unsqueeze(2)
    visible = torch.arange(C, device=q.device)[None, :] < (torch.arange(m, device=q.device)[:, None] + 1) * c
    key_exp = ref - b.unsqueeze(3)  # [B, H, N, m, C, K]
    key_exp = key_exp.masked_fill(~visible[:, :, None], float("-inf"))
    k_sub = k.unsqueeze(3) * key_exp.exp()
    scores = q_sub @ k_sub.unsqueeze(2).transpose(-1, -2)  # [B, H, G, N, m, c, C]
    scores = scores.masked_fill(~causal.view(m, c, C), 0.0)
    o = o + (scores @ v.unsqueeze(2).unsqueeze(4)).reshape(o.shape)
    o = o.reshape(B, HQ, N * C, V)[:, :, :T]
    return o.to(dtype), state
