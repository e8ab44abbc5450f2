"""The gated delta rule in Triton: the chunked form (forward and backward) and a fused decoding step.

Same shapes and GQA rule as `delta_torch` (q [B, HQ, T, K], k [B, H, T, K] L2-normalized,
v [B, H, T, V], beta [B, H, T], g [B, H, T, 1] (per head) or [B, H, T, K] (per key channel),
state [B, H, K, V] fp32) and the same chunked math (its docstring): per chunk, with gc the
chunk-local cumulative log-decay,
  A = strict-lower b_i (k_i . k_j e^(gc_i - gc_j)), Ai = (I + A)^-1, W = Ai (b k e^gc), U = Ai (b v),
  v' = U - W S_n, o = scale (q e^gc) S_n + scores v', S_{n+1} = e^gc_last S_n + (k e^(gc_last - gc))^T v'.
The decayed products k_i . k_j e^(gc_i - gc_j) are GLA's in-chunk scores of k against itself, and given
v' the output and the state update are GLA's, so the chunked form reuses `gla_triton`'s score, output
and gradient kernels (their sub-chunk reference points keep every exponent in range, per head or per
channel). Its own kernels are the UT transform (`_ut_fwd_kernel`, Ai by forward substitution, row by
row), the scans over chunks that need v' (forward) and dv' (backward) inside the recurrence
(`_delta_state_kernel`, `_delta_dstate_kernel`, one value block of the whole [K, V] state per program:
v' = U - W S reads all of K; where a GPU's shared memory holds a scan at no pipeline depth its value block
narrows, then the pass's chunk length halves: `_fitting_chunks`), and the way back through the UT
transform (`_ut_bwd_kernel`: dv, dbeta, the gradient of the decayed products for GLA's score-gradient
kernel, and b e^gc dX). Torch glue: buffers, contiguity and dtype casts, and the log-decay gradient's
in-chunk suffix sum.

Numerics as in `gla_triton`: decays summed within a chunk only, every exponential of a non-positive
number (g <= 0) outside the shared score kernels, so no decay precondition. Precision: the UT
transform (A, Ai, W, U) and its backward keep fp32 operands whatever the inputs (tf32 for half inputs,
or where torch allows it; fp32-accurate three-pass tf32 otherwise: `_kept_precision`); the products with the state
(W S, k^T v', q^T do, W^T dv', dv' S^T) take `_dot_config`'s operands, bf16 for bf16 inputs. Every sum
accumulates in fp32; W, U, v' and the states are stored in fp32.

The decoding step: each program holds one value block of one key/value head's state: the delta
rule's read-back k^T S of a value column needs only that column, so value blocks are independent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

try:  # in a try block, which transformers' remote-code import check skips: exports load without triton
    import triton
    import triton.language as tl

    from .gla_triton import (
        STAGES,
        SUB_CHUNK,
        SharedMemoryError,
        _block,
        _cdiv,
        _chunk_len,
        _decay_meta,
        _device_guard,
        _dot_config,
        _fitting_tiles,
        _kept_precision,
        _launch,
        _local_cumsum,
        _output,
        _pow2,
        _score_and_state_grads,
        _score_grads,
        _scores,
        _tuned,
    )
except ImportError:
    raise

R = TypeVar("R")
STATE_TILE = 16384  # the most [K, BV] state elements one scan program holds (K=256: BV <= 64)
SCAN_STAGES = (STAGES, 1)  # the scans' tuned depths: fp32 at K = 256 fits a 99 KB GPU at no 2 stages (`compile_check`)


@triton.jit
def _ut_fwd_kernel(
    kk, k, v, beta, gc, Ai, W, U, T,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr, PREC32: tl.constexpr,
):
    """One chunk's UT transform in fp32 from the decayed products kk: Ai = (I + A)^-1, W = Ai (b k e^gc), U = Ai (b v)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    loc = tl.arange(0, BT)
    rows = i_n * BT + loc
    m_t = rows < T
    b_b = tl.load(beta + bh * T + rows, mask=m_t, other=0.0).to(tl.float32)
    b_kk = tl.load(kk + bh * T * BT + rows[:, None] * BT + loc[None, :], mask=m_t[:, None], other=0.0)
    a = tl.where((loc[:, None] > loc[None, :]) & m_t[:, None], b_kk * b_b[:, None], 0.0)
    # Forward substitution: row i of (I + A)^-1 is e_i - sum_{j < i} A_ij (row j), rows above already final.
    ai = tl.where(loc[:, None] == loc[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(loc[:, None] == i, a, 0.0), axis=0)
        row = tl.where(loc == i, 1.0, 0.0) - tl.sum(a_i[:, None] * ai, axis=0)
        ai = tl.where(loc[:, None] == i, row[None, :], ai)
    tl.store(Ai + bh * T * BT + rows[:, None] * BT + loc[None, :], ai, mask=m_t[:, None])
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (cv < V)[None, :]
        offs = bh * T * V + rows[:, None] * V + cv[None, :]
        b_v = tl.load(v + offs, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(U + offs, tl.dot(ai, b_v * b_b[:, None], input_precision=PREC32), mask=m_tv)
    for i_k in range(tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (ck < K)[None, :]
        offs = bh * T * K + rows[:, None] * K + ck[None, :]
        x = tl.load(k + offs, mask=m_tk, other=0.0).to(tl.float32) * b_b[:, None]
        if USE_G:
            x *= tl.exp(tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_tk, other=0.0))
        tl.store(W + offs, tl.dot(ai, x, input_precision=PREC32), mask=m_tk)


@triton.jit
def _delta_state_kernel(
    k, W, U, gc, h0, hbuf, ht, vp, T, N, NH, s_ht,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr, HAS_H0: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Scan over chunks for one value block of the whole state (BK >= K): hbuf[n] = the state entering
    chunk n, v' = U - W S (vp), S <- e^gc_last S + (k e^(gc_last - gc))^T v'; the final state in ht."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k, m_v = ck < K, cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_offs = ck[:, None] * V + cv[None, :]
    s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        s += tl.load(h0 + bh * K * V + kv_offs, mask=m_kv, other=0.0).to(tl.float32)
    for n in range(N):
        tl.store(hbuf + (bh * NH + n) * K * V + kv_offs, s, mask=m_kv)
        rows = n * BT + tl.arange(0, BT)
        m_t = rows < T
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        tk_offs = bh * T * K + rows[:, None] * K + ck[None, :]
        tv_offs = bh * T * V + rows[:, None] * V + cv[None, :]
        b_w = tl.load(W + tk_offs, mask=m_tk, other=0.0)
        b_vp = tl.load(U + tv_offs, mask=m_tv, other=0.0) - tl.dot(b_w.to(DT), s.to(DT), input_precision=PREC)
        tl.store(vp + tv_offs, b_vp, mask=m_tv)
        b_k = tl.load(k + tk_offs, mask=m_tk, other=0.0).to(tl.float32)
        if USE_G:
            g_last = tl.load(gc + bh * T * GK + (tl.minimum(n * BT + BT, T) - 1) * GK + ck * GS, mask=m_k, other=0.0)
            b_g = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_tk, other=0.0)
            s *= tl.exp(g_last)[:, None]
            b_k *= tl.exp(g_last[None, :] - b_g)
        s = tl.dot(tl.trans(b_k.to(DT)), b_vp.to(DT), s, input_precision=PREC)
    tl.store(ht + bh * s_ht + kv_offs, s, mask=m_kv)


@triton.jit
def _dv_local_kernel(
    A, do, dvl, T,
    H: tl.constexpr, G: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC32: tl.constexpr,
):
    """The in-chunk share of dv': the sum over the query group of A^T do (A the causal scores), in fp32."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    loc = tl.arange(0, BT)
    rows = i_n * BT + loc
    cv = i_v * BV + tl.arange(0, BV)
    m_t = rows < T
    m_tv = m_t[:, None] & (cv < V)[None, :]
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for i_g in range(G):
        hq = b * H * G + h * G + i_g
        b_a = tl.load(A + hq * T * BT + rows[:, None] * BT + loc[None, :], mask=m_t[:, None], other=0.0)
        b_do = tl.load(do + hq * T * V + rows[:, None] * V + cv[None, :], mask=m_tv, other=0.0).to(tl.float32)
        acc = tl.dot(tl.trans(b_a), b_do, acc, input_precision=PREC32)
    tl.store(dvl + bh * T * V + rows[:, None] * V + cv[None, :], acc, mask=m_tv)


@triton.jit
def _delta_dstate_kernel(
    q, k, W, gc, do, dvl, dht, dh0, dhbuf, dvp, scale, T, N,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_DH0: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Reverse scan for one value block of the whole state: dhbuf[n + 1] = dS_{n+1} (the state leaving chunk n),
    dv' = dv'_local + (k e^(gc_last - gc)) dS_{n+1} (dvp), dS_n = e^gc_last dS_{n+1}
    + scale sum_group (q e^gc)^T do - W^T dv'; dh0 = dS_0."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k, m_v = ck < K, cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_offs = ck[:, None] * V + cv[None, :]
    ds = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        ds += tl.load(dht + bh * K * V + kv_offs, mask=m_kv, other=0.0).to(tl.float32)
    for i in range(N):
        n = N - 1 - i
        tl.store(dhbuf + (bh * (N + 1) + n + 1) * K * V + kv_offs, ds, mask=m_kv)
        rows = n * BT + tl.arange(0, BT)
        m_t = rows < T
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        tk_offs = rows[:, None] * K + ck[None, :]
        tv_offs = bh * T * V + rows[:, None] * V + cv[None, :]
        b_k = tl.load(k + bh * T * K + tk_offs, mask=m_tk, other=0.0).to(tl.float32)
        if USE_G:
            g_last = tl.load(gc + bh * T * GK + (tl.minimum(n * BT + BT, T) - 1) * GK + ck * GS, mask=m_k, other=0.0)
            b_g = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_tk, other=0.0)
            b_k *= tl.exp(g_last[None, :] - b_g)
        b_dvp = tl.load(dvl + tv_offs, mask=m_tv, other=0.0)
        b_dvp = tl.dot(b_k.to(DT), ds.to(DT), b_dvp, input_precision=PREC)
        tl.store(dvp + tv_offs, b_dvp, mask=m_tv)
        if USE_G:
            ds *= tl.exp(g_last)[:, None]
        for i_g in range(G):
            hq = b * H * G + h * G + i_g
            b_q = tl.load(q + hq * T * K + tk_offs, mask=m_tk, other=0.0).to(tl.float32) * scale
            if USE_G:
                b_q *= tl.exp(b_g)
            b_do = tl.load(do + hq * T * V + rows[:, None] * V + cv[None, :], mask=m_tv, other=0.0)
            ds = tl.dot(tl.trans(b_q.to(DT)), b_do.to(DT), ds, input_precision=PREC)
        b_w = tl.load(W + bh * T * K + tk_offs, mask=m_tk, other=0.0)
        ds -= tl.dot(tl.trans(b_w.to(DT)), b_dvp.to(DT), input_precision=PREC)
    if HAS_DH0:
        tl.store(dh0 + bh * K * V + kv_offs, ds, mask=m_kv)


@triton.jit
def _ut_bwd_kernel(
    kk, k, v, beta, gc, Ai, W, U, hbuf, dvp, dkx, dkk, dv, dbeta, T, N,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    PREC32: tl.constexpr,
):
    """Back through v' = U - W S_n and one chunk's UT transform.

    dU = dv', dW = -dv' S_n^T, [dX | dY] = Ai^T [dW | dU] (X = b k e^gc, Y = b v), and on the strict lower
    triangle dA = -(dX W^T + dY U^T). Stores dv = b dY, dbeta (from X, Y and A = b kk), dkx = b e^gc dX
    (X's share of dk; times k, of dgc) and dkk = b dA, the gradient of the decayed products kk, which
    GLA's score-gradient kernel takes back to k and gc.
    """
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    loc = tl.arange(0, BT)
    rows = i_n * BT + loc
    m_t = rows < T
    b_b = tl.load(beta + bh * T + rows, mask=m_t, other=0.0).to(tl.float32)
    ai = tl.load(Ai + bh * T * BT + rows[:, None] * BT + loc[None, :], mask=m_t[:, None], other=0.0)
    da = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (cv < V)[None, :]
        offs = bh * T * V + rows[:, None] * V + cv[None, :]
        b_dy = tl.dot(tl.trans(ai), tl.load(dvp + offs, mask=m_tv, other=0.0), input_precision=PREC32)
        da = tl.dot(-b_dy, tl.trans(tl.load(U + offs, mask=m_tv, other=0.0)), da, input_precision=PREC32)
        db += tl.sum(b_dy * tl.load(v + offs, mask=m_tv, other=0.0).to(tl.float32), axis=1)
        tl.store(dv + offs, (b_dy * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
    for i_k in range(tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        m_tk = m_t[:, None] & m_k[None, :]
        offs = bh * T * K + rows[:, None] * K + ck[None, :]
        dw = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            cv = i_v * BV + tl.arange(0, BV)
            m_v = cv < V
            tv_offs = bh * T * V + rows[:, None] * V + cv[None, :]
            b_dvp = tl.load(dvp + tv_offs, mask=m_t[:, None] & m_v[None, :], other=0.0)
            kv_offs = (bh * (N + 1) + i_n) * K * V + ck[:, None] * V + cv[None, :]
            b_h = tl.load(hbuf + kv_offs, mask=m_k[:, None] & m_v[None, :], other=0.0)
            dw = tl.dot(b_dvp.to(DT), tl.trans(b_h.to(DT)), dw, input_precision=PREC)
        b_dx = -tl.dot(tl.trans(ai), dw, input_precision=PREC32)
        da = tl.dot(-b_dx, tl.trans(tl.load(W + offs, mask=m_tk, other=0.0)), da, input_precision=PREC32)
        if USE_G:
            b_dx *= tl.exp(tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_tk, other=0.0))
        db += tl.sum(b_dx * tl.load(k + offs, mask=m_tk, other=0.0).to(tl.float32), axis=1)  # dX . (k e^gc)
        tl.store(dkx + offs, b_dx * b_b[:, None], mask=m_tk)
    b_kk = tl.load(kk + bh * T * BT + rows[:, None] * BT + loc[None, :], mask=m_t[:, None], other=0.0)
    da = tl.where((loc[:, None] > loc[None, :]) & m_t[:, None], da, 0.0)
    db += tl.sum(da * b_kk, axis=1)
    tl.store(dkk + bh * T * BT + rows[:, None] * BT + loc[None, :], da * b_b[:, None], mask=m_t[:, None])
    tl.store(dbeta + bh * T + rows, db.to(dbeta.dtype.element_ty), mask=m_t)


def _state_tiles(configs: list, named_args: dict, **kwargs) -> list:
    """`_fitting_tiles`, and no value tile that makes a scan's whole-K state wider than STATE_TILE elements."""
    kept = _fitting_tiles(configs, named_args, **kwargs)
    K = max(16, _pow2({**named_args, **kwargs}["K"]))
    return [c for c in kept if K * c.kwargs["BV"] <= STATE_TILE] or kept[:1]


_ut_fwd = _tuned(_ut_fwd_kernel, ["BT", "K", "V", "USE_G", "GS"], ("BK", "BV"))
_delta_state = _tuned(
    _delta_state_kernel, ["BT", "K", "V", "USE_G", "GS"], ("BV",), prune=_state_tiles, stages=SCAN_STAGES
)
_dv_local = _tuned(_dv_local_kernel, ["BT", "V", "G"], ("BV",))
_delta_dstate = _tuned(
    _delta_dstate_kernel, ["BT", "K", "V", "G", "USE_G", "GS"], ("BV",), prune=_state_tiles, stages=SCAN_STAGES
)
_ut_bwd = _tuned(_ut_bwd_kernel, ["BT", "K", "V", "USE_G", "GS"], ("BK", "BV"))


def _full_k(K: int) -> int:
    """The scans' key tile: all of K in one power-of-two block."""
    return max(16, _pow2(K))


def _ut_transform(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gc: torch.Tensor | None, BT: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kk [B, H, T, BT], the decayed products k_i . k_j e^(gc_i - gc_j) on and below the diagonal, then Ai
    [B, H, T, BT], W [B, H, T, K] and U [B, H, T, V]), fp32, chunk by chunk."""
    B, H, T, K = k.shape
    V = v.shape[-1]
    kk = _scores(k, k, gc, 1.0, BT)
    Ai = torch.empty(B, H, T, BT, device=k.device, dtype=torch.float32)
    W = torch.empty(B, H, T, K, device=k.device, dtype=torch.float32)
    U = torch.empty(B, H, T, V, device=k.device, dtype=torch.float32)
    _launch(
        _ut_fwd, lambda t: (_cdiv(T, BT), B * H), kk, k, v, beta, k if gc is None else gc, Ai, W, U, T,
        tiles={"BK": _block(K), "BV": _block(V)}, K=K, V=V, BT=BT, **_decay_meta(gc),
        PREC32=_kept_precision(k.dtype),
    )
    return kk, Ai, W, U


def _states(
    k: torch.Tensor, W: torch.Tensor, U: torch.Tensor, gc: torch.Tensor | None, h0: torch.Tensor | None,
    BT: int, keep_final: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(states entering every chunk, final state, v'), fp32; with keep_final the final state is the
    buffer's last entry (the backward reads N + 1 states), else a tensor of its own."""
    B, H, T, K = k.shape
    V = U.shape[-1]
    N = _cdiv(T, BT)
    NH = N + 1 if keep_final else N
    hbuf = torch.empty(B, H, NH, K, V, device=k.device, dtype=torch.float32)
    ht = hbuf[:, :, N] if keep_final else torch.empty(B, H, K, V, device=k.device, dtype=torch.float32)
    vp = torch.empty_like(U)
    _launch(
        _delta_state, lambda t: (_cdiv(V, t["BV"]), B * H),
        k, W, U, k if gc is None else gc, k if h0 is None else h0, hbuf, ht, vp, T, N, NH,
        NH * K * V if keep_final else K * V, tiles={"BV": _block(V)}, narrow=True,
        K=K, V=V, BT=BT, BK=_full_k(K), **_decay_meta(gc), HAS_H0=h0 is not None, **_dot_config(k.dtype),
    )
    return hbuf, ht, vp


def _chunk_suffix_sum(x: torch.Tensor, BT: int) -> torch.Tensor:
    """sum over r >= t within t's chunk of x_r, along T of x [B, H, T, K]: dg from dgc (gc_r = sum_{t <= r} g_t)."""
    T = x.shape[2]
    pad = (-T) % BT
    chunks = torch.nn.functional.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, BT))
    return chunks.flip(3).cumsum(3).flip(3).flatten(2, 3)[:, :, :T]


def _backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    h0: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None, scale: float, BT: int,
) -> tuple[torch.Tensor, ...]:
    """Recomputes the transform, the chunk states and the scores (the forward keeps only the inputs).

    Returns dq, dk, dv, dbeta, dg (None without g) and dh0 (None without an initial state).
    """
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    G, N = HQ // H, _cdiv(T, BT)
    gc = None if g is None else _local_cumsum(g, BT)
    gp = k if gc is None else gc
    kk, Ai, W, U = _ut_transform(k, v, beta, gc, BT)
    hbuf, _, vp = _states(k, W, U, gc, h0, BT, keep_final=True)
    A = _scores(q, k, gc, scale, BT)
    prec32 = _kept_precision(q.dtype)
    cfg = {"H": H, "G": G, "BT": BT, **_dot_config(q.dtype)}

    dvl = torch.empty(B, H, T, V, device=q.device, dtype=torch.float32)
    _launch(
        _dv_local, lambda t: (_cdiv(V, t["BV"]), N, B * H), A, do, dvl, T,
        tiles={"BV": _block(V)}, H=H, G=G, V=V, BT=BT, PREC32=prec32,
    )
    dhbuf = torch.empty(B, H, N + 1, K, V, device=q.device, dtype=torch.float32)  # slot 0 unused
    dvp = torch.empty_like(dvl)
    dh0 = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32) if h0 is not None else None
    _launch(
        _delta_dstate, lambda t: (_cdiv(V, t["BV"]), B * H),
        q, k, W, gp, do, dvl, k if dht is None else dht, dhbuf if dh0 is None else dh0, dhbuf, dvp, scale, T, N,
        tiles={"BV": _block(V)}, narrow=True, K=K, V=V, BK=_full_k(K), **_decay_meta(gc),
        HAS_DHT=dht is not None, HAS_DH0=dh0 is not None, **cfg,
    )
    dq, dk_scores, dg_scores = _score_and_state_grads(
        q, k, vp, gc, hbuf, None, do, None, dhbuf, None, scale, BT, dk_dtype=torch.float32
    )
    dkx = torch.empty_like(dk_scores)
    dkk = torch.empty_like(kk)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    _launch(
        _ut_bwd, lambda t: (N, B * H),
        kk, k, v, beta, gp, Ai, W, U, hbuf, dvp, dkx, dkk, dv, dbeta, T, N,
        tiles={"BK": _block(K), "BV": _block(V)}, K=K, V=V, BT=BT, **_decay_meta(gc),
        **_dot_config(q.dtype), PREC32=prec32,
    )
    dk_rows, dk_cols = _score_grads(k, k, gc, dkk, 1.0, BT)  # kk's rows and columns are both k
    dk = (dk_scores + dkx + dk_rows + dk_cols).to(k.dtype)
    dg = None
    if gc is not None:
        # d/dgc of X = b k e^gc is dkx k; of the products, k (rows - columns), as GLA's scores give dg.
        dgc = _chunk_suffix_sum(k.float() * (dkx + dk_rows - dk_cols), BT)
        dg = (dg_scores + (dgc.sum(-1, keepdim=True) if gc.shape[-1] == 1 else dgc)).to(g.dtype)
    return dq, dk, dv, dbeta, dg, dh0


