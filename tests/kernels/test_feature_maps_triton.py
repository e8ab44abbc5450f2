"""The fused feature maps' dtypes and caps, run by Triton's interpreter on CPU tensors.

The fused path is forced as in tests/kernels/test_kernels_triton.py (LINEARIZE_KERNELS=triton), which also
holds fp32 dispatch equal to fp32 PyTorch; here results are checked against float64 PyTorch on the
same (already rounded) values, for low-precision and mixed dtypes, and above the caps.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from linearize.kernels import feature_maps, feature_maps_triton  # noqa: E402

if not isinstance(feature_maps_triton._performer_kernel, InterpretedFunction):
    pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOL = {F32: {"rtol": 1e-5, "atol": 1e-5}, BF16: {"rtol": 2e-2, "atol": 2e-2}, F16: {"rtol": 2e-3, "atol": 2e-3}}


def _run(fn: Callable, inputs: list[torch.Tensor | None], backend: str, monkeypatch: pytest.MonkeyPatch) -> list:
    """[output, d/d every tensor input] of fn through the dispatch, for a probe fixed in the output's dtype."""
    monkeypatch.setenv("LINEARIZE_KERNELS", backend)
    leaves = [t.detach().clone().requires_grad_() for t in inputs if t is not None]
    args = iter(leaves)
    y = fn(*(None if t is None else next(args) for t in inputs))
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.dtype)
    return [y, *torch.autograd.grad((y * probe).sum(), leaves)]


def _reference(fn: Callable, inputs: list[torch.Tensor | None], monkeypatch: pytest.MonkeyPatch) -> list:
    """`_run` through PyTorch in float64, the probe rounded to the dtype the low-precision output had."""
    out_dtype = inputs[0].dtype
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    leaves = [t.detach().double().requires_grad_() for t in inputs if t is not None]
    args = iter(leaves)
    y = fn(*(None if t is None else next(args) for t in inputs))
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(out_dtype).double()
    return [y, *torch.autograd.grad((y * probe).sum(), leaves)]


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(feature_maps, name)
    monkeypatch.setattr(feature_maps, name, lambda *a: calls.append(1) or original(*a))
    return calls


def _forbid(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(feature_maps, name, lambda *a: pytest.fail(f"{name} called above its cap"))


def _hedgehog_inputs(x_dtype: torch.dtype, w_dtype: torch.dtype, F: int = 12) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 20, 16, generator=gen).to(x_dtype)
    weight = (torch.randn(2, 16, F, generator=gen) * 0.3).to(w_dtype)
    return [x, weight, torch.randn(2, F, generator=gen).to(w_dtype)]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, **TOL[dtype])


@pytest.mark.parametrize("x_dtype, w_dtype", [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)])
def test_hedgehog_fused_dtypes(x_dtype: torch.dtype, w_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Output in x's dtype, each gradient in its input's, values to the float64 reference; PyTorch agrees on dtypes."""
    inputs = _hedgehog_inputs(x_dtype, w_dtype)
    want = _reference(feature_maps.hedgehog, inputs, monkeypatch)
    calls = _count_calls(monkeypatch, "hedgehog_triton")
    got = _run(feature_maps.hedgehog, inputs, "triton", monkeypatch)
    assert calls == [1]
    dtypes = [x_dtype, x_dtype, w_dtype, w_dtype]
    assert [t.dtype for t in got] == dtypes
    _assert_close(got, want, x_dtype)
    assert [t.dtype for t in _run(feature_maps.hedgehog, inputs, "torch", monkeypatch)] == dtypes


def test_hedgehog_under_autocast_keeps_x_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 activations with fp32 parameters under autocast: both paths give bf16 features and fp32 parameter grads."""
    inputs = _hedgehog_inputs(BF16, F32)
    want = _reference(feature_maps.hedgehog, inputs, monkeypatch)
    with torch.autocast("cpu", dtype=BF16):
        results = [_run(feature_maps.hedgehog, inputs, backend, monkeypatch) for backend in ("triton", "torch")]
    for got in results:
        assert [t.dtype for t in got] == [BF16, BF16, F32, F32]
        _assert_close(got, want, BF16)


@pytest.mark.parametrize(
    "logit_dtype, stab_dtype, per_head",
    [
        (F32, None, False), (BF16, None, False), (F16, None, False),
        (BF16, F32, False), (F32, BF16, False), (BF16, F32, True),
    ],  # fmt: skip
)
def test_performer_fused_dtypes(
    logit_dtype: torch.dtype, stab_dtype: torch.dtype | None, per_head: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output and logit gradient in the logits' dtype, the stabilizer's gradient in its own."""
    logits = torch.randn(1, 2, 20, 24, generator=torch.Generator().manual_seed(0))
    stab = None
    if stab_dtype is not None:
        stab = (logits.amax((-2, -1) if per_head else -1, keepdim=True) + 0.5).to(stab_dtype)
    inputs = [logits.to(logit_dtype), stab]
    want = _reference(feature_maps.performer, inputs, monkeypatch)
    calls = _count_calls(monkeypatch, "performer_triton")
    got = _run(feature_maps.performer, inputs, "triton", monkeypatch)
    assert calls == [1]
    dtypes = [logit_dtype, logit_dtype] + ([] if stab is None else [stab_dtype])
    assert [t.dtype for t in got] == dtypes
    _assert_close(got, want, BF16 if BF16 in dtypes else logit_dtype)
    assert [t.dtype for t in _run(feature_maps.performer, inputs, "torch", monkeypatch)] == dtypes


def test_hedgehog_above_the_cap_runs_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = feature_maps_triton.HEDGEHOG_MAX_FEATURES
    inputs = _hedgehog_inputs(BF16, F32, F=cap + 1)
    at_cap = [inputs[0], inputs[1][..., :cap], inputs[2][..., :cap]]
    assert feature_maps_triton.hedgehog_fusable(*at_cap)
    assert not feature_maps_triton.hedgehog_fusable(*(t.double() for t in at_cap))
    assert not feature_maps_triton.hedgehog_fusable(*inputs)
    with pytest.raises(ValueError, match="past the kernel"):
        feature_maps_triton.hedgehog_triton(*inputs)
    want = _reference(feature_maps.hedgehog, inputs, monkeypatch)
    _forbid(monkeypatch, "hedgehog_triton")
    got = _run(feature_maps.hedgehog, inputs, "triton", monkeypatch)
    assert [t.dtype for t in got] == [BF16, BF16, F32, F32]
    _assert_close(got, want, BF16)


def test_performer_above_the_cap_runs_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = feature_maps_triton.PERFORMER_MAX_FEATURES
    logits = torch.randn(1, 2, 3, cap + 1, generator=torch.Generator().manual_seed(0))
    assert feature_maps_triton.performer_fusable(logits[..., :cap], None)
    assert not feature_maps_triton.performer_fusable(logits, None)
    with pytest.raises(ValueError, match="past the kernel"):
        feature_maps_triton.performer_triton(logits)
    want = _reference(feature_maps.performer, [logits, None], monkeypatch)
    _forbid(monkeypatch, "performer_triton")
    _assert_close(_run(feature_maps.performer, [logits, None], "triton", monkeypatch), want, F32)
