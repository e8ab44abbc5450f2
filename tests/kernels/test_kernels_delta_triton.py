"""The gated delta rule's chunked Triton kernels against the PyTorch forms, run by Triton's interpreter on CPU.

`tests/conftest.py` sets TRITON_INTERPRET=1 before anything imports the kernels; shapes stay tiny
because the interpreter runs each program instance in Python. Inputs come from the PyTorch tests'
`make_inputs`: L2-normalized q and k, GQA, a decay per head or per key channel and padded steps
(beta = 0, g = 0).
"""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch

pytest.importorskip("triton")
from test_kernels_delta import make_inputs, outputs_and_grads  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from linearize.kernels import delta_triton, gla_triton, ops  # noqa: E402
from linearize.kernels.delta_torch import delta_chunked, delta_recurrent  # noqa: E402
from linearize.kernels.delta_triton import chunk_delta_triton  # noqa: E402

if not isinstance(delta_triton._ut_fwd_kernel, InterpretedFunction):
    pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

TOL = {"rtol": 1e-5, "atol": 1e-5}

CASES = {
    # B, HQ, H, T, K, V, decay, initial state, chunk size
    "gqa-head-h0-T37-chunk16": (2, 4, 2, 37, 16, 8, "head", True, 16),
    "gqa-head-T45-chunk32-K32-V24": (1, 4, 2, 45, 32, 24, "head", False, 32),
    "ungated-h0-T80-chunk64": (1, 2, 1, 80, 16, 16, None, True, 64),
    "ungated-T20-chunk16-K32-V32": (2, 2, 2, 20, 32, 32, None, False, 16),
    "gqa-head-h0-T29-chunk16-V17": (1, 4, 2, 29, 16, 17, "head", True, 16),  # a normalized layer's V = D + 1
    "gqa-channel-h0-T37-chunk16-V17": (1, 4, 2, 37, 16, 17, "channel", True, 16),
    "channel-T70-chunk64-K32": (1, 2, 1, 70, 32, 16, "channel", False, 64),  # sub-chunks meet inside a chunk
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunk_matches_recurrent_and_chunked(case: tuple) -> None:
    """o, the final state and the gradients of q, k, v, beta, g and the initial state, in fp32."""
    *shape, decay, state, chunk = case
    inputs = make_inputs(*shape, decay=decay, state=state)
    assert (inputs["beta"] == 0).any(), "some steps are padding"
    got = outputs_and_grads(chunk_delta_triton, inputs, scale=0.8, chunk_size=chunk)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for reference in (delta_recurrent, partial(delta_chunked, chunk_size=chunk)):
        want = outputs_and_grads(reference, inputs, scale=0.8)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL)


def test_bf16_inputs() -> None:
    """bf16 q, k, v, beta, g (fp32 initial state): o and the gradients in the inputs' dtypes, near fp64."""
    inputs = make_inputs(1, 4, 2, 40, 32, 16, decay="channel", state=True)
    half = {n: x.detach().bfloat16().requires_grad_() for n, x in inputs.items() if n != "initial_state"}
    half["initial_state"] = inputs["initial_state"]
    got = outputs_and_grads(chunk_delta_triton, half, scale=0.8, chunk_size=32)
    want = outputs_and_grads(
        delta_recurrent, {n: x.detach().double().requires_grad_() for n, x in half.items()}, scale=0.8
    )
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert [x.dtype for x in got[2:]] == [torch.bfloat16] * 5 + [torch.float32]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=3e-2, atol=3e-2)


def test_env_routes_the_chunked_mode_through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """LINEARIZE_KERNELS=triton sends gated_delta_rule(mode="chunk") to chunk_delta_triton (CPU tensors: the
    interpreter), =torch to delta_chunked; both give the same outputs and gradients."""
    calls: list[str] = []
    for name in ("chunk_delta_triton", "delta_chunked"):
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))

    def run(q, k, v, beta, g, initial_state):
        return ops.gated_delta_rule(
            q, k, v, beta, g, scale=0.8, initial_state=initial_state, mode="chunk", chunk_size=16
        )

    inputs = make_inputs(1, 4, 2, 21, 16, 16, decay="head", state=True)
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    want = outputs_and_grads(run, inputs)
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    got = outputs_and_grads(run, inputs)
    assert calls == ["delta_chunked", "chunk_delta_triton"]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_launches_run_under_the_inputs_device_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward make the inputs' device current (cuda:1 while cuda:0 is current)."""
    seen: list[torch.device] = []
    guard = delta_triton._device_guard

    def recording(x: torch.Tensor) -> contextlib.AbstractContextManager:
        seen.append(x.device)
        return guard(x)

    monkeypatch.setattr(delta_triton, "_device_guard", recording)
    inputs = make_inputs(1, 2, 1, 17, 16, 16, decay="head", state=True)
    outputs_and_grads(chunk_delta_triton, inputs, chunk_size=16)
    assert len(seen) == 2 and set(seen) == {inputs["q"].device}, "forward and backward"


