"""The gated delta rule in PyTorch: a step-by-step recurrence (the reference, and decoding) and a chunked form.

S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} + b_t k_t v_t^T, o_t = q_t^T S_t, with the state S [K, V] per KV
head (query heads of a group share it), a_t = exp(g_t) the decay, one per head (g [B, H, T, 1]) or per
key channel (g [B, H, T, K], as GLA's), and b_t in (0, 1) the write strength. Keys are expected
L2-normalized, so (I - b k k^T) shrinks the old value stored under k before the new one is written:
the layer overwrites, where GLA only adds.

The chunked form (the WY / UT transform of DeltaNet) is linear in T: inside a chunk of C steps,
with gamma_i the decay accumulated from the chunk start (per channel c where the decay is),
  A_ij = b_i sum_c k_ic k_jc exp(gamma_ic - gamma_jc) for j < i,   (I + A) [W | U] = [b k e^gamma | b v],
  V' = U - W S_0,   o = (q e^gamma) S_0 + (sum_c q_ic k_jc exp(gamma_ic - gamma_jc))_{j <= i} V',
  S_C = e^gamma_C S_0 + (k e^(gamma_C - gamma))^T V'.
Per channel the in-chunk decays are factored around the first step of each 16-step sub-chunk, as in
`gla_torch`, with the same precondition g >= MIN_LOG_DECAY; one decay per head needs none.
Autograd differentiates both forms; the tests hold them equal forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gla_torch import SUB_CHUNK, _accumulator, _group


def delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step at a time: q [B, HQ, T, K], k [B, H, T, K], v [B, H, T, V], beta [B, H, T], g [B, H, T, 1 or K] -> (o, S)."""
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    dtype, acc = q.dtype, _accumulator(q.dtype)
    q, k, v, beta = _group(q.to(acc), H) * scale, k.to(acc), v.to(acc), beta.to(acc)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    decay = None if g is None else g.to(acc).exp().unsqueeze(-1)
    outputs = []
    for t in range(T):
        if decay is not None:
            S = S * decay[:, :, t]
        kt = k[:, :, t]
        error = v[:, :, t] - (kt.unsqueeze(-2) @ S).squeeze(-2)
        S = S + (beta[:, :, t, None] * kt).unsqueeze(-1) * error.unsqueeze(-2)
        outputs.append(q[:, :, :, t] @ S)
    o = torch.stack(outputs, dim=3).reshape(B, HQ, T, V)
    return o.to(dtype), S


def _decayed_products(x: torch.Tensor, k: torch.Tensor, gamma: torch.Tensor, diagonal: int) -> torch.Tensor:
    """(sum_c x_ic k_jc exp(gamma_ic - gamma_jc))_ij on and below the `diagonal`-th diagonal of each chunk, else 0.

    x [..., R, C, K]: R rows of queries that share the keys k and decays gamma [..., C, K or 1] (a query
    group; R = 1 for the keys themselves), stacked so every product is one plain batched matmul. One
    decay per head: the decay matrix itself, the future masked before exponentiating. Per channel: each
    16-row sub-chunk meets the keys through its first row's decay, so exp(gamma_ic - ref) <= 1 and
    exp(ref - gamma_jc) stays below exp(-15 MIN_LOG_DECAY) for the keys up to the sub-chunk's end.
    """
    R, C, K = x.shape[-3:]
    rows = torch.arange(C, device=x.device)
    lower = rows[:, None] - rows[None, :] >= -diagonal
    if gamma.shape[-1] == 1:
        diff = gamma - gamma.transpose(-1, -2)
        products = (x.flatten(-3, -2) @ k.transpose(-1, -2)).unflatten(-2, (R, C))
        return products * torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp().unsqueeze(-3)
    S = min(SUB_CHUNK, C)
    ref = gamma[..., ::S, :]  # [..., C / S, K]: each sub-chunk's first row
    xs = x * (gamma - ref.repeat_interleave(S, dim=-2)).exp().unsqueeze(-3)
    xs = xs.unflatten(-2, (C // S, S)).transpose(-4, -3).flatten(-3, -2)  # [..., C / S, R * S, K]
    reach = rows[None, :] < rows[::S, None] + S  # [C / S, C]: the keys up to each sub-chunk's end
    exponent = ref.unsqueeze(-2) - gamma.unsqueeze(-3)  # [..., C / S, C, K]
    ks = k.unsqueeze(-3) * exponent.masked_fill(~reach[..., None], float("-inf")).exp()
    products = (xs @ ks.transpose(-1, -2)).unflatten(-2, (R, S)).transpose(-4, -3)  # [..., R, C / S, S, C]
    return products.flatten(-3, -2).masked_fill(~lower, 0.0)


def delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result in chunks of `chunk_size` (a multiple of 16 per channel): O(T C (K + V)) work, a triangular solve per chunk."""
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    G = HQ // H
    dtype, acc = q.dtype, _accumulator(q.dtype)
    C = chunk_size
    if g is not None and g.shape[-1] > 1:
        C = max(SUB_CHUNK, C - C % SUB_CHUNK)
    pad = (-T) % C
    q, k, v, beta = q.to(acc) * scale, k.to(acc), v.to(acc), beta.to(acc)
    g = k.new_zeros(B, H, T, 1) if g is None else g.to(acc)
    if pad:  # padded steps write nothing and do not decay
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q = q.view(B, H, G, N, C, K).transpose(2, 3)  # [B, H, N, G, C, K]: a group's queries share the keys
    k, v = k.view(B, H, N, C, K), v.view(B, H, N, C, V)
    beta, gamma = beta.view(B, H, N, C), g.view(B, H, N, C, -1).cumsum(-2)
    A = beta[..., None] * _decayed_products(k.unsqueeze(-3), k, gamma, -1).squeeze(-3)
    eye = torch.eye(C, dtype=acc, device=q.device)
    rhs = torch.cat([beta[..., None] * k * gamma.exp(), beta[..., None] * v], dim=-1)
    WU = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :K], WU[..., K:]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    scores = _decayed_products(q, k, gamma, 0)  # [B, H, N, G, C, C]
    decayed_q = q * gamma.unsqueeze(-3).exp()
    last = gamma[:, :, :, -1:]  # [B, H, N, 1, K or 1]
    carried = last.transpose(-1, -2).exp()
    decayed_k = (k * (last - gamma).exp()).transpose(-1, -2)
    # Per chunk, one slice of each tensor: unbind's backward stacks the slices' gradients once, where
    # indexing would write each into a zero tensor of the whole.
    per_chunk = zip(U.unbind(2), W.unbind(2), decayed_q.unbind(2), scores.unbind(2), carried.unbind(2), decayed_k.unbind(2))
    outputs = []
    for u, w, qn, sn, an, kn in per_chunk:
        fresh = u - w @ S
        outputs.append((qn @ S.unsqueeze(2)) + sn @ fresh.unsqueeze(2))
        S = an * S + kn @ fresh
    o = torch.stack(outputs, dim=3).reshape(B, HQ, N * C, V)[:, :, :T]
    return o.to(dtype), S
