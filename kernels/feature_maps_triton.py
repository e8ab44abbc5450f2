"""Fused Triton feature maps: the same functions as `feature_maps.hedgehog` / `feature_maps.performer`.

Fusing pays where the PyTorch version makes several passes over a [B, H, T, M] tensor:
- Performer: max over features, subtract, exp and scale in one read and one write;
- Hedgehog: the per-head projection, both softmaxes and the concatenation in one kernel, and in the
  backward the softmax Jacobians and dx = dz W^T in one more (dW and the bias gradient are plain
  reductions over tokens, left to torch's matmul).

Caps: a program holds whole rows of features in registers, so a softmax or max over them takes one
pass. Hedgehog takes F <= HEDGEHOG_MAX_FEATURES per half (fp32 tiles of [rows, F], at most 4096
elements: fewer rows as F grows; D is looped over in tiles of 64 and needs no cap), Performer M <=
PERFORMER_MAX_FEATURES (no tile beyond the 8192 elements the small-M case already uses). Wider
maps, float64 and shapes the kernels do not take run in PyTorch: `feature_maps` asks
`hedgehog_fusable` / `performer_fusable` first.

Dtypes: inputs may be fp32, bf16 or fp16, and need not agree (autocast hands bf16 activations to
fp32 parameters). Arithmetic is fp32; Hedgehog's matmuls accumulate in fp32 from operands of
`_dot_config` for the wider of x and weight (bf16 tensor cores only when both are bf16). The output
has the dtype of x (Hedgehog) or of the logits (Performer), as in `feature_maps`' PyTorch path; each
gradient comes back in its own input's dtype (fp32 master weights get fp32 gradients).
"""

from __future__ import annotations

import math

import torch

try:  # in a try block, which transformers' remote-code import check skips: exported models must load
    # without triton (ops.py and feature_maps.py catch the ImportError and use PyTorch)
    import triton
    import triton.language as tl
except ImportError:
    raise

from .gla_triton import _block, _cdiv, _device_guard, _dot_config, _launch, _pow2, _tuned


