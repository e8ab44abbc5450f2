"""Feature maps phi(.) for linear attention, in plain PyTorch (the reference for any fused kernel).

Inputs are per-head tensors [B, H, T, D]; per-head parameters have a leading H. `hedgehog` and
`performer` run fused Triton kernels where `ops.kernel_backend` says triton (CUDA, or forced by
LINEARIZE_KERNELS) and the kernel takes the inputs (feature widths up to the caps in
`feature_maps_triton`), PyTorch otherwise.

Dtypes, the same on both paths: a map returns its input's dtype (x for Hedgehog, the logits for
Performer) whatever the dtype of the parameters or stabilizer and whether autocast is on, and each
gradient comes back in its own input's dtype. So bf16 activations with fp32 master weights under
autocast give bf16 features, the dtype of the v they meet, and fp32 weight gradients; the bare
PyTorch expressions would give fp32 there (the fp32 bias promotes, and CUDA autocast runs softmax
and exp in fp32), hence the explicit cast.
"""

from __future__ import annotations

import math

import torch

from .gla_torch import as_dtype, step_bmm
from .ops import kernel_backend

try:
    from .feature_maps_triton import hedgehog_fusable, hedgehog_triton, performer_fusable, performer_triton

    HAS_FUSED = True
except ImportError:
    HAS_FUSED = False


def _fused(x: torch.Tensor) -> bool:
    return HAS_FUSED and kernel_backend(x.device) == "triton"


def per_head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] @ weight [H, D, F] -> [B, H, T, F]: one matmul batched over heads.

    Broadcasting the weight over B would copy it B times, and einsum spends more small ops on the
    same bmm than a decoding step's few rows cost.
    """
    B, H, T, D = x.shape
    return (x.transpose(0, 1).reshape(H, B * T, D) @ weight).view(H, B, T, -1).transpose(0, 1)


def hedgehog(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Hedgehog map: softmax over features of +/-(xW + b), so phi(q).phi(k) stays positive and spiky like softmax.

    x [B, H, T, D], weight [H, D, F], bias [H, F] -> [B, H, T, 2F] in x's dtype; the projection runs in
    the wider of x's and weight's dtypes, so bf16 x also takes fp32 weights outside autocast.
    """
    if _fused(x) and hedgehog_fusable(x, weight, bias):
        return hedgehog_triton(x, weight, bias)
    dtype = x.dtype if x.dtype == weight.dtype else torch.promote_types(x.dtype, weight.dtype)
    B, H, T, D = x.shape
    # One matmul batched over heads with the bias folded in (see `per_head_matmul`).
    z = step_bmm(as_dtype(x, dtype).transpose(0, 1).reshape(H, B * T, D), as_dtype(weight, dtype), add=as_dtype(bias, dtype).unsqueeze(1))
    z = z.view(H, B, T, -1).transpose(0, 1)
    return as_dtype(torch.stack([z, -z], dim=-2).softmax(-1).flatten(-2), x.dtype)


def hedgehog_step(x: torch.Tensor, signed_weight: torch.Tensor, signed_bias: torch.Tensor) -> torch.Tensor:
    """`hedgehog` for one token per row, from [W, -W] [H, D, 2F] and [b, -b] [H, 1, 2F] made beforehand:
    one product and one softmax over each half, where `hedgehog` also negates, stacks and flattens (an
    eager decoding step pays ~10 µs an op on a CPU, and Hedgehog runs twice per layer and token).

    x [B, H, 1, D] in the weights' dtype -> [B, H, 1, 2F].
    """
    B, H, _, D = x.shape
    z = step_bmm(x.transpose(0, 1).reshape(H, B, D), signed_weight, add=signed_bias)
    return z.view(H, B, 2, -1).softmax(-1).view(H, B, 1, -1).transpose(0, 1)


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """The classic positive map of Katharopoulos et al.: elu(x) + 1."""
    return torch.nn.functional.elu(x) + 1.0


