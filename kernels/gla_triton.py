"""Gated linear attention in Triton: the chunked form (forward and backward) and a fused decoding step.

Same math, shapes and GQA rule as `gla_torch` (head-first q [B, HQ, T, K], k [B, H, T, K],
v [B, H, T, V], g [B, H, T, K] or [B, H, T, 1] log-decay <= 0 or None, state [B, H, K, V] fp32).

Numerics: decays are summed within a chunk only (`gc`, chunk-local cumulative log-decay), and every
exponential the kernels take is of a non-positive number or a bounded one, so nothing overflows whatever the decay:
- across chunks the state is carried with exp(gc_last) and keys are weighted by exp(gc_last - gc);
- inside a chunk, 16-token sub-chunks meet through a reference point (the first row of the query
  sub-chunk forward, the last row of the key sub-chunk backward) that lies between both factors;
- a diagonal 16x16 block meets through its own first row f as well, q_i exp(gc_i - gc_f) . k_j exp(gc_f - gc_j),
  one dot (fp32-accurate, as the per-pair sums were) masked to i >= j, where BC elementwise passes would take
  the pairs one key at a time. The key factor is exp of a non-negative number, at most the decay the block
  spans (gc_f - gc_last, per key channel); above DIAG_SPAN it could overflow, so such a block (per key tile)
  forms the exponent gc_i - gc_j per pair instead, masked before exp.
Unlike the PyTorch chunked form this needs no MIN_LOG_DECAY precondition.

Precision: matmul operands are bf16 when the inputs are bf16 (tensor cores, fp32 accumulation), fp32
otherwise: tf32 for fp16 inputs or when torch.set_float32_matmul_precision allows it, three-pass tf32
(fp32-accurate, `EXACT_FP32`) else. Three dots keep fp32 operands whatever the inputs, as fla does, because dg cancels heavily
in their sums: the in-chunk scores across sub-chunks, the in-chunk dq/dk, and A^T do in dv.

One decay per head (g [B, H, T, 1]: RetNet, the key gate, Performer's stabilizer) is read once per
token (channel stride 0), and its in-chunk scores are one masked dot per chunk, forward and backward.

Launches: fixed tiles (BK = BV = 64 at most; Triton's default warps and stages, 2 warps for the
kernels on 16-row blocks), the configuration checked on an H200; LINEARIZE_AUTOTUNE=1 autotunes BK/BV
and num_warps on CUDA instead (unverified on a GPU: on an H200 its tuning stopped with an illegal memory
access, docs/gpu.md).
Under TRITON_INTERPRET=1 everything runs on CPU tensors. Every launch runs under the inputs' device
guard, so a layer on cuda:1 works while cuda:0 is current. States (per-chunk and final) are fp32 or,
on request, bf16 (`state_dtype`); every sum accumulates in fp32.

The scans over chunks (the states forward, their gradients backward) run in segments: every segment
from a zero state in parallel, then a short carry of the true state across segments, then a pass adding
it into the states inside them (decays are diagonal, so each is a [K] vector scaling): a chain of about
2 sqrt(N) steps instead of N, which is what bounds the kernel's time when there are few heads.

The log-decay gradient needs no sequence-long cumulative sum: dg_t is the sum over r >= t within
the chunk of dL/dgc_r, and per key channel dL/dgc_r = sum_group q_r dq_r - k_r dk_r, plus, at the
chunk's last token, the state leaving it: rowsum(h_{n+1} * dh_{n+1}).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import os
from collections.abc import Callable

import torch

try:  # in a try block, which transformers' remote-code import check skips: exported models must load
    # without triton (ops.py and feature_maps.py catch the ImportError and use PyTorch)
    import triton
    import triton.language as tl
except ImportError:
    raise

SUB_CHUNK = 16
DIAG_SPAN = 60.0  # the widest decay (log-decay summed over a diagonal block's rows, per key channel) whose block is
# one dot (module docstring): its key factor reaches exp(60) ~ 1e26, leaving fp32 room for keys up to ~1e12


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host: triton.cdiv is a constexpr function whose every call costs microseconds."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= n, on the host (see `_cdiv`)."""
    return 1 << max(n - 1, 0).bit_length()


def _interpreting() -> bool:
    """Triton's own switch: kernels decorated while it is on run in the interpreter (no autotuning there)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _fixed_tiles() -> bool:
    """Launch fixed tiles unless LINEARIZE_AUTOTUNE=1 was set before the kernels were imported, and always
    under the interpreter (no driver to time with). Fixed tiles compile once per shape; the autotuner
    compiles every config, and on an H200 one of its configs crashed (docs/gpu.md)."""
    value = os.environ.get("LINEARIZE_AUTOTUNE", "0").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"LINEARIZE_AUTOTUNE={value!r}: set it to 1 (autotune) or 0 (fixed tiles, the default)")
    return _interpreting() or value != "1"


TILES = (32, 64, 128)  # the BK / BV tiles the autotuner tries (LINEARIZE_AUTOTUNE=1)
WARPS = (4, 8)  # with the tiles: every config costs a compile, about a second each on a GPU host
STAGES = 2


def _tuned(
    kernel,
    key: list[str],
    tiles: tuple[str, ...] = (),
    prune: Callable | None = None,
    stages: tuple[int, ...] = (STAGES,),
):
    """Autotune num_warps and the named tiles (BK, BV) where `_fixed_tiles` says so; else the kernel itself,
    launched with fixed tiles (`_launch`).
    Tuned kernels only store their outputs, never read them, so the timing reruns are harmless.
    `prune` replaces `_fitting_tiles` as the filter of the configs to try (a kernel with its own limits), and
    `stages` the pipeline depths tried (a kernel that may fit only 1 stage deep).
    Where Triton can, the choice is cached on disk beside the compiled kernels: a machine tunes a shape once.
    """
    if _fixed_tiles():
        return kernel
    sizes = [dict(zip(tiles, combo)) for combo in itertools.product(TILES, repeat=len(tiles))]
    configs = [triton.Config(size, num_warps=w, num_stages=n) for size in sizes for w in WARPS for n in stages]
    options = {"prune_configs_by": {"early_config_prune": prune or _fitting_tiles}}
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True
    return triton.autotune(configs=configs, key=key, **options)(kernel)


def _fitting_tiles(configs: list, named_args: dict, **kwargs) -> list:
    """Drop tiles wider than their head dimension rounded up to a power of two (at least the smallest tile):
    they only add masked work, and every config left costs a compile and a timing run."""
    dims = {**named_args, **kwargs}
    spans = {"BK": "K", "BV": "V"}  # the dimension each tile covers

    def fits(config) -> bool:
        return all(
            size <= max(TILES[0], _pow2(dims[spans[tile]]))
            for tile, size in config.kwargs.items()
            if tile in spans
        )

    return [c for c in configs if fits(c)] or configs[:1]


@triton.jit
def _masked_exp(x, mask):
    """exp(x) where mask holds, exactly 0 elsewhere (never exp of a masked-out, possibly huge, value)."""
    return tl.exp(tl.where(mask, x, float("-inf")))


@triton.jit
def _and_scalar(mask, cond):
    """mask & cond for a scalar cond, spelled as a where: the interpreter rejects tensor & scalar masks."""
    return tl.where(cond, mask, False)


@triton.jit
def _kv_head(bhq, H: tl.constexpr, G: tl.constexpr):
    """The key/value head (batch * H + h) that query head bhq (batch * H * G + h * G + g) reads (GQA)."""
    return (bhq // (H * G)) * H + (bhq % (H * G)) // G


@triton.jit
def _chunk_dot(x, y, x_base, y_base, rows, m_t, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
               DT: tl.constexpr, PREC: tl.constexpr):
    """x_rows . y_rows^T [BT, BT] for one chunk's rows of two [T, D] matrices, over D in blocks of BD."""
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    for i_d in range(tl.cdiv(D, BD)):
        cd = i_d * BD + tl.arange(0, BD)
        m = m_t[:, None] & (cd < D)[None, :]
        b_x = tl.load(x + x_base + rows[:, None] * D + cd[None, :], mask=m, other=0.0)
        b_y = tl.load(y + y_base + rows[:, None] * D + cd[None, :], mask=m, other=0.0)
        acc = tl.dot(b_x.to(DT), tl.trans(b_y.to(DT)), acc, input_precision=PREC)
    return acc


@triton.jit
def _chunk_cumsum_kernel(g, gc, T, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_n * BT + tl.arange(0, BT)
    ck = i_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < T) & (ck[None, :] < K)
    offs = i_bh.to(tl.int64) * T * K + rows[:, None] * K + ck[None, :]
    x = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(gc + offs, tl.cumsum(x, axis=0), mask=mask)