def test_a_pass_no_launch_fits_runs_again_at_half_the_chunk_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a GPU holds no launch of a pass at its chunk length (fp32 K = 256's reverse state scan on the 99 KB
    GPUs), that pass runs again at half of it, each pass on its own, to the same result; what fit is kept."""
    launch, tried = delta_triton._launch, []
    longest = {delta_triton._delta_state: 32, delta_triton._delta_dstate: 16}  # the forward's scan, the backward's

    def refusing(kernel, grid, *args, **meta) -> None:
        if kernel in longest:
            tried.append((kernel.__name__, meta["BT"]))
            if meta["BT"] > longest[kernel]:
                raise gla_triton.SharedMemoryError("refused")
        launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(delta_triton, "_launch", refusing)
    monkeypatch.setattr(delta_triton, "_chunk_lens", {})
    inputs = make_inputs(1, 4, 2, 37, 16, 8, decay="channel", state=True)
    got = outputs_and_grads(chunk_delta_triton, inputs, scale=0.8, chunk_size=64)
    state, dstate = "_delta_state_kernel", "_delta_dstate_kernel"
    assert tried == [(state, 64), (state, 32), (state, 32), (dstate, 32), (state, 16), (dstate, 16)]
    assert delta_triton._chunk_lens == {(16, 8, torch.float32): 16}
    for a, b in zip(got, outputs_and_grads(delta_recurrent, inputs, scale=0.8), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    tried.clear()
    outputs_and_grads(chunk_delta_triton, inputs, scale=0.8, chunk_size=64)
    assert tried == [(state, 16), (state, 16), (dstate, 16)], "the next call starts at the length that fit"
    monkeypatch.setattr(delta_triton, "_chunk_lens", {})
    monkeypatch.setattr(delta_triton, "SUB_CHUNK", 32)
    with pytest.raises(gla_triton.SharedMemoryError):
        outputs_and_grads(chunk_delta_triton, inputs, scale=0.8, chunk_size=64)


def test_kernels_keep_fp32_where_gla_does_and_tune_bounded_state_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The UT transform and its backward take the kept fp32 precision; on hardware the scans tune BV only as
    wide as a whole-K state tile allows (K = 256: at most 64) when autotuning, 2 and 1 stages deep."""
    for kernel in (delta_triton._ut_fwd_kernel, delta_triton._dv_local_kernel, delta_triton._ut_bwd_kernel):
        assert "PREC32" in kernel.arg_names
    monkeypatch.setattr(gla_triton, "_interpreting", lambda: False)
    monkeypatch.setenv("LINEARIZE_AUTOTUNE", "1")
    tuner = gla_triton._tuned(delta_triton._delta_state_kernel, ["K", "V"], ("BV",), prune=delta_triton._state_tiles)
    assert {c.kwargs["BV"] for c in tuner.configs} == set(gla_triton.TILES)
    assert {c.kwargs["BV"] for c in delta_triton._state_tiles(tuner.configs, {}, K=256, V=128)} == {32, 64}
    assert {c.kwargs["BV"] for c in delta_triton._state_tiles(tuner.configs, {}, K=64, V=128)} == {32, 64, 128}
    scan = gla_triton._tuned(delta_triton._delta_state_kernel, ["K"], ("BV",), stages=delta_triton.SCAN_STAGES)
    assert {(c.kwargs["BV"], c.num_warps, c.num_stages) for c in scan.configs} == {
        (bv, warps, stages) for bv in gla_triton.TILES for warps in gla_triton.WARPS for stages in (2, 1)
    }, "the scans also try 1 stage"


def test_shape_errors_name_the_tensors() -> None:
    inputs = {n: None if x is None else x.detach() for n, x in make_inputs(1, 2, 1, 8, 16, 16).items()}
    q, k, v, beta, g, h0 = inputs.values()
    with pytest.raises(ValueError, match="beta"):
        chunk_delta_triton(q, k, v, beta[..., :4], g)
    with pytest.raises(ValueError, match="g must be"):
        chunk_delta_triton(q, k, v, beta, g[..., 0])
    with pytest.raises(ValueError, match="state must be"):
        chunk_delta_triton(q, k, v, beta, g, initial_state=h0[..., :8])


@pytest.mark.parametrize(
    "form",
    [
        {"feature_map": "identity", "normalize": False, "conv_size": 4},
        {"feature_map": "hedgehog", "normalize": True},  # GLA's state: a value column of ones, V + 1 wide
    ],
    ids=["added", "normalized"],
)
def test_deltanet_model_trains_the_same_on_triton(monkeypatch: pytest.MonkeyPatch, form: dict) -> None:
    """A delta-rule layer with a window and sinks (and a short convolution) gives the PyTorch forms'
    logits and parameter gradients when its chunked form runs in Triton."""
    from conftest import make_tiny_linearize

    settings = {"kind": "deltanet", "gate": "lowrank", "window": 4, "sink": 2, "chunk_size": 16, **form}
    model = make_tiny_linearize(["linear_attention", "full_attention"], settings).train()
    ids = torch.randint(2, 128, (2, 21), generator=torch.Generator().manual_seed(0))
    calls: list[int] = []
    original = ops.chunk_delta_triton
    monkeypatch.setattr(ops, "chunk_delta_triton", lambda *a, **kw: calls.append(1) or original(*a, **kw))

    def run() -> list[torch.Tensor]:
        model.zero_grad()
        logits = model(ids, use_cache=False).logits
        logits.square().mean().backward()
        return [logits.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]

    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    want = run()
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    got = run()
    assert calls == [1]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