def taylor(x: torch.Tensor, weight: torch.Tensor, radius: float | None = None, scale: float = 1.0) -> torch.Tensor:
    """Second-order Taylor map of exp (Based) on a low-dimensional projection x' = xW.

    x [B, H, T, D], weight [H, D, d] -> [B, H, T, 1 + d + d^2] with phi(q).phi(k) =
    1 + q'.k'/sqrt(d) + (q'.k')^2 / (2d): exp(q'.k'/sqrt(d)) to second order, and always positive.
    With `radius`, x' is L2-normalized to that length first (which bounds the argument).
    `scale` multiplies every feature (folded into the three parts: no extra pass over the output).
    """
    x = per_head_matmul(x, weight)
    if radius is not None:
        x = torch.nn.functional.normalize(x, dim=-1) * radius
    d = x.shape[-1]
    square = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) * (scale / (math.sqrt(2.0) * math.sqrt(d)))
    return torch.cat([torch.full_like(x[..., :1], scale), x * (scale / d**0.25), square], dim=-1)


def performer_logits(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """FAVOR+ exponent w.x' - |x'|^2 / 2 with x' = x D^(-1/4), so exp(.)s estimate exp(q.k / sqrt(D)).

    x [B, H, T, D], projection [H, M, D] -> [B, H, T, M].
    """
    x = x * x.shape[-1] ** -0.25
    return per_head_matmul(x, projection.transpose(-1, -2)) - 0.5 * x.pow(2).sum(-1, keepdim=True)


def performer(logits: torch.Tensor, stabilizer: torch.Tensor | None = None) -> torch.Tensor:
    """Positive random features exp(logits - stabilizer) / sqrt(M).

    Without a stabilizer each token subtracts its own max (exact for queries once the output is
    normalized); keys pass a running max so every key of a sequence shares one scale per step.
    The result has the logits' dtype, whatever the stabilizer's.
    """
    if _fused(logits) and performer_fusable(logits, stabilizer):
        return performer_triton(logits, stabilizer)
    if stabilizer is None:
        stabilizer = logits.amax(-1, keepdim=True).detach()
    return ((logits - stabilizer).exp() / math.sqrt(logits.shape[-1])).to(logits.dtype)


def performer_keys(
    key_logits: torch.Tensor, stabilizer: torch.Tensor | None, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Performer key features [B, H, T, M] with a running-max stabilizer, expressed as a scalar decay of the state.

    m_t = max(m_{t-1}, max_f logit_t); the state is kept relative to exp(m_t), so raising the max
    by d multiplies the old state by exp(-d): exactly a per-head decay g_t = m_{t-1} - m_t.
    `stabilizer` is the previous chunk's final m (None at the start); padding (`valid` [B, T] false)
    leaves m and the state unchanged. Returns (features, g [B, H, T, 1], final m, m per step).
    """
    keep = valid[:, None, :, None]
    step_max = key_logits.amax(-1, keepdim=True).detach().masked_fill(~keep, float("-inf"))
    start = torch.full_like(step_max[:, :, :1], float("-inf")) if stabilizer is None else stabilizer
    running = torch.cummax(torch.cat([start, step_max], dim=2), dim=2).values
    previous, current = running[:, :, :-1], running[:, :, 1:]
    g = torch.where(torch.isfinite(previous), previous - current, torch.zeros_like(current))
    per_step = torch.where(torch.isfinite(current), current, torch.zeros_like(current))
    features = performer(key_logits, per_step) * keep
    return features, g, running[:, :, -1:], per_step


def orthogonal_random_features(heads: int, features: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """[heads, features, dim] Gaussian rows made orthogonal in blocks of `dim`, with chi-distributed norms (FAVOR+).

    Drawn on the generator's device, also inside a meta-device build: the rows are fixed by the seed, not learned.
    """
    blocks = []
    for _ in range(heads):
        rows = []
        for start in range(0, features, dim):
            gaussian = torch.randn(dim, dim, generator=generator, device=generator.device)
            q, _ = torch.linalg.qr(gaussian)
            rows.append(q.T[: min(dim, features - start)])
        block = torch.cat(rows, dim=0)
        norms = torch.randn(features, dim, generator=generator, device=generator.device).norm(dim=-1, keepdim=True)
        blocks.append(block * norms)
    return torch.stack(blocks)