_chunk_lens: dict[tuple, int] = {}  # (K, V, dtype) -> the chunk length a GPU's shared memory forced below the asked


def _fitting_chunks(run: Callable[[int], R], BT: int, key: tuple) -> R:
    """run(BT), again at half the chunk length (down to SUB_CHUNK) while no launch fits the GPU's shared memory.
    The chunk length trades speed only. At K = 256 in fp32 the reverse state scan needs 128 KB at BT = 64 whatever
    its depth or value tile (`compile_check`), more than the 99 KB per block of sm_86 / sm_89 / sm_120."""
    BT = min(BT, _chunk_lens.get(key, BT))
    while True:
        try:
            return run(BT)
        except SharedMemoryError:
            if BT <= SUB_CHUNK:
                raise
            BT //= 2
            _chunk_lens[key] = BT


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None, scale: float,
    h0: torch.Tensor | None, BT: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    gc = None if g is None else _local_cumsum(g, BT)
    _, _, W, U = _ut_transform(k, v, beta, gc, BT)
    hbuf, ht, vp = _states(k, W, U, gc, h0, BT, keep_final=False)
    return _output(q, vp, gc, hbuf, None, _scores(q, k, gc, scale, BT), scale, BT), ht


class _ChunkDelta(torch.autograd.Function):
    """The chunked gated delta rule with Triton forward and backward; saves only the inputs. Each pass recomputes
    what it needs from them, so each may take its own chunk length (`_fitting_chunks`)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, scale, initial_state, BT):
        ctx.key = (k.shape[-1], v.shape[-1], q.dtype)
        o, ht = _fitting_chunks(lambda bt: _forward(q, k, v, beta, g, scale, initial_state, bt), BT, ctx.key)
        ctx.save_for_backward(q, k, v, beta, g, initial_state)
        ctx.scale, ctx.BT = scale, BT
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, g, initial_state = ctx.saved_tensors
        do, dht = do.contiguous(), None if dht is None else dht.contiguous()
        with _device_guard(q):
            dq, dk, dv, dbeta, dg, dh0 = _fitting_chunks(
                lambda bt: _backward(q, k, v, beta, g, initial_state, do, dht, ctx.scale, bt), ctx.BT, ctx.key
            )
        dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
        return dq, dk, dv, dbeta, dg, None, dh0, None


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    state: torch.Tensor | None,
) -> None:
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    if HQ % H or k.shape != (B, H, T, K) or v.shape[:3] != (B, H, T) or beta.shape != (B, H, T):
        raise ValueError(
            f"delta rule shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"beta {tuple(beta.shape)}"
        )
    if g is not None and g.shape not in ((B, H, T, 1), (B, H, T, K)):
        raise ValueError(
            f"g must be {(B, H, T, 1)} (one log-decay per head) or {(B, H, T, K)} (per key channel), got {tuple(g.shape)}"
        )
    if state is not None and state.shape != (B, H, K, V):
        raise ValueError(f"state must be {(B, H, K, V)}, got {tuple(state.shape)}")


def chunk_delta_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule, differentiable in q, k, v, beta, g and initial_state:
    (o in q.dtype, final state fp32). g is a log-decay (<= 0); chunk_size (rounded to a power of two
    in [16, 64], halved where the GPU's shared memory holds no launch at it) trades speed only."""
    _check(q, k, v, beta, g, initial_state)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = None if g is None else g.contiguous()
    h0 = None if initial_state is None else initial_state.contiguous()
    with _device_guard(q):
        return _ChunkDelta.apply(q, k, v, beta, g, float(scale), h0, _chunk_len(chunk_size))


@triton.jit
def _fused_recurrent_delta_kernel(
    q, k, v, beta, g, h0, o, ht, scale, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr, HAS_H0: tl.constexpr,
):
    """S = diag(a) S; S += b k (v - k^T S)^T; o = q^T S, token by token; ht may alias h0."""
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
            state *= tl.exp(tl.load(g + (bh * T + t) * GK + ck * GS, mask=m_k, other=0.0).to(tl.float32))[:, None]
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
    _check(q, k, v, beta, g, initial_state)
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = None if g is None else g.contiguous()
    o = torch.empty(B, HQ, T, V, device=q.device, dtype=q.dtype)
    ht = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.contiguous()
    BK = _pow2(K)
    BV = min(_pow2(V), max(16, 8192 // BK))
    with _device_guard(q):
        _fused_recurrent_delta_kernel[(_cdiv(V, BV), B * H)](
            q, k, v, beta, beta if g is None else g, ht if h0 is None else h0, o, ht, float(scale), T,
            H=H, G=HQ // H, K=K, V=V, BK=BK, BV=BV, **_decay_meta(g), HAS_H0=h0 is not None,
        )  # fmt: skip
    return o, ht
