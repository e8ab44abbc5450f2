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
from torch.utils.checkpoint import checkpoint

MIN_LOG_DECAY = -5.0
SUB_CHUNK = 16
STEP_BMM_ROWS = 16  # compiled CPU products with at most this many rows per batch entry become multiply-and-sum


def step_bmm(a: torch.Tensor, b: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.bmm(a, b)` (`torch.baddbmm(add, a, b)` with `add`) for a decoding step's small products.

    a [N, M, K], b [N, K, P]. Inside a torch.compile graph on CPU, with few rows (M), it is a broadcast
    multiply and a sum, which inductor fuses into its own loops: there each extern BLAS call cost
    10-50 µs of dispatch and threading for a few µs of math, on some ten products per layer and
    token. Everywhere else, the library's product.
    """
    if torch.compiler.is_compiling() and a.device.type == "cpu" and a.shape[-2] <= STEP_BMM_ROWS:
        product = (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
        return product if add is None else product + add
    return torch.bmm(a, b) if add is None else torch.baddbmm(add, a, b)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, with no op at all when it already is (a decoding step pays ~1 µs for even a no-op cast)."""
    return x if x.dtype == dtype else x.to(dtype)


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
    dtype, acc = q.dtype, _accumulator(q.dtype)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    g = torch.zeros_like(k) if g is None else g.to(acc).expand_as(k)
    b = g.cumsum(-2)
    qg = _group(q, H) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    diff = b[:, :, :, None, :] - b[:, :, None, :, :]
    decay = torch.where(causal[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
    scores = torch.einsum("bhgtk,bhsk,bhtsk->bhgts", qg, k, decay)
    o = scores @ v.unsqueeze(2)
    final = torch.einsum("bhsk,bhsv->bhkv", k * (b[:, :, -1:] - b).exp(), v)
    if initial_state is not None:
        initial_state = initial_state.to(acc)
        o = o + (qg * b.exp().unsqueeze(2)) @ initial_state.unsqueeze(2)
        final = final + b[:, :, -1].exp().unsqueeze(-1) * initial_state
    return o.reshape(B, HQ, T, -1).to(dtype), final


def gla_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence: O(1) memory per step, used for decoding a few tokens.

    With `inplace`, no gradient to track and an `initial_state` already in the accumulator dtype and
    contiguous, that tensor is updated and returned, as the Triton step does on CUDA: a cache keeps
    its buffer and a decoding step allocates no new state.
    """
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    acc = _accumulator(q.dtype)
    tracked = (q, k, v, g, initial_state)
    grads = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tracked)
    if initial_state is None:
        state = q.new_zeros(B, H, K, V, dtype=acc)
    elif inplace and not grads and initial_state.dtype == acc and initial_state.is_contiguous():
        state = initial_state
    else:
        state = initial_state.to(acc, copy=True)
    if T == 1 and not grads:  # a decoding step: 3D matmuls over (row, head), the fewest ops (each costs more than its math)
        # The in-place update computes in the state's dtype whatever k's and v's (no casts: each op costs here).
        if g is not None:
            state.mul_(as_dtype(g, acc).transpose(-1, -2).exp())
        state.addcmul_(k.transpose(-1, -2), v)  # the outer product k v^T, one broadcast op
        o = step_bmm(as_dtype(q, acc).reshape(B * H, HQ // H, K), state.view(B * H, K, V))
        return as_dtype((o if scale == 1.0 else o.mul_(scale)).view(B, HQ, 1, V), q.dtype), state
    qg, k, v = _group(q, H).to(acc), k.to(acc), v.to(acc)
    qg = qg if scale == 1.0 else qg * scale
    decay = None if g is None else g.to(acc).exp().unsqueeze(-1)
    outs = []
    for t in range(T):
        if grads:
            state = state if decay is None else decay[:, :, t] * state
            state = state + k[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        else:
            if decay is not None:
                state.mul_(decay[:, :, t])
            flat = state.view(B * H, K, V)
            flat.baddbmm_(k[:, :, t].reshape(B * H, K, 1), v[:, :, t].reshape(B * H, 1, V))
        outs.append(qg[:, :, :, t] @ state)  # [B, H, G, V]: a group's queries are the rows of one matmul
    o = outs[0].unsqueeze(3) if T == 1 else torch.stack(outs, dim=3)
    return o.reshape(B, HQ, T, V).to(q.dtype), state


def _sub_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, causal: torch.Tensor, start: int
) -> torch.Tensor:
    """In-chunk output of the queries q [B, H, N, G, S, K] at `start` of each chunk, from the chunk's keys up
    to them: with per-channel cumulative log-decays b [B, H, N, C, K], relative to the sub-chunk's first one."""
    B, H, N, G, S, K = q.shape
    end = start + S
    ref = b[:, :, :, start : start + 1]
    qi = q * (b[:, :, :, start:end] - ref).exp().unsqueeze(3)
    ki = k[:, :, :, :end] * (ref - b[:, :, :, :end]).exp()
    scores = (qi.view(B, H, N, G * S, K) @ ki.transpose(-1, -2)).view(B, H, N, G, S, end)
    scores = scores.masked_fill(~causal[start:end, :end], 0.0)
    return (scores.view(B, H, N, G * S, end) @ v[:, :, :, :end]).view(B, H, N, G, S, v.shape[-1])


def gla_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel form, linear in T: matmuls inside chunks, one cheap state scan across them.

    A group's query heads are stacked as the rows of one chunk ([B, H, N, G*C, K]), so every matmul
    is a plain batched one: broadcasting K/V over the group would make matmul copy them.
    """
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    G = HQ // H
    C = max(SUB_CHUNK, chunk_size - chunk_size % SUB_CHUNK)
    dtype, acc = q.dtype, _accumulator(q.dtype)
    pad = (-T) % C
    N = (T + pad) // C

    def chunks(x: torch.Tensor) -> torch.Tensor:
        """[B, H', T, D] -> [B, H', N, C, D] in the accumulator dtype, zero-padded to whole chunks."""
        x = x.to(acc)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.view(*x.shape[:2], N, C, x.shape[-1])

    q = (chunks(q) * scale).view(B, H, G, N, C, K).transpose(2, 3).contiguous()
    k, v = chunks(k), chunks(v)
    b = (k.new_zeros(B, H, N, C, 1) if g is None else chunks(g)).cumsum(-2)

    # Chunk states: each chunk's own contribution, then a scan that carries the state across chunks.
    b_last = b[:, :, :, -1:]
    local = (k * (b_last - b).exp()).transpose(-1, -2) @ v
    chunk_decay = b_last.transpose(-1, -2).exp()
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    entering = []
    for n in range(N):
        entering.append(state)
        state = chunk_decay[:, :, n] * state + local[:, :, n]
    o = ((q * b.exp().unsqueeze(3)).view(B, H, N, G * C, K) @ torch.stack(entering, dim=2)).view(B, H, N, G, C, V)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if b.shape[-1] == 1:
        # One decay per head: the in-chunk decay matrix itself, the future masked before exponentiating.
        diff = b - b.transpose(-1, -2)
        decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
        scores = (q.view(B, H, N, G * C, K) @ k.transpose(-1, -2)).view(B, H, N, G, C, C) * decay.unsqueeze(3)
        o = o + (scores.view(B, H, N, G * C, C) @ v).view(B, H, N, G, C, V)
    else:
        # Per key channel: one reference point per query sub-chunk keeps every exponent in range. Each
        # sub-chunk's decayed copies of q and k are recomputed in backward rather than kept.
        grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, b))
        for start in range(0, C, SUB_CHUNK):
            inputs = (q[:, :, :, :, start : start + SUB_CHUNK], k, v, b, causal, start)
            part = checkpoint(_sub_chunk, *inputs, use_reentrant=False) if grads else _sub_chunk(*inputs)
            o[:, :, :, :, start : start + SUB_CHUNK] += part
    o = o.transpose(2, 3).reshape(B, HQ, N * C, V)[:, :, :T]
    return o.to(dtype), state
