"""The gated delta rule in PyTorch: a step-by-step recurrence (the reference, and decoding) and a chunked form.

S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = q_t^T S_t, with the state S [K, V] per KV
head (query heads of a group share it), a_t = exp(g_t) a scalar decay per head and b_t in (0, 1) the
write strength. Keys are expected L2-normalized, so (I - b k k^T) shrinks the old value stored
under k before the new one is written: the layer overwrites, where GLA only adds.

The chunked form (the WY / UT transform of DeltaNet) is linear in T: inside a chunk of C steps,
with gamma_i the decay accumulated from the chunk start,
  A_ij = b_i (k_i . k_j) exp(gamma_i - gamma_j) for j < i,   (I + A) [W | U] = [b k e^gamma | b v],
  V' = U - W S_0,   o = (q e^gamma) S_0 + ((q k^T) * exp(gamma_i - gamma_j))_{j <= i} V',
  S_C = e^gamma_C S_0 + (k e^(gamma_C - gamma))^T V'.
Autograd differentiates both forms; the tests hold them equal forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gla_torch import _accumulator, _group


def delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step at a time: q [B, HQ, T, K], k [B, H, T, K], v [B, H, T, V], beta and g [B, H, T] -> (o, S)."""
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    dtype, acc = q.dtype, _accumulator(q.dtype)
    q, k, v, beta = _group(q.to(acc), H) * scale, k.to(acc), v.to(acc), beta.to(acc)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    outputs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, :, t, None, None].to(acc).exp()
        kt = k[:, :, t]
        error = v[:, :, t] - (kt.unsqueeze(-2) @ S).squeeze(-2)
        S = S + (beta[:, :, t, None] * kt).unsqueeze(-1) * error.unsqueeze(-2)
        outputs.append(q[:, :, :, t] @ S)
    o = torch.stack(outputs, dim=3).reshape(B, HQ, T, V)
    return o.to(dtype), S


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
    """The same result in chunks of `chunk_size`: O(T C (K + V)) work, a triangular solve per chunk."""
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    G = HQ // H
    dtype, acc = q.dtype, _accumulator(q.dtype)
    C = chunk_size
    pad = (-T) % C
    q, k, v, beta = q.to(acc) * scale, k.to(acc), v.to(acc), beta.to(acc)
    g = torch.zeros_like(beta) if g is None else g.to(acc)
    if pad:  # padded steps write nothing and do not decay
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    N = (T + pad) // C
    q = q.view(B, H, G, N, C, K)
    k, v = k.view(B, H, N, C, K), v.view(B, H, N, C, V)
    beta, gamma = beta.view(B, H, N, C), g.view(B, H, N, C).cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(C, dtype=acc, device=q.device)
    rhs = torch.cat([beta[..., None] * k * gamma[..., None].exp(), beta[..., None] * v], dim=-1)
    WU = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :K], WU[..., K:]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * decay.unsqueeze(2)  # [B, H, G, N, C, C]
    query_decay = gamma.unsqueeze(2)[..., None].exp()
    outputs = []
    for n in range(N):
        fresh = U[:, :, n] - W[:, :, n] @ S
        inter = (q[:, :, :, n] * query_decay[:, :, :, n]) @ S.unsqueeze(2)
        outputs.append(inter + scores[:, :, :, n] @ fresh.unsqueeze(2))
        last = gamma[:, :, n, -1, None, None]
        S = last.exp() * S + (k[:, :, n] * (last - gamma[:, :, n, :, None]).exp()).transpose(-1, -2) @ fresh
    o = torch.stack(outputs, dim=3).reshape(B, HQ, N * C, V)[:, :, :T]
    return o.to(dtype), S
