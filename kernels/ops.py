"""The one dispatch point between the model and the kernels.

`gated_linear_attention` (GLA) and `gated_delta_rule` (Gated DeltaNet) run here. Both pick Triton on
CUDA tensors (chunked form and decoding step) and PyTorch everywhere else; `LINEARIZE_KERNELS=triton|torch`
forces either. GLA's normalizer z (the sum of decayed keys) lives in the state's last column on every
backend: the PyTorch forms run on `v` with a column of ones appended, the Triton kernels carry z as a
[K] vector, so the output and its normalizer come from one pass.
"""

from __future__ import annotations

import os

import torch

from .delta_torch import delta_chunked, delta_recurrent
from .gla_torch import as_dtype, gla_chunked, gla_parallel, gla_recurrent

try:
    from .delta_triton import chunk_delta_triton, fused_recurrent_delta_triton
    from .gla_triton import chunk_gla_triton, fused_recurrent_gla_triton

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

MODES = ("chunk", "recurrent", "parallel")
NORMALIZER_EPS = 1e-6


def with_normalizer(v: torch.Tensor) -> torch.Tensor:
    """v with a column of ones appended: run through the kernel, that column of the state is `z`."""
    return torch.nn.functional.pad(v, (0, 1), value=1.0)


def normalize_output(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """The normalized output num / (q^T z), the denominator floored so an all-masked row stays finite."""
    return num / den.clamp_min(NORMALIZER_EPS)


def kernel_backend(device: torch.device) -> str:
    """`triton` or `torch`, from LINEARIZE_KERNELS or else the device (asked by every layer on every step: kept cheap)."""
    forced = (os.environ.get("LINEARIZE_KERNELS") or "").strip().lower()
    if not forced:
        return "triton" if HAS_TRITON and device.type == "cuda" else "torch"
    if forced not in ("triton", "torch"):
        raise ValueError(f"LINEARIZE_KERNELS={forced!r} is not valid: set it to 'triton' or 'torch', or unset it")
    if forced == "triton" and not HAS_TRITON:
        raise RuntimeError("LINEARIZE_KERNELS=triton but triton is not importable: pip install triton, or unset it")
    return forced


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    normalize: bool = False,
    divide: bool = True,
    initial_state: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
    state_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run GLA in the requested form; returns (output [B, HQ, T, V], final state [B, H, K, V(+1)]).

    `state_dtype` bf16 keeps the states in bf16 (the Triton kernels store their per-chunk states so
    too); the sums accumulate in fp32 either way.

    With `normalize`, the state carries one extra value column (the normalizer `z`) and the
    output is divided by `q^T z`; pass that same state back as `initial_state` to continue. With
    `divide` off the output keeps the terms undivided, [num | q^T z], for a caller that mixes in other
    terms first (the softmax window) and then calls `normalize_output`. The PyTorch forms get the
    normalizer as a column of ones on v (`with_normalizer`); the Triton kernels (chunked and step) carry
    it as a [K] vector beside the state, in the same layout.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    backend = kernel_backend(q.device)
    vector_normalizer = backend == "triton" and mode != "parallel"  # the Triton kernels carry z themselves
    if normalize and not vector_normalizer:
        v = with_normalizer(v)
    if mode == "parallel":
        o, state = gla_parallel(q, k, v, g, scale, initial_state)
    elif backend == "triton":
        if mode == "recurrent":
            o, state = fused_recurrent_gla_triton(
                q, k, v, g, scale, initial_state, state_dtype=state_dtype, normalizer=normalize
            )
        else:
            o, state = chunk_gla_triton(
                q, k, v, g, scale, initial_state, chunk_size, state_dtype=state_dtype, normalizer=normalize
            )
    elif mode == "recurrent":
        o, state = gla_recurrent(q, k, v, g, scale, initial_state)
    else:
        o, state = gla_chunked(q, k, v, g, scale, initial_state, chunk_size)
    state = as_dtype(state, state_dtype)
    if normalize and divide:
        o = normalize_output(o[..., :-1], o[..., -1:])
    return o, state


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the gated delta rule; returns (output [B, HQ, T, V], final state [B, H, K, V]).

    "parallel" and "recurrent" both run the step-by-step reference (the delta rule has no masked
    quadratic form); "chunk" the UT-transform form, forward and backward in Triton where the backend
    is triton (`chunk_delta_triton`), else in PyTorch (`delta_chunked`). Decoding steps without
    autograd run the fused Triton step where the backend is triton.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    backend = kernel_backend(q.device)
    if mode == "chunk":
        chunked = chunk_delta_triton if backend == "triton" else delta_chunked
        return chunked(q, k, v, beta, g, scale, initial_state, chunk_size)
    tracked = (q, k, v, beta, g, initial_state)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tracked)
    if mode == "recurrent" and not needs_grad and backend == "triton":
        return fused_recurrent_delta_triton(q, k, v, beta, g, scale, initial_state)
    return delta_recurrent(q, k, v, beta, g, scale, initial_state)