@triton.jit
def _performer_kernel(
    logits, stab, out, R, scale, M: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, HAS_STAB: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BM)
    m_r, m_c = rows < R, cols < M
    mask = m_r[:, None] & m_c[None, :]
    offs = rows[:, None] * M + cols[None, :]
    x = tl.load(logits + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(m_c[None, :], x, float("-inf"))
    if HAS_STAB:
        ref = tl.load(stab + rows, mask=m_r, other=0.0).to(tl.float32)
    else:
        ref = tl.max(x, axis=1)
    y = tl.exp(x - ref[:, None]) * scale
    tl.store(out + offs, y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_rows(z, m_f):
    z = tl.where(m_f[None, :], z, float("-inf"))
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _hedgehog_logits(x, w, bias, bh, h, rows, m_t, T, D: tl.constexpr, F: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, BF: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """z = x W_h + b_h for a block of rows, accumulated over feature blocks of x."""
    cf = tl.arange(0, BF)
    m_f = cf < F
    z = tl.zeros([BT, BF], dtype=tl.float32)
    for i_d in range(tl.cdiv(D, BD)):
        cd = i_d * BD + tl.arange(0, BD)
        m_d = cd < D
        b_x = tl.load(x + bh * T * D + rows[:, None] * D + cd[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
        b_w = tl.load(w + h * D * F + cd[:, None] * F + cf[None, :], mask=m_d[:, None] & m_f[None, :], other=0.0)
        z = tl.dot(b_x.to(DT), b_w.to(DT), z, input_precision=PREC)
    return z + tl.load(bias + h * F + cf, mask=m_f, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _hedgehog_fwd_kernel(
    x, w, bias, out, T,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    m_t = rows < T
    cf = tl.arange(0, BF)
    m_f = cf < F
    z = _hedgehog_logits(x, w, bias, bh, bh % H, rows, m_t, T, D, F, BT, BD, BF, DT, PREC)
    mask = m_t[:, None] & m_f[None, :]
    offs = bh * T * 2 * F + rows[:, None] * (2 * F) + cf[None, :]
    tl.store(out + offs, _softmax_rows(z, m_f).to(out.dtype.element_ty), mask=mask)
    tl.store(out + offs + F, _softmax_rows(-z, m_f).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _hedgehog_bwd_kernel(
    x, w, bias, dout, dx, dz, T,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    """dz through both softmaxes (recomputed, not stored), then dx = dz W^T."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    h = bh % H
    rows = i_t * BT + tl.arange(0, BT)
    m_t = rows < T
    cf = tl.arange(0, BF)
    m_f = cf < F
    mask = m_t[:, None] & m_f[None, :]
    z = _hedgehog_logits(x, w, bias, bh, h, rows, m_t, T, D, F, BT, BD, BF, DT, PREC)
    p_pos, p_neg = _softmax_rows(z, m_f), _softmax_rows(-z, m_f)
    offs = bh * T * 2 * F + rows[:, None] * (2 * F) + cf[None, :]
    d_pos = tl.load(dout + offs, mask=mask, other=0.0).to(tl.float32)
    d_neg = tl.load(dout + offs + F, mask=mask, other=0.0).to(tl.float32)
    b_dz = p_pos * (d_pos - tl.sum(d_pos * p_pos, axis=1)[:, None])
    b_dz -= p_neg * (d_neg - tl.sum(d_neg * p_neg, axis=1)[:, None])
    tl.store(dz + bh * T * F + rows[:, None] * F + cf[None, :], b_dz, mask=mask)
    for i_d in range(tl.cdiv(D, BD)):
        cd = i_d * BD + tl.arange(0, BD)
        m_d = cd < D
        b_w = tl.load(w + h * D * F + cd[:, None] * F + cf[None, :], mask=m_d[:, None] & m_f[None, :], other=0.0)
        b_dx = tl.dot(b_dz.to(DT), tl.trans(b_w.to(DT)), input_precision=PREC)
        tl.store(dx + bh * T * D + rows[:, None] * D + cd[None, :], b_dx.to(dx.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


_hedgehog_fwd = _tuned(_hedgehog_fwd_kernel, ["BD", "BF"])
_hedgehog_bwd = _tuned(_hedgehog_bwd_kernel, ["BD", "BF"])
HEDGEHOG_MAX_FEATURES = 256
PERFORMER_MAX_FEATURES = 8192  # also the Performer tile, [rows, M] elements: a row always fits
_TILE = 4096  # elements of one [rows, features] Hedgehog tile; the backward keeps about six alive
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _hedgehog_launch(kernel, x: torch.Tensor, weight: torch.Tensor, *tensors: torch.Tensor) -> None:
    B, H, T, D = x.shape
    F = weight.shape[-1]
    BF = _block(F, cap=HEDGEHOG_MAX_FEATURES)
    BT = min(32, _TILE // BF)
    with _device_guard(x):
        _launch(
            kernel, lambda _: (_cdiv(T, BT), B * H), x, weight, *tensors, T, tiles={}, H=H, D=D, F=F, BT=BT,
            BD=_block(D), BF=BF, **_dot_config(torch.promote_types(x.dtype, weight.dtype)),
        )


class _Hedgehog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        B, H, T, _ = x.shape
        out = torch.empty(B, H, T, 2 * weight.shape[-1], device=x.device, dtype=x.dtype)
        _hedgehog_launch(_hedgehog_fwd, x, weight, bias, out)
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        B, H, T, _ = x.shape
        dx = torch.empty_like(x)
        dz = torch.empty(B, H, T, weight.shape[-1], device=x.device, dtype=torch.float32)
        _hedgehog_launch(_hedgehog_bwd, x, weight, bias, dout.contiguous(), dx, dz)
        with torch.autocast(x.device.type, enabled=False):  # a backward run under autocast must not drop dW to bf16
            dweight = torch.einsum("bhtd,bhtf->hdf", x.to(torch.float32), dz)
        return dx, dweight.to(weight.dtype), dz.sum((0, 2)).to(bias.dtype)


def hedgehog_fusable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """The kernel takes F <= HEDGEHOG_MAX_FEATURES, fp32/bf16/fp16, and exactly weight [H, D, F], bias [H, F]."""
    if x.dim() != 4:
        return False
    H, D, F = x.shape[1], x.shape[3], weight.shape[-1]
    return (
        F <= HEDGEHOG_MAX_FEATURES
        and weight.shape == (H, D, F)
        and bias.shape == (H, F)
        and all(t.dtype in _KERNEL_DTYPES for t in (x, weight, bias))
    )


def hedgehog_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Fused `feature_maps.hedgehog`: x [B, H, T, D], weight [H, D, F], bias [H, F] -> [B, H, T, 2F] in x's dtype."""
    if not hedgehog_fusable(x, weight, bias):
        raise ValueError(
            f"hedgehog_triton: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
            f"bias {tuple(bias.shape)} {bias.dtype} are past the kernel (F <= {HEDGEHOG_MAX_FEATURES}); "
            "use feature_maps.hedgehog"
        )
    return _Hedgehog.apply(x.contiguous(), weight.contiguous(), bias.contiguous())


class _Performer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, stabilizer):
        M = logits.shape[-1]
        R = logits.numel() // M
        out = torch.empty_like(logits)
        BM = _pow2(M)
        BR = min(64, PERFORMER_MAX_FEATURES // BM)
        with _device_guard(logits):
            _performer_kernel[(_cdiv(R, BR),)](
                logits, logits if stabilizer is None else stabilizer, out, R, 1.0 / math.sqrt(M),
                M=M, BR=BR, BM=BM, HAS_STAB=stabilizer is not None,
            )
        ctx.save_for_backward(out)
        ctx.stab_dtype = None if stabilizer is None else stabilizer.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        (out,) = ctx.saved_tensors
        dlogits = dout * out
        if ctx.stab_dtype is None:
            return dlogits, None
        return dlogits, -dlogits.sum(-1, dtype=torch.float32).reshape(-1).to(ctx.stab_dtype)


def performer_fusable(logits: torch.Tensor, stabilizer: torch.Tensor | None) -> bool:
    """The kernel takes M <= PERFORMER_MAX_FEATURES, fp32/bf16/fp16, and the per-row max or one stabilizer per row."""
    if logits.shape[-1] > PERFORMER_MAX_FEATURES or logits.dtype not in _KERNEL_DTYPES:
        return False
    if stabilizer is None:
        return True
    return (
        stabilizer.dtype in _KERNEL_DTYPES
        and stabilizer.dim() <= logits.dim()
        and stabilizer.shape[-1:] in (torch.Size([1]), torch.Size([]))
    )


def performer_triton(logits: torch.Tensor, stabilizer: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `feature_maps.performer`: exp(logits - stabilizer) / sqrt(M) in the logits' dtype.

    The stabilizer defaults to the detached row max.
    """
    if not performer_fusable(logits, stabilizer):
        raise ValueError(
            f"performer_triton: logits {tuple(logits.shape)} {logits.dtype} with this stabilizer are past the kernel "
            f"(M <= {PERFORMER_MAX_FEATURES}, one stabilizer per row); use feature_maps.performer"
        )
    logits = logits.contiguous()
    if stabilizer is None:
        return _Performer.apply(logits, None)
    rows = stabilizer.expand(*logits.shape[:-1], 1).reshape(-1).contiguous()
    return _Performer.apply(logits, rows)