@triton.jit
def _fwd_state_kernel(
    k, v, gc, h0, hbuf, z0, zbuf, dbuf, tbuf, T, N, S,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr, HAS_H0: tl.constexpr, NORM: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    """First pass of the scan over chunks, one segment of S chunks per program: the states h_n (entering chunk
    n; h_N the final one) of the segment's chunks as if it started from zero (segment 0 starts from h0).

    With NORM the first value block does the same for the normalizer z = sum of decayed keys ([K]: zbuf).
    The key blocks of the first value block also store the log-decay since the segment's start per state
    (dbuf) and over the segment (tbuf); `_finish_scan` then makes every state the true one.
    """
    i_kv, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = tl.cdiv(V, BV)
    i_k, i_v = i_kv // NV, i_kv % NV
    bh = i_bh.to(tl.int64)
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k, m_v = ck < K, cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_offs = ck[:, None] * V + cv[None, :]
    h = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    decay = tl.zeros([BK], dtype=tl.float32)
    norm = NORM and i_v == 0
    slots = bh * (N + 1)
    if i_s == 0:
        if HAS_H0:
            h += tl.load(h0 + bh * K * V + kv_offs, mask=m_kv, other=0.0).to(tl.float32)
            if norm:
                z += tl.load(z0 + bh * K + ck, mask=m_k, other=0.0).to(tl.float32)
        tl.store(hbuf + slots * K * V + kv_offs, h.to(hbuf.dtype.element_ty), mask=m_kv)
        if norm:
            tl.store(zbuf + slots * K + ck, z, mask=m_k)
    n0 = i_s * S
    for n in range(n0, tl.minimum(n0 + S, N)):
        rows = n * BT + tl.arange(0, BT)
        m_t = rows < T
        b_k = tl.load(k + bh * T * K + rows[:, None] * K + ck[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_v = tl.load(v + bh * T * V + rows[:, None] * V + cv[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_k = b_k.to(tl.float32)
        if USE_G:
            last = tl.minimum(n * BT + BT, T) - 1
            g_last = tl.load(gc + bh * T * GK + last * GK + ck * GS, mask=m_k, other=0.0)
            b_g = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_t[:, None] & m_k[None, :], other=0.0)
            h *= tl.exp(g_last)[:, None]
            z *= tl.exp(g_last)
            b_k *= tl.exp(g_last[None, :] - b_g)
            decay += g_last
            if i_v == 0:
                tl.store(dbuf + (slots + n + 1) * K + ck, decay, mask=m_k)
        h = tl.dot(tl.trans(b_k.to(DT)), b_v.to(DT), h, input_precision=PREC)
        tl.store(hbuf + (slots + n + 1) * K * V + kv_offs, h.to(hbuf.dtype.element_ty), mask=m_kv)
        if norm:
            z += tl.sum(b_k, axis=0)
            tl.store(zbuf + (slots + n + 1) * K + ck, z, mask=m_k)
    if USE_G and i_v == 0:
        tl.store(tbuf + (bh * tl.num_programs(1) + i_s) * K + ck, decay, mask=m_k)


@triton.jit
def _state_tile(i_kv, bh, N, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Tile i_kv (key blocks outer, value blocks inner) of head bh's states in a [B*H, N + 1, K, V] buffer:
    its key channels, their mask, the tile's mask and its offsets within the first state."""
    NV = tl.cdiv(V, BV)
    ck = (i_kv // NV) * BK + tl.arange(0, BK)
    cv = (i_kv % NV) * BV + tl.arange(0, BV)
    m_k = ck < K
    return ck, m_k, m_k[:, None] & (cv < V)[None, :], bh * (N + 1) * K * V + ck[:, None] * V + cv[None, :]


@triton.jit
def _carry_kernel(
    buf, tbuf, N, S, NS,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, REVERSE: tl.constexpr,
):
    """Second pass of a segmented scan (buf [B*H, N + 1, K, V]): segment by segment, in scan order, the state a
    segment hands on (forward: the one after its last chunk; REVERSE: the one before its first) becomes the
    true one, e^(segment's decay) times the one handed on before it plus the segment's own part."""
    i_kv, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    ck, m_k, m_kv, offs = _state_tile(i_kv, bh, N, K, V, BK, BV)
    if REVERSE:
        first = (NS - 1) * S
    else:
        first = tl.minimum(S, N)
    c = tl.load(buf + offs + first * K * V, mask=m_kv, other=0.0).to(tl.float32)
    for i in range(1, NS):
        if REVERSE:
            s = NS - 1 - i
            slot = s * S
        else:
            s = i
            slot = tl.minimum(s * S + S, N)
        if USE_G:
            c *= tl.exp(tl.load(tbuf + (bh * NS + s) * K + ck, mask=m_k, other=0.0))[:, None]
        c += tl.load(buf + offs + slot * K * V, mask=m_kv, other=0.0).to(tl.float32)
        tl.store(buf + offs + slot * K * V, c.to(buf.dtype.element_ty), mask=m_kv)


@triton.jit
def _fixup_kernel(
    buf, dbuf, N, S, NS,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, REVERSE: tl.constexpr,
):
    """Third pass of a segmented scan: a state inside a segment adds the true state at the segment's start (in
    scan order) times e^(log-decay between the two, dbuf)."""
    i_kv, n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = n // S
    if REVERSE:
        edge = s == NS - 1
        anchor = s * S + S
    else:
        edge = s == 0
        anchor = s * S
    if (n % S == 0) | (n == N) | edge:
        return
    bh = i_bh.to(tl.int64)
    ck, m_k, m_kv, offs = _state_tile(i_kv, bh, N, K, V, BK, BV)
    x = tl.load(buf + offs + anchor * K * V, mask=m_kv, other=0.0).to(tl.float32)
    if USE_G:
        x *= tl.exp(tl.load(dbuf + (bh * (N + 1) + n) * K + ck, mask=m_k, other=0.0))[:, None]
    x += tl.load(buf + offs + n * K * V, mask=m_kv, other=0.0).to(tl.float32)
    tl.store(buf + offs + n * K * V, x.to(buf.dtype.element_ty), mask=m_kv)


@triton.jit
def _intra_scores_kernel(
    q, k, gc, A, scale, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, NC: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
    PREC32: tl.constexpr, SPAN: tl.constexpr,
):
    """One BC x BC block on or below the diagonal of the in-chunk score matrix A[i, j] = scale q_i.(k_j exp(gc_i
    - gc_j)), the NC (NC + 1) / 2 of them numbered row by row; a diagonal block also zeroes the rest of its rows.
    A diagonal block whose decay spans at most SPAN over its rows (per key tile) is one masked dot through its
    first row, in fp32-accurate precision; a wider span runs pair by pair (module docstring)."""
    i_n, i_c, i_bhq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_i = i_c * 0
    for r in tl.static_range(1, NC):
        i_i += (i_c >= r * (r + 1) // 2).to(i_i.dtype)
    i_j = i_c - i_i * (i_i + 1) // 2
    bhq = i_bhq.to(tl.int64)
    bh = _kv_head(bhq, H, G)
    row0 = i_n * BT + i_i * BC
    col0 = i_n * BT + i_j * BC
    if row0 >= T:
        return
    loc = tl.arange(0, BC)
    rows, cols = row0 + loc, col0 + loc
    m_r, m_c = rows < T, cols < T
    acc = tl.zeros([BC, BC], dtype=tl.float32)
    if i_i > i_j:
        for i_k in range(tl.cdiv(K, BK)):
            ck = i_k * BK + tl.arange(0, BK)
            m_k = ck < K
            b_q = tl.load(q + bhq * T * K + rows[:, None] * K + ck[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
            b_k = tl.load(k + bh * T * K + cols[:, None] * K + ck[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)
            b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
            if USE_G:
                g_ref = tl.load(gc + bh * T * GK + row0 * GK + ck * GS, mask=m_k, other=0.0)
                g_q = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_r[:, None] & m_k[None, :], other=0.0)
                g_k = tl.load(gc + bh * T * GK + cols[:, None] * GK + ck[None, :] * GS, mask=m_c[:, None] & m_k[None, :], other=0.0)
                b_q *= _masked_exp(g_q - g_ref[None, :], m_r[:, None])
                b_k *= tl.exp(g_ref[None, :] - g_k)
            acc = tl.dot(b_q, tl.trans(b_k), acc, input_precision=PREC32)
    else:
        causal = (loc[:, None] >= loc[None, :]) & m_r[:, None]
        for i_k in range(tl.cdiv(K, BK)):
            ck = i_k * BK + tl.arange(0, BK)
            m_k = ck < K
            m_rk = m_r[:, None] & m_k[None, :]
            b_q = tl.load(q + bhq * T * K + rows[:, None] * K + ck[None, :], mask=m_rk, other=0.0)
            b_q = b_q.to(tl.float32)
            b_k = tl.load(k + bh * T * K + rows[:, None] * K + ck[None, :], mask=m_rk, other=0.0).to(tl.float32)
            if USE_G:
                g_q = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_rk, other=0.0)
                g_first = tl.load(gc + bh * T * GK + row0 * GK + ck * GS, mask=m_k, other=0.0)
                g_last = tl.load(gc + bh * T * GK + (tl.minimum(row0 + BC, T) - 1) * GK + ck * GS, mask=m_k, other=0.0)
                if tl.max(g_first - g_last, axis=0) <= SPAN:  # narrow: through the first row (module docstring)
                    b_q *= _masked_exp(g_q - g_first[None, :], m_r[:, None])
                    b_k *= _masked_exp(g_first[None, :] - g_q, m_r[:, None])
                    acc += tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=EXACT_FP32_DOT), 0.0)
                else:
                    for c in range(BC):
                        key = col0 + c
                        b_kr = tl.load(k + bh * T * K + key * K + ck, mask=_and_scalar(m_k, key < T), other=0.0).to(tl.float32)
                        g_kr = tl.load(gc + bh * T * GK + key * GK + ck * GS, mask=_and_scalar(m_k, key < T), other=0.0)
                        w = _masked_exp(g_q - g_kr[None, :], ((loc >= c) & m_r)[:, None])
                        s = tl.sum(b_q * b_kr[None, :] * w, axis=1)
                        acc += tl.where(loc[None, :] == c, s[:, None], 0.0)
            else:
                acc += tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=EXACT_FP32_DOT), 0.0)
        later = tl.arange(0, BT)
        zeros = tl.zeros([BC, BT], dtype=tl.float32)
        tl.store(A + bhq * T * BT + rows[:, None] * BT + later[None, :], zeros, mask=m_r[:, None] & (later >= row0 - i_n * BT + BC)[None, :])
    tl.store(A + bhq * T * BT + rows[:, None] * BT + (i_j * BC + loc)[None, :], acc * scale, mask=m_r[:, None])


@triton.jit
def _fwd_output_kernel(
    q, v, gc, hbuf, zbuf, A, o, scale, T, NH,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr,
    NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """o = scale (q * exp(gc)) @ h_n  +  A @ v, per chunk and value block.

    With NORM, o has V + 1 columns and the first value block writes the normalizer q.z (from z_n
    and the rows of A, which hold the in-chunk part) into the last one.
    """
    i_v, i_n, i_bhq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bhq = i_bhq.to(tl.int64)
    bh = _kv_head(bhq, H, G)
    rows = i_n * BT + tl.arange(0, BT)
    cv = i_v * BV + tl.arange(0, BV)
    m_t, m_v = rows < T, cv < V
    OV = V + 1 if NORM else V  # o's row length
    norm = NORM and i_v == 0
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    den = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        b_q = tl.load(q + bhq * T * K + rows[:, None] * K + ck[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_q = b_q.to(tl.float32)
        if USE_G:
            b_g = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_q *= tl.exp(b_g)
        b_h = tl.load(hbuf + (bh * NH + i_n) * K * V + ck[:, None] * V + cv[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc = tl.dot(b_q.to(DT), b_h.to(DT), acc, input_precision=PREC)
        if norm:
            b_z = tl.load(zbuf + (bh * NH + i_n) * K + ck, mask=m_k, other=0.0)
            den += tl.sum(b_q * b_z[None, :], axis=1)
    acc *= scale
    cols = tl.arange(0, BT)
    b_a = tl.load(A + bhq * T * BT + rows[:, None] * BT + cols[None, :], mask=m_t[:, None], other=0.0)
    b_v = tl.load(v + bh * T * V + rows[:, None] * V + cv[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    acc = tl.dot(b_a.to(DT), b_v.to(DT), acc, input_precision=PREC)
    tl.store(o + bhq * T * OV + rows[:, None] * OV + cv[None, :], acc.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    if norm:
        den = den * scale + tl.sum(b_a, axis=1)
        tl.store(o + bhq * T * OV + rows * OV + V, den.to(o.dtype.element_ty), mask=m_t)


@triton.jit
def _bwd_dstate_kernel(
    q, do, dden, gc, dht, dhbuf, dzt, dzbuf, dbuf, tbuf, scale, T, N, S,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr,
    HAS_DHT: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """First pass of the reverse scan, one segment of S chunks per program, from its last chunk back:
    dhbuf[n] = dL/dh_n as if the gradient entering the segment from the right were zero (the last segment
    starts from dht, stored at dhbuf[N]); dbuf/tbuf as in `_fwd_state_kernel`, the decay counted back to
    the segment's end. With NORM the first value block does the same for the normalizer (dzbuf) from dden."""
    i_kv, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = tl.cdiv(V, BV)
    i_k, i_v = i_kv // NV, i_kv % NV
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k, m_v = ck < K, cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_offs = ck[:, None] * V + cv[None, :]
    dh = tl.zeros([BK, BV], dtype=tl.float32)
    dz = tl.zeros([BK], dtype=tl.float32)
    decay = tl.zeros([BK], dtype=tl.float32)
    norm = NORM and i_v == 0
    slots = bh * (N + 1)
    if i_s == tl.num_programs(1) - 1:
        if HAS_DHT:
            dh += tl.load(dht + bh * K * V + kv_offs, mask=m_kv, other=0.0).to(tl.float32)
            if norm:
                dz += tl.load(dzt + bh * K + ck, mask=m_k, other=0.0).to(tl.float32)
        tl.store(dhbuf + (slots + N) * K * V + kv_offs, dh, mask=m_kv)
        if norm:
            tl.store(dzbuf + (slots + N) * K + ck, dz, mask=m_k)
    n0 = i_s * S
    n1 = tl.minimum(n0 + S, N)
    for i in range(n1 - n0):
        n = n1 - 1 - i
        rows = n * BT + tl.arange(0, BT)
        m_t = rows < T
        if USE_G:
            last = tl.minimum(n * BT + BT, T) - 1
            g_last = tl.load(gc + bh * T * GK + last * GK + ck * GS, mask=m_k, other=0.0)
            b_g = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_t[:, None] & m_k[None, :], other=0.0)
            dh *= tl.exp(g_last)[:, None]
            dz *= tl.exp(g_last)
            decay += g_last
            if i_v == 0:
                tl.store(dbuf + (slots + n) * K + ck, decay, mask=m_k)
        for i_g in range(G):
            hq = b * H * G + h * G + i_g
            b_q = tl.load(q + hq * T * K + rows[:, None] * K + ck[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_q = b_q.to(tl.float32) * scale
            if USE_G:
                b_q *= tl.exp(b_g)
            b_do = tl.load(do + hq * T * V + rows[:, None] * V + cv[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
            dh = tl.dot(tl.trans(b_q.to(DT)), b_do.to(DT), dh, input_precision=PREC)
            if norm:
                dz += tl.sum(b_q * tl.load(dden + hq * T + rows, mask=m_t, other=0.0)[:, None], axis=0)
        tl.store(dhbuf + (slots + n) * K * V + kv_offs, dh, mask=m_kv)
        if norm:
            tl.store(dzbuf + (slots + n) * K + ck, dz, mask=m_k)
    if USE_G and i_v == 0:
        tl.store(tbuf + (bh * tl.num_programs(1) + i_s) * K + ck, decay, mask=m_k)


@triton.jit
def _bwd_dscores_kernel(
    do, v, dden, dA, T,
    H: tl.constexpr, G: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """dA[i, j] = do_i . v_j (+ dden_i, the normalizer's share) on the causal part of each chunk."""
    i_n, i_bhq = tl.program_id(0), tl.program_id(1)
    bhq = i_bhq.to(tl.int64)
    bh = _kv_head(bhq, H, G)
    loc = tl.arange(0, BT)
    rows = i_n * BT + loc
    m_t = rows < T
    acc = _chunk_dot(do, v, bhq * T * V, bh * T * V, rows, m_t, V, BT, BV, DT, PREC)
    if NORM:
        acc += tl.load(dden + bhq * T + rows, mask=m_t, other=0.0)[:, None]
    acc = tl.where(loc[:, None] >= loc[None, :], acc, 0.0)
    tl.store(dA + bhq * T * BT + rows[:, None] * BT + loc[None, :], acc, mask=m_t[:, None])


@triton.jit
def _bwd_dv_kernel(
    k, gc, A, do, dhbuf, dv, T, N,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
    PREC32: tl.constexpr,
):
    """dv = (k * exp(gc_last - gc)) @ dh_{n+1}  +  sum over the query group of A^T @ do."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    loc = tl.arange(0, BT)
    rows = i_n * BT + loc
    cv = i_v * BV + tl.arange(0, BV)
    m_t, m_v = rows < T, cv < V
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        b_k = tl.load(k + bh * T * K + rows[:, None] * K + ck[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = b_k.to(tl.float32)
        if USE_G:
            last = tl.minimum(i_n * BT + BT, T) - 1
            g_last = tl.load(gc + bh * T * GK + last * GK + ck * GS, mask=m_k, other=0.0)
            b_g = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_k *= tl.exp(g_last[None, :] - b_g)
        b_dh = tl.load(dhbuf + (bh * (N + 1) + i_n + 1) * K * V + ck[:, None] * V + cv[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc = tl.dot(b_k.to(DT), b_dh.to(DT), acc, input_precision=PREC)
    for i_g in range(G):
        hq = b * H * G + h * G + i_g
        b_a = tl.load(A + hq * T * BT + rows[:, None] * BT + loc[None, :], mask=m_t[:, None], other=0.0)
        b_do = tl.load(do + hq * T * V + rows[:, None] * V + cv[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        acc = tl.dot(tl.trans(b_a), b_do.to(tl.float32), acc, input_precision=PREC32)
    tl.store(dv + bh * T * V + rows[:, None] * V + cv[None, :], acc.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _diagonal_dot(dA, x, abase, xbase, rows, diagonal, ck, m_rk, causal, w, acc, BT: tl.constexpr, K: tl.constexpr,
                  TRANSPOSE: tl.constexpr):
    """acc + dA's diagonal block (its transpose with TRANSPOSE) @ (x's block rows * w), fp32-accurate: a diagonal
    block's part of dq (of dk) through its first row, loaded here so that nothing of it stays live elsewhere."""
    b_da = tl.load(dA + abase + rows[:, None] * BT + diagonal[None, :], mask=causal, other=0.0)
    b_x = tl.load(x + xbase + rows[:, None] * K + ck[None, :], mask=m_rk, other=0.0).to(tl.float32) * w
    if TRANSPOSE:
        b_da = tl.trans(b_da)
    return tl.dot(b_da, b_x, acc, input_precision=EXACT_FP32_DOT)


@triton.jit
def _bwd_intra_kernel(
    q, k, gc, dA, dqi, dki, scale, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, NC: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
    PREC32: tl.constexpr, SPAN: tl.constexpr,
):
    """In-chunk parts of dq (per query head) and dk (summed over the group) for one 16-row sub-chunk; its
    diagonal block as a dot through the first row where the decay spans at most SPAN, as in the forward."""
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_i = i_c // NC, i_c % NC
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    row0 = i_n * BT + i_i * BC
    if row0 >= T:
        return
    loc = tl.arange(0, BC)
    rows = row0 + loc
    m_r = rows < T
    ck = i_k * BK + tl.arange(0, BK)
    m_k = ck < K
    m_rk = m_r[:, None] & m_k[None, :]
    kbase = bh * T * K
    causal = (loc[:, None] >= loc[None, :]) & m_r[:, None]
    if USE_G:
        g_i = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_rk, other=0.0)
        g_first = tl.load(gc + bh * T * GK + row0 * GK + ck * GS, mask=m_k, other=0.0)
        g_lastrow = tl.load(gc + bh * T * GK + (tl.minimum(row0 + BC, T) - 1) * GK + ck * GS, mask=m_k, other=0.0)
        narrow = tl.max(g_first - g_lastrow, axis=0) <= SPAN  # the diagonal block through its first row
    dk = tl.zeros([BC, BK], dtype=tl.float32)  # narrow: the diagonal's part still lacks exp(gc_first - gc_j)
    dk_later = tl.zeros([BC, BK], dtype=tl.float32)
    for i_g in range(G):
        hq = b * H * G + h * G + i_g
        abase = hq * T * BT
        qbase = hq * T * K
        # dq from earlier key sub-chunks, all rows valid, through the sub-chunk's first row.
        dq = tl.zeros([BC, BK], dtype=tl.float32)
        for j in range(0, i_i):
            krows = i_n * BT + j * BC + loc
            b_k = tl.load(k + kbase + krows[:, None] * K + ck[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
            if USE_G:
                g_k = tl.load(gc + bh * T * GK + krows[:, None] * GK + ck[None, :] * GS, mask=m_k[None, :], other=0.0)
                b_k *= tl.exp(g_first[None, :] - g_k)
            b_da = tl.load(dA + abase + rows[:, None] * BT + (j * BC + loc)[None, :], mask=m_r[:, None], other=0.0)
            dq = tl.dot(b_da, b_k, dq, input_precision=PREC32)
        # dq from the diagonal block: through the same first row, or pair by pair.
        diagonal = i_i * BC + loc
        if USE_G:
            if narrow:
                k_w = _masked_exp(g_first[None, :] - g_i, m_r[:, None])
                dq = _diagonal_dot(dA, k, abase, kbase, rows, diagonal, ck, m_rk, causal, k_w, dq, BT, K, False)
                dq *= _masked_exp(g_i - g_first[None, :], m_r[:, None])
            else:
                dq *= _masked_exp(g_i - g_first[None, :], m_r[:, None])
                for c in range(BC):
                    key = row0 + c
                    m_key = key < T
                    b_dac = tl.load(dA + abase + rows * BT + i_i * BC + c, mask=m_r, other=0.0)
                    b_kr = tl.load(k + kbase + key * K + ck, mask=_and_scalar(m_k, m_key), other=0.0).to(tl.float32)
                    g_kr = tl.load(gc + bh * T * GK + key * GK + ck * GS, mask=_and_scalar(m_k, m_key), other=0.0)
                    dq += b_dac[:, None] * b_kr[None, :] * _masked_exp(g_i - g_kr[None, :], ((loc >= c) & m_r)[:, None])
        else:
            dq = _diagonal_dot(dA, k, abase, kbase, rows, diagonal, ck, m_rk, causal, 1.0, dq, BT, K, False)
        tl.store(dqi + qbase + rows[:, None] * K + ck[None, :], dq * scale, mask=m_rk)
        # dk from later query sub-chunks, through this sub-chunk's last row.
        for j in range(i_i + 1, NC):
            qrows = i_n * BT + j * BC + loc
            m_q = qrows < T
            b_q = tl.load(q + qbase + qrows[:, None] * K + ck[None, :], mask=m_q[:, None] & m_k[None, :], other=0.0)
            b_q = b_q.to(tl.float32)
            if USE_G:
                g_q = tl.load(gc + bh * T * GK + qrows[:, None] * GK + ck[None, :] * GS, mask=m_q[:, None] & m_k[None, :], other=0.0)
                b_q *= _masked_exp(g_q - g_lastrow[None, :], m_q[:, None])
            b_da = tl.load(dA + abase + qrows[:, None] * BT + (i_i * BC + loc)[None, :], mask=m_q[:, None], other=0.0)
            dk_later = tl.dot(tl.trans(b_da), b_q, dk_later, input_precision=PREC32)
        # dk from the diagonal block: through its first row (scaled back after the group), or pair by pair.
        if USE_G:
            if narrow:
                q_w = _masked_exp(g_i - g_first[None, :], m_r[:, None])
                dk = _diagonal_dot(dA, q, abase, qbase, rows, diagonal, ck, m_rk, causal, q_w, dk, BT, K, True)
            else:
                for c in range(BC):
                    qrow = row0 + c
                    m_q = qrow < T
                    b_dar = tl.load(dA + abase + qrow * BT + i_i * BC + loc, mask=_and_scalar(loc < BC, m_q), other=0.0)
                    b_qr = tl.load(q + qbase + qrow * K + ck, mask=_and_scalar(m_k, m_q), other=0.0).to(tl.float32)
                    g_qr = tl.load(gc + bh * T * GK + qrow * GK + ck * GS, mask=_and_scalar(m_k, m_q), other=0.0)
                    dk += b_dar[:, None] * b_qr[None, :] * _masked_exp(g_qr[None, :] - g_i, _and_scalar(loc <= c, m_q)[:, None])
        else:
            dk = _diagonal_dot(dA, q, abase, qbase, rows, diagonal, ck, m_rk, causal, 1.0, dk, BT, K, True)
    if USE_G:
        dk_later *= _masked_exp(g_lastrow[None, :] - g_i, m_r[:, None])
        if narrow:
            dk *= _masked_exp(g_first[None, :] - g_i, m_r[:, None])
    tl.store(dki + kbase + rows[:, None] * K + ck[None, :], (dk + dk_later) * scale, mask=m_rk)


@triton.jit
def _bwd_inter_kernel(
    q, k, v, gc, hbuf, zbuf, do, dden, dhbuf, dzbuf, dqi, dki, dq, dk, dg, scale, T, N,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr,
    NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Adds the state paths (the normalizer's too, with NORM) to dq and dk, and forms dg (see the module docstring)."""
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    rows = i_n * BT + tl.arange(0, BT)
    ck = i_k * BK + tl.arange(0, BK)
    m_t, m_k = rows < T, ck < K
    m_tk = m_t[:, None] & m_k[None, :]
    tk_offs = rows[:, None] * K + ck[None, :]
    b_k = tl.load(k + bh * T * K + tk_offs, mask=m_tk, other=0.0).to(tl.float32)
    if USE_G:
        b_g = tl.load(gc + bh * T * GK + rows[:, None] * GK + ck[None, :] * GS, mask=m_tk, other=0.0)
        g_last = tl.load(gc + bh * T * GK + (tl.minimum(i_n * BT + BT, T) - 1) * GK + ck * GS, mask=m_k, other=0.0)
    dk_state = tl.zeros([BT, BK], dtype=tl.float32)
    h_dh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        m_kv = m_k[:, None] & m_v[None, :]
        kv_offs = ck[:, None] * V + cv[None, :]
        b_v = tl.load(v + bh * T * V + rows[:, None] * V + cv[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_dh = tl.load(dhbuf + (bh * (N + 1) + i_n + 1) * K * V + kv_offs, mask=m_kv, other=0.0)
        dk_state = tl.dot(b_v.to(DT), tl.trans(b_dh.to(DT)), dk_state, input_precision=PREC)
        if USE_G:
            b_hn = tl.load(hbuf + (bh * (N + 1) + i_n + 1) * K * V + kv_offs, mask=m_kv, other=0.0).to(tl.float32)
            h_dh += tl.sum(b_hn * b_dh, axis=1)
    if NORM:
        b_dz = tl.load(dzbuf + (bh * (N + 1) + i_n + 1) * K + ck, mask=m_k, other=0.0)
        dk_state += b_dz[None, :]
        if USE_G:
            h_dh += tl.load(zbuf + (bh * (N + 1) + i_n + 1) * K + ck, mask=m_k, other=0.0) * b_dz
        b_z = tl.load(zbuf + (bh * (N + 1) + i_n) * K + ck, mask=m_k, other=0.0)
    if USE_G:
        dk_state *= tl.exp(g_last[None, :] - b_g)
    b_dk = dk_state + tl.load(dki + bh * T * K + tk_offs, mask=m_tk, other=0.0)
    tl.store(dk + bh * T * K + tk_offs, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    q_dq = tl.zeros([BT, BK], dtype=tl.float32)
    for i_g in range(G):
        hq = b * H * G + h * G + i_g
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            cv = i_v * BV + tl.arange(0, BV)
            m_v = cv < V
            b_do = tl.load(do + hq * T * V + rows[:, None] * V + cv[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
            b_h = tl.load(hbuf + (bh * (N + 1) + i_n) * K * V + ck[:, None] * V + cv[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
            b_dq = tl.dot(b_do.to(DT), tl.trans(b_h.to(DT)), b_dq, input_precision=PREC)
        if NORM:
            b_dq += tl.load(dden + hq * T + rows, mask=m_t, other=0.0)[:, None] * b_z[None, :]
        b_dq *= scale
        if USE_G:
            b_dq *= tl.exp(b_g)
        b_dq += tl.load(dqi + hq * T * K + tk_offs, mask=m_tk, other=0.0)
        tl.store(dq + hq * T * K + tk_offs, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        if USE_G:
            q_dq += tl.load(q + hq * T * K + tk_offs, mask=m_tk, other=0.0).to(tl.float32) * b_dq
    if USE_G:
        x = q_dq - b_k * b_dk
        suffix = tl.sum(x, axis=0)[None, :] - tl.cumsum(x, axis=0) + x
        tl.store(dg + bh * T * K + tk_offs, h_dh[None, :] + suffix, mask=m_tk)


@triton.jit
def _fused_recurrent_kernel(
    q, k, v, g, h0, o, ht, scale, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_H0: tl.constexpr, GK: tl.constexpr, GS: tl.constexpr, NORM: tl.constexpr,
    SV: tl.constexpr,
):
    """Token-by-token update of one value block of one key/value head's state; ht may alias h0.

    States and outputs have rows of SV = V (+ 1 with NORM: the first value block then also carries the
    normalizer z [K] in the state's last column, and writes q.z into the output's last column).
    """
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k, m_v = ck < K, cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_offs = ck[:, None] * SV + cv[None, :]
    norm = NORM and i_v == 0
    state = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    if HAS_H0:
        state += tl.load(h0 + bh * K * SV + kv_offs, mask=m_kv, other=0.0).to(tl.float32)
        if norm:
            z += tl.load(h0 + bh * K * SV + ck * SV + V, mask=m_k, other=0.0).to(tl.float32)
    for t in range(T):
        b_k = tl.load(k + (bh * T + t) * K + ck, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (bh * T + t) * V + cv, mask=m_v, other=0.0).to(tl.float32)
        if USE_G:
            b_g = tl.load(g + (bh * T + t) * GK + ck * GS, mask=m_k, other=0.0).to(tl.float32)
            state *= tl.exp(b_g)[:, None]
            z *= tl.exp(b_g)
        state += b_k[:, None] * b_v[None, :]
        z += b_k
        for i_g in range(G):
            hq = b * H * G + h * G + i_g
            b_q = tl.load(q + (hq * T + t) * K + ck, mask=m_k, other=0.0).to(tl.float32) * scale
            b_o = tl.sum(b_q[:, None] * state, axis=0)
            tl.store(o + (hq * T + t) * SV + cv, b_o.to(o.dtype.element_ty), mask=m_v)
            if norm:
                tl.store(o + (hq * T + t) * SV + V, tl.sum(b_q * z, axis=0).to(o.dtype.element_ty))
    tl.store(ht + bh * K * SV + kv_offs, state.to(ht.dtype.element_ty), mask=m_kv)
    if norm:
        tl.store(ht + bh * K * SV + ck * SV + V, z.to(ht.dtype.element_ty), mask=m_k)


@triton.jit
def _intra_scores_scalar_kernel(
    q, k, gc, A, scale, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    """One decay per head: a chunk's causal scores in one masked dot, A = scale (q k^T) * exp(gc_i - gc_j)."""
    i_n, i_bhq = tl.program_id(0), tl.program_id(1)
    bhq = i_bhq.to(tl.int64)
    bh = _kv_head(bhq, H, G)
    loc = tl.arange(0, BT)
    rows = i_n * BT + loc
    m_t = rows < T
    acc = _chunk_dot(q, k, bhq * T * K, bh * T * K, rows, m_t, K, BT, BK, DT, PREC)
    b_g = tl.load(gc + bh * T + rows, mask=m_t, other=0.0)
    causal = (loc[:, None] >= loc[None, :]) & m_t[None, :] & m_t[:, None]
    acc *= _masked_exp(b_g[:, None] - b_g[None, :], causal)
    tl.store(A + bhq * T * BT + rows[:, None] * BT + loc[None, :], acc * scale, mask=m_t[:, None])


@triton.jit
def _bwd_intra_scalar_kernel(
    q, k, gc, dA, dqi, dki, scale, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC32: tl.constexpr,
):
    """One decay per head: in-chunk dq = (dA * D) k and dk = sum over the group of (dA * D)^T q, D the masked decay."""
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = i_bh.to(tl.int64)
    b, h = bh // H, bh % H
    loc = tl.arange(0, BT)
    rows = i_n * BT + loc
    m_t = rows < T
    ck = i_k * BK + tl.arange(0, BK)
    m_tk = m_t[:, None] & (ck < K)[None, :]
    b_g = tl.load(gc + bh * T + rows, mask=m_t, other=0.0)
    decay = _masked_exp(b_g[:, None] - b_g[None, :], (loc[:, None] >= loc[None, :]) & m_t[None, :] & m_t[:, None])
    b_k = tl.load(k + bh * T * K + rows[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    for i_g in range(G):
        hq = b * H * G + h * G + i_g
        b_da = tl.load(dA + hq * T * BT + rows[:, None] * BT + loc[None, :], mask=m_t[:, None], other=0.0) * decay
        dq = tl.dot(b_da, b_k, input_precision=PREC32)
        tl.store(dqi + hq * T * K + rows[:, None] * K + ck[None, :], dq * scale, mask=m_tk)
        b_q = tl.load(q + hq * T * K + rows[:, None] * K + ck[None, :], mask=m_tk, other=0.0).to(tl.float32)
        dk = tl.dot(tl.trans(b_da), b_q, dk, input_precision=PREC32)
    tl.store(dki + bh * T * K + rows[:, None] * K + ck[None, :], dk * scale, mask=m_tk)


_fwd_state = _tuned(_fwd_state_kernel, ["BT", "K", "V", "USE_G", "GS"], ("BK", "BV"))
_intra_scores = _tuned(_intra_scores_kernel, ["BT", "K", "USE_G"], ("BK",))
_intra_scores_scalar = _tuned(_intra_scores_scalar_kernel, ["BT", "K"], ("BK",))
_fwd_output = _tuned(_fwd_output_kernel, ["BT", "K", "V", "USE_G", "GS"], ("BK", "BV"))
_bwd_dstate = _tuned(_bwd_dstate_kernel, ["BT", "K", "V", "G", "USE_G", "GS"], ("BK", "BV"))
_bwd_dscores = _tuned(_bwd_dscores_kernel, ["BT", "V", "G"], ("BV",))
_bwd_dv = _tuned(_bwd_dv_kernel, ["BT", "K", "V", "G", "USE_G", "GS"], ("BK", "BV"))
_bwd_intra = _tuned(_bwd_intra_kernel, ["BT", "K", "G", "USE_G"], ("BK",))
_bwd_intra_scalar = _tuned(_bwd_intra_scalar_kernel, ["BT", "K", "G"], ("BK",))
_bwd_inter = _tuned(_bwd_inter_kernel, ["BT", "K", "V", "G", "USE_G", "GS"], ("BK", "BV"))


def _block(dim: int, cap: int = 64) -> int:
    """Power-of-two tile for a head dimension, at least 16 (the smallest tl.dot) and at most `cap`."""
    return min(cap, max(16, _pow2(dim)))


BLOCK_WARPS = 2  # warps per program of the kernels on 16-row blocks (in-chunk scores and their gradients): on an
# H200 2 beat 4 and 1 at T = 16K (docs/gpu.md)


class SharedMemoryError(RuntimeError):
    """No pipeline depth (or value tile, where a launch may narrow it) fits the GPU's shared memory per block."""


_fallbacks: dict[tuple, tuple[int | None, dict[str, int]]] = {}  # per kernel and constants where a GPU refused the
# default launch for its shared memory: the pipeline depth and tiles that fit


def _launch(kernel, grid, *args, tiles: dict[str, int], warps: int | None = None, narrow: bool = False, **meta) -> None:
    """Launch over `grid(tiles)` with fixed tiles and `warps` (Triton's default if None), or the autotuner's choice
    for a kernel `_tuned` wrapped in one (the autotuner itself skips configs a GPU cannot hold; where it can hold
    none, SharedMemoryError as below).

    Fixed tiles pipeline Triton's default 3 stages deep. Where a GPU lacks the shared memory that takes (fp32
    tiles on the 99 KB per block of sm_86 / sm_89 / sm_120: A10, L4, RTX 30-50), Triton refuses the launch and it
    runs again 2, then 1 stage deep. With `narrow` (a kernel whose value blocks are independent programs and
    whose buffers do not depend on BV: the delta rule's whole-K state scans, 128 KB of fp32 operands at K = 256),
    the value tile then halves, down to 16, each width tried from 3 stages again. What fit is kept for that
    kernel and its constants. `python -m linearize.kernels.compile_check` compiles every launch for these GPUs on
    a machine without one.
    """
    if isinstance(kernel, triton.runtime.Autotuner):
        try:
            kernel[grid](*args, **meta)
        except triton.runtime.errors.OutOfResources as err:  # every config was refused: it launched the first anyway
            if err.name != "shared memory":
                raise
            raise _refusal(kernel.base_fn.__name__, meta, err, "in every tuned config") from err
        return
    options = {**meta, **({} if warps is None else {"num_warps": warps})}
    key = _fallback_key(kernel, tiles, options) if _fallbacks else None  # until a refusal no launch pays for it
    depth, fit = _fallbacks.get(key, (None, tiles))
    while True:
        try:
            kernel[grid(fit)](*args, **fit, **options, **({} if depth is None else {"num_stages": depth}))
            return
        except triton.runtime.errors.OutOfResources as err:
            if err.name != "shared memory":
                raise
            if depth != 1:
                depth = 2 if depth is None else 1
            elif narrow and fit["BV"] > 16:
                depth, fit = None, {**fit, "BV": fit["BV"] // 2}
            else:
                raise _refusal(kernel.__name__, {**meta, **fit}, err, "even 1 stage deep") from err
            key = key or _fallback_key(kernel, tiles, options)
            _fallbacks[key] = (depth, fit)


def _fallback_key(kernel, tiles: dict[str, int], options: dict) -> tuple:
    return (kernel, *sorted({**tiles, **options}.items()))


def _refusal(name: str, constants: dict, err: Exception, where: str) -> SharedMemoryError:
    named = ", ".join(f"{k}={v}" for k, v in sorted(constants.items()) if k in ("K", "V", "BT", "BV"))
    return SharedMemoryError(
        f"{name} ({named}) needs {err.required} bytes of shared memory {where}, more than this GPU's {err.limit}: "
        "use narrower heads, bf16 inputs, or LINEARIZE_KERNELS=torch"
    )


def _device_guard(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make x's CUDA device current: Triton launches on the current device, which need not be x's (cuda:1)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _chunk_len(chunk_size: int) -> int:
    """A power of two in [16, 64]: chunk_size only trades speed, never changes the result."""
    return min(64, max(SUB_CHUNK, 1 << (max(chunk_size, 1).bit_length() - 1)))


# fp32 dots where torch allows no tf32: three tf32 products on tensor cores (hi*hi + hi*lo + lo*hi), accurate to
# about fp32's rounding. "ieee" (FMA dots) compiled to 32 registers and 6-12 KB of spills per thread (ptxas 12.9
# and 13.4, sm_80 to sm_90), against at most 0.5 KB with this (`compile_check`).
EXACT_FP32 = "tf32x3"
EXACT_FP32_DOT = tl.constexpr(EXACT_FP32)  # the same, for the kernels (diagonal blocks, whatever the inputs)


def _dot_config(dtype: torch.dtype) -> dict:
    """Matmul operand type and precision for these inputs (see the module docstring).

    The interpreter multiplies bf16 tiles as raw integers, so there bf16 operands go to fp32.
    """
    if dtype == torch.bfloat16 and not _interpreting():
        return {"DT": tl.bfloat16, "PREC": "tf32"}
    tf32 = dtype == torch.float16 or torch.get_float32_matmul_precision() != "highest"
    return {"DT": tl.float32, "PREC": "tf32" if tf32 else EXACT_FP32}


def _kept_precision(dtype: torch.dtype) -> str:
    """Precision of the dots kept in fp32 whatever the inputs (in-chunk scores across sub-chunks, in-chunk
    dq/dk, A^T do): tf32 for half inputs, and for fp32 inputs where torch allows it; EXACT_FP32 otherwise.
    These sums cancel heavily in dg, so fla keeps them out of bf16 too."""
    half = dtype in (torch.bfloat16, torch.float16)
    return "tf32" if half or torch.get_float32_matmul_precision() != "highest" else EXACT_FP32


def _decay_meta(g: torch.Tensor | None) -> dict:
    """USE_G and the decay's row and channel strides: a per-head decay [.., 1] is read for every channel (stride 0)."""
    width = 1 if g is None else g.shape[-1]
    return {"USE_G": g is not None, "GK": width, "GS": int(width > 1)}


def _local_cumsum(g: torch.Tensor, BT: int) -> torch.Tensor:
    """Chunk-local cumulative log-decay in fp32 ([B, H, T, K], or [B, H, T, 1] for one decay per head)."""
    B, H, T, K = g.shape
    gc = torch.empty(B, H, T, K, device=g.device, dtype=torch.float32)
    BK = _block(K)
    _chunk_cumsum_kernel[(_cdiv(K, BK), _cdiv(T, BT), B * H)](g, gc, T, K=K, BT=BT, BK=BK)
    return gc


SCAN_PROGRAMS = 1024  # programs a state scan aims for: an H200 has 132 multiprocessors, each runs several


def _segment_len(chunks: int, programs: int) -> int:
    """Chunks per segment of a state scan that has `programs` programs per segment.

    One program per head and tile walking every chunk in turn is a latency-bound chain when heads are few
    (16 programs for B = 2, 8 heads at K = V = 64). Segments scanned in parallel, then a carry across them
    (`_finish_scan`), cut the chain to about 2 sqrt(chunks) steps for one more pass over the states.
    """
    segments = max(1, min(math.isqrt(chunks), -(-SCAN_PROGRAMS // programs)))
    return -(-chunks // segments)


def _scan_plan(
    x: torch.Tensor, gc: torch.Tensor | None, N: int, tiles: int
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(S, NS, dbuf, tbuf): the segment length and count, the per-state and per-segment log-decay buffers
    (fp32 [B, H, N + 1, K] and [B, H, NS, K]; placeholders without a decay)."""
    B, H, _, K = x.shape
    S = _segment_len(N, B * H * tiles)
    NS = _cdiv(N, S)
    if gc is None:
        return S, NS, x, x
    dbuf = torch.empty(B, H, N + 1, K, device=x.device, dtype=torch.float32)
    tbuf = torch.empty(B, H, NS, K, device=x.device, dtype=torch.float32)
    return S, NS, dbuf, tbuf


def _finish_scan(
    bufs: tuple[torch.Tensor | None, ...], gc: torch.Tensor | None, dbuf: torch.Tensor, tbuf: torch.Tensor,
    S: int, NS: int, reverse: bool,
) -> None:
    """Second and third passes of a segmented scan, in place on each buffer [B, H, N + 1, K(, V)]: carry the
    true state across segments (`_carry_kernel`), then into every state inside them (`_fixup_kernel`)."""
    if NS == 1:
        return
    for buf in bufs:
        if buf is None:
            continue
        B, H, slots, K = buf.shape[:4]
        V = buf.shape[4] if buf.dim() == 5 else 1
        BK, BV = _block(K), _block(V)
        meta = {"K": K, "V": V, "BK": BK, "BV": BV, "USE_G": gc is not None, "REVERSE": reverse}
        tiles = _cdiv(K, BK) * _cdiv(V, BV)
        _carry_kernel[(tiles, B * H)](buf, tbuf, slots - 1, S, NS, **meta)
        _fixup_kernel[(tiles, slots, B * H)](buf, dbuf, slots - 1, S, NS, **meta)


def _states(
    k: torch.Tensor, v: torch.Tensor, gc: torch.Tensor | None, h0: torch.Tensor | None, z0: torch.Tensor | None,
    BT: int, norm: bool, state_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hbuf [B, H, N + 1, K, V]: the state entering every chunk, then the final one; with `norm` the same for
    the normalizer z (zbuf [B, H, N + 1, K], fp32), else None."""
    B, H, T, K = k.shape
    V = v.shape[-1]
    N = _cdiv(T, BT)
    hbuf = torch.empty(B, H, N + 1, K, V, device=k.device, dtype=state_dtype)
    zbuf = torch.empty(B, H, N + 1, K, device=k.device, dtype=torch.float32) if norm else None
    tiles = {"BK": _block(K), "BV": _block(V)}
    S, NS, dbuf, tbuf = _scan_plan(k, gc, N, _cdiv(K, tiles["BK"]) * _cdiv(V, tiles["BV"]))
    _launch(
        _fwd_state, lambda t: (_cdiv(K, t["BK"]) * _cdiv(V, t["BV"]), NS, B * H),
        k, v, k if gc is None else gc, k if h0 is None else h0, hbuf,
        k if z0 is None else z0, hbuf if zbuf is None else zbuf, dbuf, tbuf, T, N, S, tiles=tiles,
        K=K, V=V, BT=BT, HAS_H0=h0 is not None, NORM=norm, **_decay_meta(gc),
        **_dot_config(k.dtype),
    )
    _finish_scan((hbuf, zbuf), gc, dbuf, tbuf, S, NS, reverse=False)
    return hbuf, zbuf


def _scores(q: torch.Tensor, k: torch.Tensor, gc: torch.Tensor | None, scale: float, BT: int) -> torch.Tensor:
    """In-chunk causal scores A [B, HQ, T, BT] (fp32, zero above the diagonal)."""
    B, HQ, T, K = q.shape
    H = k.shape[1]
    A = torch.empty(B, HQ, T, BT, device=q.device, dtype=torch.float32)
    cfg = {"H": H, "G": HQ // H, "K": K, "BT": BT}
    if gc is not None and gc.shape[-1] == 1:
        _launch(_intra_scores_scalar, lambda t: (_cdiv(T, BT), B * HQ), q, k, gc, A, scale, T,
                tiles={"BK": _block(K)}, **cfg, **_dot_config(q.dtype))
        return A
    NC = BT // SUB_CHUNK
    _launch(
        _intra_scores, lambda t: (_cdiv(T, BT), NC * (NC + 1) // 2, B * HQ), q, k, k if gc is None else gc, A, scale, T,
        tiles={"BK": _block(K)}, warps=BLOCK_WARPS, BC=SUB_CHUNK, NC=NC, **cfg, **_decay_meta(gc),
        **_dot_config(q.dtype), PREC32=_kept_precision(q.dtype), SPAN=DIAG_SPAN,
    )
    return A


def _output(
    q: torch.Tensor, v: torch.Tensor, gc: torch.Tensor | None, hbuf: torch.Tensor, zbuf: torch.Tensor | None,
    A: torch.Tensor, scale: float, BT: int,
) -> torch.Tensor:
    """o [B, HQ, T, V], or [B, HQ, T, V + 1] with the normalizer q.z as the last column when zbuf is given."""
    B, HQ, T, K = q.shape
    H, V = v.shape[1], v.shape[-1]
    o = torch.empty(B, HQ, T, V + (zbuf is not None), device=q.device, dtype=q.dtype)
    _launch(
        _fwd_output, lambda t: (_cdiv(V, t["BV"]), _cdiv(T, BT), B * HQ),
        q, v, q if gc is None else gc, hbuf, hbuf if zbuf is None else zbuf, A, o, scale, T, hbuf.shape[2],
        tiles={"BK": _block(K), "BV": _block(V)},
        H=H, G=HQ // H, K=K, V=V, BT=BT, NORM=zbuf is not None, **_decay_meta(gc),
        **_dot_config(q.dtype),
    )
    return o


def _backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc: torch.Tensor | None, A: torch.Tensor,
    h0: torch.Tensor | None, z0: torch.Tensor | None, do: torch.Tensor, dden: torch.Tensor | None,
    dht: torch.Tensor | None, dzt: torch.Tensor | None, scale: float, BT: int, state_dtype: torch.dtype, norm: bool,
) -> tuple[torch.Tensor, ...]:
    """Recomputes the chunk states (the forward keeps the inputs, the local cumulative decay gc and the in-chunk
    scores A, as fla keeps them: the states would cost N + 1 [K, V] blocks per head).

    Returns dq, dk, dv, dg, dh0 and dz0 (the last ones None where there is no initial state or normalizer).
    """
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    G, N = HQ // H, _cdiv(T, BT)
    tiles = {"BK": _block(K), "BV": _block(V)}
    gp = k if gc is None else gc
    cfg = {"H": H, "G": G, "BT": BT, **_dot_config(q.dtype)}
    decay = _decay_meta(gc)
    hbuf, zbuf = _states(k, v, gc, h0, z0, BT, norm=norm, state_dtype=state_dtype)

    dhbuf = torch.empty(B, H, N + 1, K, V, device=q.device, dtype=torch.float32)
    dzbuf = torch.empty(B, H, N + 1, K, device=q.device, dtype=torch.float32) if norm else None
    dden = do if dden is None else dden  # (a placeholder pointer without the normalizer)
    S, NS, dbuf, tbuf = _scan_plan(k, gc, N, _cdiv(K, tiles["BK"]) * _cdiv(V, tiles["BV"]))
    _launch(
        _bwd_dstate, lambda t: (_cdiv(K, t["BK"]) * _cdiv(V, t["BV"]), NS, B * H),
        q, do, dden, gp, k if dht is None else dht, dhbuf, k if dzt is None else dzt,
        dhbuf if dzbuf is None else dzbuf, dbuf, tbuf, scale, T, N, S,
        tiles=tiles, K=K, V=V, HAS_DHT=dht is not None, NORM=norm, **decay, **cfg,
    )
    _finish_scan((dhbuf, dzbuf), gc, dbuf, tbuf, S, NS, reverse=True)
    dh0 = dhbuf[:, :, 0].clone() if h0 is not None else None
    dz0 = dzbuf[:, :, 0].clone() if norm and h0 is not None else None
    dv = torch.empty_like(v)
    _launch(
        _bwd_dv, lambda t: (_cdiv(V, t["BV"]), N, B * H), k, gp, A, do, dhbuf, dv, T, N, tiles=tiles,
        K=K, V=V, **decay, **cfg, PREC32=_kept_precision(q.dtype),
    )
    dq, dk, dg = _score_and_state_grads(q, k, v, gc, hbuf, zbuf, do, dden if norm else None, dhbuf, dzbuf, scale, BT)
    return dq, dk, dv, dg, dh0, dz0


def _score_grads(
    q: torch.Tensor, k: torch.Tensor, gc: torch.Tensor | None, dA: torch.Tensor, scale: float, BT: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) in fp32 through the in-chunk scores A = scale (q_i . k_j e^(gc_i - gc_j)) (`_scores`), given dA
    [B, HQ, T, BT] (zero above the diagonal); dk summed over the query group."""
    B, HQ, T, K = q.shape
    H = k.shape[1]
    G, N, NC = HQ // H, _cdiv(T, BT), BT // SUB_CHUNK
    dqi = torch.empty(B, HQ, T, K, device=q.device, dtype=torch.float32)
    dki = torch.empty(B, H, T, K, device=q.device, dtype=torch.float32)
    if gc is not None and gc.shape[-1] == 1:
        _launch(
            _bwd_intra_scalar, lambda t: (_cdiv(K, t["BK"]), N, B * H), q, k, gc, dA, dqi, dki, scale, T,
            tiles={"BK": _block(K)}, H=H, G=G, K=K, BT=BT, PREC32=_kept_precision(q.dtype),
        )
    else:
        _launch(
            _bwd_intra, lambda t: (_cdiv(K, t["BK"]), N * NC, B * H), q, k, k if gc is None else gc, dA, dqi, dki,
            scale, T, tiles={"BK": _block(K)}, warps=BLOCK_WARPS, H=H, G=G, K=K, BT=BT, BC=SUB_CHUNK, NC=NC,
            **_decay_meta(gc), **_dot_config(q.dtype), PREC32=_kept_precision(q.dtype), SPAN=DIAG_SPAN,
        )
    return dqi, dki


def _score_and_state_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc: torch.Tensor | None, hbuf: torch.Tensor,
    zbuf: torch.Tensor | None, do: torch.Tensor, dden: torch.Tensor | None, dhbuf: torch.Tensor,
    dzbuf: torch.Tensor | None, scale: float, BT: int, dk_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk (in dk_dtype, else k's) and dg through o = scale (q e^gc) h_n + A v and h_{n+1} = e^gc_last h_n
    + (k e^(gc_last - gc))^T v, v held fixed: all of GLA's backward but dv and dh0, and the part of the delta
    rule's that runs on v' for v. hbuf holds the N + 1 states h_n, dhbuf their gradients (dhbuf[n + 1] that
    of the state leaving chunk n); zbuf, dden and dzbuf are the normalizer's (None without). dg is per channel, or [B, H, T, 1]
    for one decay per head."""
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    G, N = HQ // H, _cdiv(T, BT)
    tiles = {"BK": _block(K), "BV": _block(V)}
    gp = k if gc is None else gc
    use_g = gc is not None
    norm = dden is not None
    dden = do if dden is None else dden  # (a placeholder pointer without the normalizer)
    cfg = {"H": H, "G": G, "BT": BT, **_dot_config(q.dtype)}
    decay = _decay_meta(gc)
    dA = torch.empty(B, HQ, T, BT, device=q.device, dtype=torch.float32)
    _launch(_bwd_dscores, lambda t: (N, B * HQ), do, v, dden, dA, T, tiles={"BV": tiles["BV"]}, V=V, NORM=norm, **cfg)
    dqi, dki = _score_grads(q, k, gc, dA, scale, BT)
    dq = torch.empty_like(q)
    dk = torch.empty(k.shape, device=k.device, dtype=dk_dtype or k.dtype)
    dg = torch.empty(B, H, T, K, device=q.device, dtype=torch.float32) if use_g else None
    _launch(
        _bwd_inter, lambda t: (_cdiv(K, t["BK"]), N, B * H),
        q, k, v, gp, hbuf, hbuf if zbuf is None else zbuf, do, dden, dhbuf, dhbuf if dzbuf is None else dzbuf,
        dqi, dki, dq, dk, k if dg is None else dg, scale, T, N, tiles=tiles, K=K, V=V, NORM=norm, **decay, **cfg,
    )
    if dg is not None and gc.shape[-1] == 1:
        dg = dg.sum(-1, keepdim=True)  # one decay per head: the channels' gradients add up
    return dq, dk, dg


def _split_normalizer(x: torch.Tensor | None, norm: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """[..., V + 1] -> ([..., V], [...]) contiguous, when the last column is the normalizer's."""
    if x is None or not norm:
        return None if x is None else x.contiguous(), None
    return x[..., :-1].contiguous(), x[..., -1].contiguous()


class _ChunkGLA(torch.autograd.Function):
    """Chunked GLA with Triton forward and backward; saves the inputs, gc and the in-chunk scores A.

    With `norm`, the normalizer is a [K] vector beside the state: the output gains the column q.z and
    the state (in and out) the column z, the layout `ops.with_normalizer` gives the PyTorch forms.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, BT, state_dtype, norm):
        h0, z0 = _split_normalizer(initial_state, norm)
        gc = None if g is None else _local_cumsum(g, BT)
        hbuf, zbuf = _states(k, v, gc, h0, z0, BT, norm=norm, state_dtype=state_dtype)
        A = _scores(q, k, gc, scale, BT)
        o = _output(q, v, gc, hbuf, zbuf, A, scale, BT)
        ht = hbuf[:, :, -1]
        ctx.save_for_backward(q, k, v, g, gc, A, initial_state)
        ctx.scale, ctx.BT, ctx.state_dtype, ctx.norm = scale, BT, state_dtype, norm
        if zbuf is None:
            return o, ht.clone()  # not a view that would keep every chunk's state alive
        return o, torch.cat([ht, zbuf[:, :, -1].unsqueeze(-1).to(ht.dtype)], dim=-1)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, gc, A, initial_state = ctx.saved_tensors
        norm = ctx.norm
        h0, z0 = _split_normalizer(initial_state, norm)
        do, dden = _split_normalizer(do, norm)
        dht, dzt = _split_normalizer(dht, norm)
        with _device_guard(q):
            dq, dk, dv, dg, dh0, dz0 = _backward(
                q, k, v, gc, A, h0, z0, do, dden, dht, dzt, ctx.scale, ctx.BT, ctx.state_dtype, norm
            )
        dg = None if dg is None else dg.to(g.dtype)
        if dh0 is not None:
            dh0 = (dh0 if dz0 is None else torch.cat([dh0, dz0.unsqueeze(-1)], dim=-1)).to(initial_state.dtype)
        return dq, dk, dv, dg, None, dh0, None, None, None


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, state: torch.Tensor | None, extra: int = 0
) -> None:
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    if HQ % H or k.shape != (B, H, T, K) or v.shape[:3] != (B, H, T):
        raise ValueError(f"GLA shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if g is not None and g.shape not in (k.shape, (B, H, T, 1)):
        raise ValueError(f"g must be {tuple(k.shape)} or {(B, H, T, 1)} (one decay per head), got {tuple(g.shape)}")
    if state is not None and state.shape != (B, H, K, V + extra):
        raise ValueError(f"state must be {(B, H, K, V + extra)}, got {tuple(state.shape)}")


STATE_DTYPES = (torch.float32, torch.bfloat16)


def _check_state_dtype(state_dtype: torch.dtype) -> None:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype={state_dtype} is not supported: use torch.float32 or torch.bfloat16")


def chunk_gla_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    state_dtype: torch.dtype = torch.float32,
    normalizer: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked GLA (differentiable in q, k, v, g and initial_state): (o in q.dtype, final state in state_dtype).

    g may be [B, H, T, K] or one decay per head [B, H, T, 1], which runs its own fast path (one
    masked dot per chunk for the in-chunk scores, the decay read once per token). `state_dtype`
    bf16 stores the per-chunk states and the final state in bf16 (half the memory; the sums stay fp32).
    With `normalizer`, the kernels also carry z = sum of decayed keys as a [K] vector: o gets a last
    column q.z and the state [B, H, K, V + 1] a last column z (initial_state too) — what running
    `with_normalizer(v)` would give, without widening every value tile to V + 1.
    """
    _check(q, k, v, g, initial_state, extra=int(normalizer))
    _check_state_dtype(state_dtype)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if g is None else g.contiguous()
    with _device_guard(q):
        return _ChunkGLA.apply(
            q, k, v, g, float(scale), initial_state, _chunk_len(chunk_size), state_dtype, normalizer
        )


def fused_recurrent_gla_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    inplace: bool = True,
    *,
    state_dtype: torch.dtype = torch.float32,
    normalizer: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoding step(s): (o in q.dtype, final state in state_dtype), one fused kernel over the tokens.

    With `inplace` and a contiguous `initial_state` already in `state_dtype`, that tensor is updated
    and returned, so a cache keeps its buffer (as `gla_torch.gla_recurrent` does on CPU). When
    autograd needs gradients the chunked kernel runs instead (same math, differentiable, never in place).
    `normalizer` as for `chunk_gla_triton`: the [K] normalizer in the state's and the output's last column.
    """
    _check(q, k, v, g, initial_state, extra=int(normalizer))
    _check_state_dtype(state_dtype)
    tracked = (q, k, v, g, initial_state)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tracked):
        return chunk_gla_triton(q, k, v, g, scale, initial_state, state_dtype=state_dtype, normalizer=normalizer)
    B, HQ, T, K = q.shape
    H, V = k.shape[1], v.shape[-1]
    SV = V + int(normalizer)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if g is None else g.contiguous()
    o = torch.empty(B, HQ, T, SV, device=q.device, dtype=q.dtype)
    reuse = inplace and initial_state is not None and initial_state.dtype == state_dtype and initial_state.is_contiguous()
    if reuse:
        ht, h0 = initial_state, initial_state
    else:
        ht = torch.empty(B, H, K, SV, device=q.device, dtype=state_dtype)
        h0 = None if initial_state is None else initial_state.contiguous()
    BK = _pow2(K)
    BV = min(_pow2(V), max(16, 8192 // BK))
    with _device_guard(q):
        _fused_recurrent_kernel[(_cdiv(V, BV), B * H)](
            q, k, v, k if g is None else g, ht if h0 is None else h0, o, ht, float(scale), T,
            H=H, G=HQ // H, K=K, V=V, BK=BK, BV=BV, HAS_H0=h0 is not None, NORM=normalizer,
            SV=SV, **_decay_meta(g),
        )
    return o, ht
