"""Every Triton kernel against the PyTorch reference, run by Triton's interpreter on CPU tensors.

`tests/conftest.py` sets TRITON_INTERPRET=1 before anything imports the kernels; shapes stay small
because the interpreter runs each program instance in Python.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from functools import partial

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as triton_language  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from linearize.kernels import feature_maps, gla_triton, ops  # noqa: E402
from linearize.kernels.gla_torch import gla_parallel, gla_recurrent  # noqa: E402
from linearize.kernels.gla_triton import chunk_gla_triton, fused_recurrent_gla_triton  # noqa: E402

if not isinstance(gla_triton._chunk_cumsum_kernel, InterpretedFunction):
    pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

TOL = {"rtol": 1e-5, "atol": 1e-5}


def make_inputs(
    B: int, HQ: int, H: int, T: int, K: int, V: int, decay: bool, state: bool, seed: int = 0
) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    g = None
    if decay:
        g = torch.nn.functional.logsigmoid(torch.randn(B, H, T, K, generator=gen) * 2 + 1).clamp(min=-5.0)
        g.requires_grad_()
    return {
        "q": randn(B, HQ, T, K, scale=K**-0.5),
        "k": randn(B, H, T, K, scale=K**-0.5),
        "v": randn(B, H, T, V),
        "g": g,
        "initial_state": randn(B, H, K, V, scale=0.5) if state else None,
    }


def outputs_and_grads(fn, inputs: dict, *args) -> list[torch.Tensor]:
    """[o, final state, d/d every tensor input] for a random projection of (o, final state)."""
    o, state = fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], 0.7, inputs["initial_state"], *args)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    leaves = [x for x in inputs.values() if x is not None]
    return [o, state, *torch.autograd.grad(loss, leaves)]


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], **tol) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **(tol or TOL))


CHUNK_CASES = {
    # B, HQ, H, T, K, V, decay, initial state, chunk size
    "T40-chunk32-subchunks": (1, 2, 2, 40, 16, 16, True, True, 32),
    "gqa-V20-T33-chunk16": (1, 4, 2, 33, 16, 20, True, False, 16),
    "T1-batch2": (2, 1, 1, 1, 16, 17, True, True, 64),
    "no-decay-gqa-T64": (1, 2, 1, 64, 16, 16, False, True, 64),
    "K80-V65-blocks": (1, 1, 1, 24, 80, 65, True, True, 16),
}


@pytest.mark.parametrize("case", CHUNK_CASES.values(), ids=CHUNK_CASES.keys())
def test_chunk_matches_parallel(case: tuple) -> None:
    *shape, decay, state, chunk = case
    inputs = make_inputs(*shape, decay=decay, state=state)
    want = outputs_and_grads(gla_parallel, inputs)
    got = outputs_and_grads(chunk_gla_triton, inputs, chunk)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_all_close(got, want)


SEGMENT_CASES = {
    # B, HQ, H, T, K, V, decay ("channel", "head" or None), initial state, normalizer, chunks per segment
    "channel-gqa-state-partial": (1, 4, 2, 75, 16, 20, "channel", True, False, 2),
    "channel-one-chunk-each": (2, 2, 1, 64, 32, 16, "channel", False, False, 1),
    "head-state": (1, 2, 1, 70, 16, 16, "head", True, False, 3),
    "no-decay-state": (1, 2, 2, 50, 16, 16, None, True, False, 2),
    "normalizer-channel-state": (1, 2, 1, 66, 16, 16, "channel", True, True, 2),
}


@pytest.mark.parametrize("case", SEGMENT_CASES.values(), ids=SEGMENT_CASES.keys())
def test_segmented_scans_equal_the_parallel_form(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state scans split into segments (scanned apart, then carried across and fixed up) give the same
    outputs, final state and gradients, h0 and dh0 included, as one scan would."""
    B, HQ, H, T, K, V, decay, state, norm, per_segment = case
    segments: list[int] = []

    def segment_len(chunks: int, programs: int) -> int:
        segments.append(-(-chunks // per_segment))
        return per_segment

    monkeypatch.setattr(gla_triton, "_segment_len", segment_len)
    inputs = make_inputs(B, HQ, H, T, K, V, decay=decay == "channel", state=False)
    gen = torch.Generator().manual_seed(6)
    if decay == "head":
        inputs["g"] = torch.nn.functional.logsigmoid(torch.randn(B, H, T, 1, generator=gen) + 1).requires_grad_()
    if norm:
        with torch.no_grad():
            inputs["q"].copy_(torch.nn.functional.elu(inputs["q"]) + 1)
            inputs["k"].copy_(torch.nn.functional.elu(inputs["k"]) + 1)
    if state:
        inputs["initial_state"] = (torch.rand(B, H, K, V + norm, generator=gen) * 0.5).requires_grad_()

    def reference(q, k, v, g, scale, initial_state):
        return gla_parallel(q, k, ops.with_normalizer(v) if norm else v, g, scale, initial_state)

    want = outputs_and_grads(reference, inputs)
    got = outputs_and_grads(partial(chunk_gla_triton, chunk_size=16, normalizer=norm), inputs)
    assert min(segments) > 1, "the scans ran in one segment"
    assert_all_close(got, want, rtol=1e-5, atol=1e-4 if norm else 1e-5)


def test_segmented_scans_with_bf16_state_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 state storage through the carry and fix-up passes: every output and gradient within bf16 rounding
    of the parallel form (relative error of the whole tensor; one scan gives 1e-3 to 6e-3 here)."""
    monkeypatch.setattr(gla_triton, "_segment_len", lambda chunks, programs: 2)
    inputs = make_inputs(1, 2, 1, 70, 16, 16, decay=True, state=True)
    want = outputs_and_grads(gla_parallel, inputs)
    got = outputs_and_grads(partial(chunk_gla_triton, chunk_size=16, state_dtype=torch.bfloat16), inputs)
    assert got[1].dtype == torch.bfloat16
    errors = [((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, want)]
    assert max(errors) < 1.5e-2, errors


def test_segments_grow_with_few_heads_and_stay_within_the_square_root() -> None:
    """Few heads: about sqrt(chunks) segments; many heads: one segment, the plain scan."""
    assert gla_triton._segment_len(256, 16) == 16
    assert gla_triton._segment_len(256, 4096) == 256
    assert gla_triton._segment_len(1, 1) == 1
    assert all(1 <= gla_triton._segment_len(n, p) <= n for n in range(1, 70) for p in (1, 16, 100, 1000))


def test_chunk_needs_no_decay_clamp() -> None:
    """Log-decays far below MIN_LOG_DECAY (the PyTorch chunked form's limit) stay finite and exact here."""
    inputs = make_inputs(1, 2, 1, 48, 16, 16, decay=True, state=True)
    with torch.no_grad():
        inputs["g"][..., :8] = -30.0
        inputs["g"][..., 8:] = -1e-4
    want = outputs_and_grads(gla_parallel, {n: None if x is None else x.double() for n, x in inputs.items()})
    got = outputs_and_grads(chunk_gla_triton, inputs, 32)
    assert all(torch.isfinite(x).all() for x in got)
    assert_all_close([x.double() for x in got], want)


@pytest.mark.parametrize("span", [-1.0, 1e9], ids=["pair-by-pair", "one-dot"])
def test_diagonal_blocks_in_either_form_equal_the_parallel_form(span: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A diagonal 16x16 block is one dot through its first row where its decay spans at most DIAG_SPAN, else
    pair by pair: each form alone (forced here) gives the reference, forward and backward, with GQA."""
    monkeypatch.setattr(gla_triton, "DIAG_SPAN", span)
    inputs = make_inputs(1, 4, 2, 45, 16, 20, decay=True, state=True, seed=7)
    want = outputs_and_grads(gla_parallel, inputs)
    assert_all_close(outputs_and_grads(chunk_gla_triton, inputs, 32), want)


def test_the_span_check_keeps_steep_decays_off_the_one_dot_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decays of -30 a token span 480 over a block: through its first row the factors would overflow fp32 (as
    forcing it shows), so at the default span those blocks go pair by pair and stay exact."""
    inputs = make_inputs(1, 2, 1, 48, 16, 16, decay=True, state=False, seed=2)
    with torch.no_grad():
        inputs["g"][..., :4] = -30.0
    want = outputs_and_grads(gla_parallel, {n: None if x is None else x.double() for n, x in inputs.items()})
    assert_all_close([x.double() for x in outputs_and_grads(chunk_gla_triton, inputs, 32)], want)
    monkeypatch.setattr(gla_triton, "DIAG_SPAN", 1e9)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy reports the overflow
        forced = chunk_gla_triton(inputs["q"], inputs["k"], inputs["v"], inputs["g"], 0.7, None, 32)[0]
    assert not torch.isfinite(forced).all()


def test_chunk_per_head_decay() -> None:
    """g [B, H, T, 1] (one decay per head, any strength) broadcasts over the key channels."""
    inputs = make_inputs(1, 2, 1, 40, 16, 16, decay=False, state=True)
    inputs["g"] = (torch.rand(1, 1, 40, 1, generator=torch.Generator().manual_seed(5)) * -20).requires_grad_()
    want = outputs_and_grads(gla_parallel, inputs)
    got = outputs_and_grads(chunk_gla_triton, inputs, 32)
    assert got[-2].shape == (1, 1, 40, 1)
    assert_all_close(got, want)


def test_per_head_decay_takes_the_scalar_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """One decay per head runs one masked dot per chunk forward and backward, with GQA and a partial last chunk,
    and never the per-channel kernels; the decay is read as [B, H, T, 1], not expanded over K."""
    ran: list[str] = []
    for name in ("_intra_scores", "_intra_scores_scalar", "_bwd_intra", "_bwd_intra_scalar"):
        kernel = getattr(gla_triton, name)
        monkeypatch.setattr(gla_triton, name, _Recording(kernel, name, ran))
    inputs = make_inputs(2, 4, 2, 37, 16, 20, decay=False, state=True)
    inputs["g"] = torch.nn.functional.logsigmoid(torch.randn(2, 2, 37, 1, generator=torch.Generator().manual_seed(3)) + 2)
    inputs["g"].requires_grad_()
    want = outputs_and_grads(gla_parallel, inputs)
    got = outputs_and_grads(chunk_gla_triton, inputs, 16)
    assert_all_close(got, want)
    assert set(ran) == {"_intra_scores_scalar", "_bwd_intra_scalar"}


class _Recording:
    """A kernel launcher that notes its name when launched."""

    def __init__(self, kernel, name: str, ran: list[str]) -> None:
        self.kernel, self.name, self.ran = kernel, name, ran

    def __getitem__(self, grid):
        self.ran.append(self.name)
        return self.kernel[grid]


def test_launches_run_under_the_inputs_device_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward, backward and the decoding step make the inputs' device current (cuda:1 while cuda:0 is current)."""
    seen: list[torch.device] = []
    guard = gla_triton._device_guard

    def recording(x: torch.Tensor):
        seen.append(x.device)
        return guard(x)

    monkeypatch.setattr(gla_triton, "_device_guard", recording)
    inputs = make_inputs(1, 2, 1, 20, 16, 16, decay=True, state=True)
    outputs_and_grads(chunk_gla_triton, inputs)
    assert len(seen) == 2 and set(seen) == {inputs["q"].device}, "forward and backward"
    with torch.no_grad():
        fused_recurrent_gla_triton(*(x.detach() for x in list(inputs.values())[:4]), 0.7, None)
    assert len(seen) == 3
    assert isinstance(guard(torch.zeros(1)), contextlib.nullcontext), "a CPU tensor needs no guard"


class _SharedMemoryHungry:
    """A stand-in kernel needing `per_column * BV * stages` bytes of shared memory, refused over `limit` as loading it
    on a GPU would be."""

    __name__ = "_hungry_kernel"

    def __init__(self, per_column: int, limit: int) -> None:
        self.per_column, self.limit, self.tried = per_column, limit, []

    def __getitem__(self, grid: tuple):
        def run(*args, BV: int, num_stages: int = 3, **meta) -> None:
            self.tried.append((num_stages, BV, grid))
            if self.per_column * BV * num_stages > self.limit:
                raise triton.runtime.errors.OutOfResources(self.per_column * BV * num_stages, self.limit, "shared memory")

        return run


def test_a_refused_launch_runs_shallower_then_narrower_and_keeps_what_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """3, 2, 1 stages deep; with `narrow`, then half the value tile from 3 stages again; the fit is kept for the
    kernel and its constants, and a launch nothing fits names the fixes in one line."""
    monkeypatch.setattr(gla_triton, "_fallbacks", {})
    kernel = _SharedMemoryHungry(per_column=1000, limit=40000)  # BV = 64 fits at no depth, BV = 32 at 1 stage
    grid = lambda t: (128 // t["BV"],)  # noqa: E731
    gla_triton._launch(kernel, grid, tiles={"BV": 64}, narrow=True, K=256, V=128)
    assert kernel.tried == [(3, 64, (2,)), (2, 64, (2,)), (1, 64, (2,)), (3, 32, (4,)), (2, 32, (4,)), (1, 32, (4,))]
    kernel.tried.clear()
    gla_triton._launch(kernel, grid, tiles={"BV": 64}, narrow=True, K=256, V=128)
    assert kernel.tried == [(1, 32, (4,))], "the next launch goes straight to what fit"
    fixed = _SharedMemoryHungry(per_column=1000, limit=40000)
    with pytest.raises(gla_triton.SharedMemoryError) as refused:
        gla_triton._launch(fixed, grid, tiles={"BV": 64}, K=256, V=128)
    assert [depth for depth, *_ in fixed.tried] == [3, 2, 1], "without `narrow` the tile stays"
    assert str(refused.value) == (
        "_hungry_kernel (BV=64, K=256, V=128) needs 64000 bytes of shared memory even 1 stage deep, more than this "
        "GPU's 40000: use narrower heads, bf16 inputs, or LINEARIZE_KERNELS=torch"
    )


class _RefusingTuner(triton.runtime.Autotuner):
    """A stand-in autotuner whose every config the GPU refused: Triton then launches one anyway, and it fails."""

    def __init__(self) -> None:
        self.base_fn = _SharedMemoryHungry

    def __getitem__(self, grid):
        def run(*args, **meta) -> None:
            raise triton.runtime.errors.OutOfResources(131072, 101376, "shared memory")

        return run


def test_a_tuned_launch_no_config_fits_names_the_fixes() -> None:
    """The same one-line SharedMemoryError as a fixed launch's, so a delta-rule pass halves its chunk there too."""
    with pytest.raises(gla_triton.SharedMemoryError) as refused:
        gla_triton._launch(_RefusingTuner(), lambda meta: (1,), tiles={}, K=256, V=64, BT=64)
    assert str(refused.value) == (
        "_SharedMemoryHungry (BT=64, K=256, V=64) needs 131072 bytes of shared memory in every tuned config, more "
        "than this GPU's 101376: use narrower heads, bf16 inputs, or LINEARIZE_KERNELS=torch"
    )


def test_bf16_state_storage() -> None:
    """state_dtype=bf16 stores the chunk states and the final state in bf16; results stay within bf16 rounding."""
    inputs = make_inputs(1, 2, 1, 40, 16, 16, decay=True, state=True)
    want = outputs_and_grads(gla_parallel, inputs)
    got = outputs_and_grads(partial(chunk_gla_triton, state_dtype=torch.bfloat16), inputs)
    assert got[1].dtype == torch.bfloat16
    assert_all_close([x.float() for x in got], want, rtol=2e-2, atol=2e-2)
    q, k, v, g, h0 = (x.detach() for x in inputs.values())
    state = h0.to(torch.bfloat16)
    with torch.no_grad():
        o, h = fused_recurrent_gla_triton(q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], 0.7, state,
                                          state_dtype=torch.bfloat16)
    want_o, want_h = gla_recurrent(q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], 0.7, h0, inplace=False)
    assert h is state, "a bf16 state is updated in place when bf16 storage is asked for"
    torch.testing.assert_close(h.float(), want_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o, want_o, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="state_dtype"):
        chunk_gla_triton(q, k, v, g, 0.7, None, state_dtype=torch.float16)


def test_precision_kept_where_fla_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-chunk cross-sub-chunk scores, in-chunk dq/dk and A^T do run on fp32 operands: tf32 for half inputs,
    and for fp32 inputs only where torch allows tf32; else fp32-accurate three-pass tf32 (`EXACT_FP32`)."""
    for kernel in (gla_triton._intra_scores_kernel, gla_triton._bwd_intra_kernel, gla_triton._bwd_dv_kernel):
        assert "PREC32" in kernel.arg_names
    assert gla_triton._kept_precision(torch.bfloat16) == "tf32"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert gla_triton._kept_precision(torch.float32) == "tf32x3"
        assert gla_triton._dot_config(torch.float32)["PREC"] == "tf32x3"
        torch.set_float32_matmul_precision("high")
        assert gla_triton._kept_precision(torch.float32) == "tf32"
        assert gla_triton._dot_config(torch.float32)["PREC"] == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)
    monkeypatch.setattr(gla_triton, "_interpreting", lambda: False)
    assert gla_triton._dot_config(torch.bfloat16) == {"DT": triton_language.bfloat16, "PREC": "tf32"}


def test_autotuner_searches_tiles_and_warps(monkeypatch: pytest.MonkeyPatch) -> None:
    """With LINEARIZE_AUTOTUNE=1 on hardware the tiles BK/BV are tuned with num_warps; by default, and always
    under the interpreter, the kernels launch fixed tiles."""
    monkeypatch.setenv("LINEARIZE_AUTOTUNE", "1")
    assert gla_triton._tuned(gla_triton._fwd_state_kernel, ["K"], ("BK", "BV")) is gla_triton._fwd_state_kernel
    monkeypatch.setattr(gla_triton, "_interpreting", lambda: False)
    tuner = gla_triton._tuned(gla_triton._fwd_state_kernel, ["K", "V"], ("BK", "BV"))
    tiles = {(c.kwargs["BK"], c.kwargs["BV"]) for c in tuner.configs}
    assert tiles == {(a, b) for a in gla_triton.TILES for b in gla_triton.TILES}
    assert {c.num_warps for c in tuner.configs} == set(gla_triton.WARPS)
    monkeypatch.delenv("LINEARIZE_AUTOTUNE")
    assert gla_triton._tuned(gla_triton._fwd_state_kernel, ["K"], ("BK", "BV")) is gla_triton._fwd_state_kernel
    monkeypatch.setenv("LINEARIZE_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="set it to 1 .autotune. or 0"):
        gla_triton._fixed_tiles()
    kept = gla_triton._fitting_tiles(tuner.configs, {}, K=64, V=20)
    assert {(c.kwargs["BK"], c.kwargs["BV"]) for c in kept} == {(32, 32), (64, 32)}, "no tile wider than it needs"


RECURRENT_CASES = {
    # B, HQ, H, T, K, V, decay, initial state
    "gqa-3-tokens": (1, 4, 2, 3, 16, 20, True, True),
    "one-token-batch2-no-decay": (2, 2, 2, 1, 32, 17, False, True),
    "no-state": (1, 2, 1, 2, 16, 16, True, False),
}


@pytest.mark.parametrize("case", RECURRENT_CASES.values(), ids=RECURRENT_CASES.keys())
def test_fused_recurrent_matches_recurrence_in_place(case: tuple) -> None:
    """The Triton step and the PyTorch recurrence agree, and both update an fp32 state in place (CPU = CUDA)."""
    inputs = make_inputs(*case)
    q, k, v, g, h0 = (None if x is None else x.detach() for x in inputs.values())
    want_o, want_h = gla_recurrent(q, k, v, g, 0.7, h0, inplace=False)
    for step in (gla_recurrent, fused_recurrent_gla_triton):
        state = None if h0 is None else h0.clone()
        with torch.no_grad():
            o, h = step(q, k, v, g, 0.7, state)
        torch.testing.assert_close(o, want_o, **TOL)
        torch.testing.assert_close(h, want_h, **TOL)
        if state is not None:
            assert h is state, f"{step.__name__}: an fp32 contiguous state is updated in place"


def test_fused_recurrent_out_of_place_and_half_state() -> None:
    inputs = make_inputs(1, 2, 1, 2, 16, 16, decay=True, state=True)
    q, k, v, g, h0 = (x.detach() for x in inputs.values())
    want_o, want_h = gla_recurrent(q, k, v, g, 0.7, h0, inplace=False)
    kept = h0.clone()
    with torch.no_grad():
        o, h = fused_recurrent_gla_triton(q, k, v, g, 0.7, h0, inplace=False)
        gla_recurrent(q, k, v, g, 0.7, h0, inplace=False)
        o16, h16 = fused_recurrent_gla_triton(q, k, v, g, 0.7, h0.to(torch.bfloat16))
    torch.testing.assert_close(h0, kept, rtol=0, atol=0)
    torch.testing.assert_close(o, want_o, **TOL)
    torch.testing.assert_close(h, want_h, **TOL)
    assert h16.dtype == torch.float32
    torch.testing.assert_close(o16, want_o, rtol=2e-2, atol=2e-2)


def test_fused_recurrent_with_autograd_is_differentiable() -> None:
    inputs = make_inputs(1, 2, 1, 3, 16, 16, decay=True, state=True)
    want = outputs_and_grads(gla_parallel, inputs)
    got = outputs_and_grads(fused_recurrent_gla_triton, inputs)
    assert_all_close(got, want)


def test_prefill_then_decode_continues_the_sequence() -> None:
    inputs = make_inputs(1, 2, 1, 40, 16, 16, decay=True, state=False)
    q, k, v, g = (inputs[n].detach() for n in ("q", "k", "v", "g"))
    o_all, h_all = gla_parallel(q, k, v, g, 0.5)
    with torch.no_grad():
        o_pre, h = chunk_gla_triton(q[:, :, :37], k[:, :, :37], v[:, :, :37], g[:, :, :37], 0.5, None, 16)
        outs = [o_pre]
        for t in range(37, 40):
            step = (x[:, :, t : t + 1] for x in (q, k, v, g))
            o_t, h = fused_recurrent_gla_triton(*step, 0.5, h)
            outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, dim=2), o_all, **TOL)
    torch.testing.assert_close(h, h_all, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    inputs = make_inputs(1, 2, 1, 40, 32, 32, decay=True, state=True)
    half = {n: x.detach().to(dtype).requires_grad_() for n, x in inputs.items() if n != "initial_state"}
    half["initial_state"] = inputs["initial_state"]
    got = outputs_and_grads(chunk_gla_triton, half, 32)
    want = outputs_and_grads(gla_parallel, {n: x.detach().double().requires_grad_() for n, x in half.items()})
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert [x.dtype for x in got[2:]] == [dtype] * 4 + [torch.float32]
    assert_all_close([x.double() for x in got], want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_env_forces_triton_through_dispatch(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """LINEARIZE_KERNELS=triton sends CPU tensors through the Triton kernels (here: the interpreter)."""
    calls = []
    for name in ("chunk_gla_triton", "fused_recurrent_gla_triton"):
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    inputs = make_inputs(1, 2, 1, 20 if mode == "chunk" else 2, 16, 16, decay=True, state=False)
    with torch.no_grad():
        inputs["q"].copy_(torch.nn.functional.elu(inputs["q"]) + 1)
        inputs["k"].copy_(torch.nn.functional.elu(inputs["k"]) + 1)

    def run(q, k, v, g, scale, initial_state, mode):
        return ops.gated_linear_attention(q, k, v, g, scale=scale, normalize=True, initial_state=initial_state, mode=mode)

    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    want = outputs_and_grads(run, inputs, "parallel")
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    assert ops.kernel_backend(torch.device("cpu")) == "triton"
    got = outputs_and_grads(run, inputs, mode)
    assert calls == [{"chunk": "chunk_gla_triton", "recurrent": "fused_recurrent_gla_triton"}[mode]]
    assert got[1].shape[-1] == 17
    assert_all_close(got, want)
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    with torch.no_grad():
        q, k, v, g = (x.detach() for x in list(inputs.values())[:4])
        _, state = run(q, k, v, g, 0.7, None, mode)
        _, half = ops.gated_linear_attention(q, k, v, g, scale=0.7, normalize=True, mode=mode, state_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16, "state_dtype reaches the PyTorch path too"
    torch.testing.assert_close(half.float(), state, rtol=2e-2, atol=2e-2)


def _grads(y: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    return [y, *torch.autograd.grad((y * probe).sum(), leaves)]


def test_hedgehog_fused_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 20, generator=gen).requires_grad_()
    weight = (torch.randn(3, 20, 24, generator=gen) * 0.3).requires_grad_()
    bias = torch.randn(3, 24, generator=gen).requires_grad_()
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    want = _grads(feature_maps.hedgehog(x, weight, bias), [x, weight, bias])
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    calls = []
    original = feature_maps.hedgehog_triton
    monkeypatch.setattr(feature_maps, "hedgehog_triton", lambda *a: calls.append(1) or original(*a))
    got = _grads(feature_maps.hedgehog(x, weight, bias), [x, weight, bias])
    assert calls == [1]
    assert_all_close(got, want)


@pytest.mark.parametrize("stabilizer", ["row-max", "per-row", "per-head"])
def test_performer_fused_matches_torch(stabilizer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 40, 37, generator=gen).requires_grad_()
    stab = {
        "row-max": None,
        "per-row": torch.randn(2, 3, 40, 1, generator=gen).requires_grad_(),
        "per-head": torch.randn(2, 3, 1, 1, generator=gen).requires_grad_(),
    }[stabilizer]
    leaves = [logits] + ([] if stab is None else [stab])
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    want = _grads(feature_maps.performer(logits, stab), leaves)
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    calls = []
    original = feature_maps.performer_triton
    monkeypatch.setattr(feature_maps, "performer_triton", lambda *a: calls.append(1) or original(*a))
    got = _grads(feature_maps.performer(logits, stab), leaves)
    assert calls == [1]
    assert_all_close(got, want)


def test_modules_import_without_gpu_or_interpreter() -> None:
    """On a CUDA-less machine without TRITON_INTERPRET the modules still import (CUDA path, autotuned kernels)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"LINEARIZE_AUTOTUNE": "1"}
    code = (
        "import triton, linearize.kernels.gla_triton as m, linearize.kernels.feature_maps_triton as f; "
        "import linearize.kernels.delta_triton as d; "
        "assert isinstance(m._fwd_state, triton.runtime.Autotuner), type(m._fwd_state); "
        "assert isinstance(d._delta_state, triton.runtime.Autotuner), type(d._delta_state)"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@pytest.mark.parametrize(
    "case",
    [
        (1, 2, 2, 5, 16, 16, "head", True),
        (2, 4, 2, 9, 16, 24, "channel", False),
        (1, 3, 1, 4, 32, 8, None, True),
        (1, 2, 1, 3, 16, 17, "channel", True),
    ],
)
@torch.no_grad()
def test_fused_recurrent_delta_matches_the_reference(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gated delta rule's Triton decoding step, directly and through the dispatch."""
    from linearize.kernels.delta_torch import delta_recurrent
    from linearize.kernels.delta_triton import fused_recurrent_delta_triton

    B, HQ, H, T, K, V, decay, state = case
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, HQ, T, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, K, generator=gen), dim=-1)
    v = torch.randn(B, H, T, V, generator=gen)
    beta = torch.rand(B, H, T, generator=gen)
    channels = K if decay == "channel" else 1
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, T, channels, generator=gen) + 3) if decay else None
    h0 = torch.randn(B, H, K, V, generator=gen) if state else None
    want = delta_recurrent(q, k, v, beta, g, 0.8, h0)
    got = fused_recurrent_delta_triton(q, k, v, beta, g, 0.8, h0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    dispatched = ops.gated_delta_rule(q, k, v, beta, g, scale=0.8, initial_state=h0, mode="recurrent")
    for a, b in zip(dispatched, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


NORMALIZER_CASES = {
    # B, HQ, H, T, K, V, decay, initial state
    "gqa-state-partial-chunk": (1, 4, 2, 45, 16, 16, True, True),
    "no-decay-no-state": (2, 2, 1, 33, 32, 20, False, False),
}


@pytest.mark.parametrize("case", NORMALIZER_CASES.values(), ids=NORMALIZER_CASES.keys())
@pytest.mark.parametrize("per_head", [False, True], ids=["per-channel", "per-head"])
def test_normalizer_vector_matches_a_column_of_ones(case: tuple, per_head: bool) -> None:
    """The kernels' [K] normalizer gives what a column of ones on v gives, forward and backward
    (output's last column q.z, the state's last column z, and the gradients through both)."""
    B, HQ, H, T, K, V, decay, state = case
    inputs = make_inputs(B, HQ, H, T, K, V, decay=decay and not per_head, state=False)
    with torch.no_grad():  # positive features, as the model's maps give
        inputs["q"].copy_(torch.nn.functional.elu(inputs["q"]) + 1)
        inputs["k"].copy_(torch.nn.functional.elu(inputs["k"]) + 1)
    if per_head:
        gen = torch.Generator().manual_seed(4)
        inputs["g"] = torch.nn.functional.logsigmoid(torch.randn(B, H, T, 1, generator=gen) + 3).requires_grad_()
    if state:
        inputs["initial_state"] = (torch.rand(B, H, K, V + 1, generator=torch.Generator().manual_seed(2))).requires_grad_()

    def reference(q, k, v, g, scale, initial_state):
        return gla_parallel(q, k, ops.with_normalizer(v), g, scale, initial_state)

    want = outputs_and_grads(reference, inputs)
    got = outputs_and_grads(partial(chunk_gla_triton, chunk_size=16, normalizer=True), inputs)
    assert got[0].shape[-1] == V + 1 and got[1].shape[-1] == V + 1
    assert_all_close(got, want, rtol=1e-5, atol=1e-4)  # sums of positive features reach ~100


def test_hybrid_model_runs_the_same_on_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window + sinks + Hedgehog GLA layer on the Triton kernels (the [K] normalizer mixed with the window's
    terms, the fused Hedgehog map, the decoding step) gives the PyTorch forms' logits, cached steps and gradients."""
    from conftest import make_tiny_linearize
    from transformers import DynamicCache

    settings = {"window": 8, "sink": 2, "feature_map": "hedgehog", "chunk_size": 16}
    model = make_tiny_linearize(["linear_attention", "full_attention"], settings).train()
    ids = torch.randint(2, 128, (2, 30), generator=torch.Generator().manual_seed(0))

    def run() -> list[torch.Tensor]:
        model.zero_grad()
        logits = model(ids, use_cache=False).logits
        logits.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            steps = [model(ids[:, :27], cache=cache).logits[:, -1]]
            steps += [model(ids[:, t : t + 1], cache=cache).logits[:, -1] for t in range(27, 30)]
        return [logits.detach(), *steps, *grads]

    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    want = run()
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    got = run()
    assert_all_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", RECURRENT_CASES.values(), ids=RECURRENT_CASES.keys())
def test_decoding_step_carries_the_normalizer_vector(case: tuple) -> None:
    """The fused step's [K] normalizer equals the recurrence on a column of ones, its state updated in place."""
    B, HQ, H, T, K, V, decay, state = case
    inputs = make_inputs(B, HQ, H, T, K, V, decay=decay, state=False)
    q, k, v, g = (None if x is None else x.detach() for x in list(inputs.values())[:4])
    h0 = torch.rand(B, H, K, V + 1, generator=torch.Generator().manual_seed(6)) if state else None
    want_o, want_h = gla_recurrent(q, k, ops.with_normalizer(v), g, 0.7, h0, inplace=False)
    cached = None if h0 is None else h0.clone()
    with torch.no_grad():
        o, h = fused_recurrent_gla_triton(q, k, v, g, 0.7, cached, normalizer=True)
    torch.testing.assert_close(o, want_o, **TOL)
    torch.testing.assert_close(h, want_h, **TOL)
    if cached is not None:
        assert h is cached
