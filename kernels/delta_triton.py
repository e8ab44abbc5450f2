"""The gated delta rule's decoding step in Triton: one fused kernel over the new tokens.

Same shapes and GQA rule as `delta_torch` (q [B, HQ, T, K], k [B, H, T, K] L2-normalized,
v [B, H, T, V], beta and g [B, H, T], state [B, H, K, V] fp32). Each program holds one value block
of one key/value head's state: the delta rule's read-back k^T S of a value column needs only that
column, so value blocks are independent. The chunked form for training and prefill runs in
PyTorch (`delta_torch.delta_chunked`) on every device for now.
"""

from __future__ import annotations

import torch

try:  # in a try block, which transformers' remote-code import check skips: exports load without triton
    import triton
    import triton.language as tl
except ImportError:
    raise


@triton.jit
def _fused_recurrent_delta_kernel(
    q, k, v, beta, g, h0, o, ht, scale, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_H0: tl.constexpr,
):
    """S = a S; S += b k (v - k^T S)^T; o = q^T S, token by token; ht may alias h0."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k, m_v = ck < K, cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_offs = ck[:, None] * V + cv[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        state += tl.load(h0 + bh * K * V + kv_offs, mask=m_kv, other=0.0).to(tl.float32)
    for t in range(T):
        b_k = tl.load(k + (bh * T + t) * K + ck, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (bh * T + t) * V + cv, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + bh * T + t).to(tl.float32)
        if USE_G:
            state *= tl.exp(tl.load(g + bh * T + t).to(tl.float32))
        error = b_v - tl.sum(b_k[:, None] * state, axis=0)
        state += (b_beta * b_k)[:, None] * error[None, :]
        for i_g in range(G):
            hq = b * H * G + h * G + i_g
            b_q = tl.load(q + (hq * T + t) * K + ck, mask=m_k, other=0.0).to(tl.float32) * scale
            b_o = tl.sum(b_q[:, None] * state, axis=0)
            tl.store(o + (hq * T + t) * V + cv, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(ht + bh * K * V + kv_offs, state, mask=m_kv)


def fused_recurrent_delta_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoding step(s) without autograd: (o in q.dtype, final state fp32)."""
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    if HQ % H or k.shape != (B, H, T, K) or v.shape[:3] != (B, H, T) or beta.shape != (B, H, T):
        raise ValueError(f"delta rule shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = None if g is None else g.contiguous()
    o = torch.empty(B, HQ, T, V, device=q.device, dtype=q.dtype)
    ht = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.contiguous()
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), max(16, 8192 // BK))
    _fused_recurrent_delta_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, beta, beta if g is None else g, ht if h0 is None else h0, o, ht, float(scale), T,
        H=H, G=HQ // H, K=K, V=V, BK=BK, BV=BV, USE_G=g is not None, HAS_H0=h0 is not None,
    )  # fmt: skip
    return o, ht
