"""Every tile the autotuner may pick (LINEARIZE_AUTOTUNE=1), forced on every tuned kernel under Triton's interpreter.

On a GPU the autotuner times each config of BK / BV several times on the real buffers. Fixed tiles are the
default (on an H200 tuning once stopped with an illegal memory access, README "GPU check"), so these
configs never run in the other tests. Here each one must give the reference result, with every tuned
launch repeated as a timing rerun repeats it, and must neither write outside its buffers nor read past
them: each launch runs on copies of its tensors' storages fenced by 0xFF bytes (a NaN in every float
dtype), so a stray read turns the result NaN and a stray write shows in the fence.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
from test_kernels_delta import make_inputs as delta_inputs  # noqa: E402
from test_kernels_delta import outputs_and_grads as delta_outputs_and_grads  # noqa: E402
from test_kernels_triton import assert_all_close, make_inputs, outputs_and_grads  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from linearize.kernels import delta_triton, gla_triton  # noqa: E402
from linearize.kernels.delta_torch import delta_recurrent  # noqa: E402
from linearize.kernels.gla_torch import gla_parallel  # noqa: E402

if not isinstance(gla_triton._fwd_state_kernel, InterpretedFunction):
    pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

FENCE = 4096  # bytes of 0xFF on each side of every storage a launch sees
RERUNS = 2  # launches of each tuned kernel per call, as the autotuner's timing runs launch it


class FencedLaunches:
    """Stands in for `gla_triton._launch`: forces `tiles` onto every launch (each launched kernel is a tuned one,
    and the names in `tiles` are the ones it tunes) and runs each on fenced copies, recording what crossed a fence."""

    def __init__(self, tiles: dict[str, int]) -> None:
        self.tiles = tiles
        self.launched: set[str] = set()
        self.crossed: list[str] = []
        self._launch = gla_triton._launch

    def __call__(self, kernel: Any, grid: Any, *args: Any, tiles: dict[str, int], **meta: Any) -> None:
        name = kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)
        self.launched.add(name)
        fenced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage address -> (its bytes, the fenced copy)
        views = []
        for arg in args:
            if not isinstance(arg, torch.Tensor):
                views.append(arg)
                continue
            storage = arg.untyped_storage()
            if storage.data_ptr() not in fenced:
                original = torch.empty(0, dtype=torch.uint8).set_(storage)
                copy = torch.full((storage.nbytes() + 2 * FENCE,), 0xFF, dtype=torch.uint8)
                copy[FENCE : FENCE + storage.nbytes()] = original
                fenced[storage.data_ptr()] = (original, copy)
            copy = fenced[storage.data_ptr()][1]
            inside = copy[FENCE : FENCE + storage.nbytes()].view(arg.dtype)
            views.append(inside.as_strided(arg.shape, arg.stride(), inside.storage_offset() + arg.storage_offset()))
        forced = {tile: self.tiles[tile] for tile in tiles}
        for _ in range(RERUNS):
            self._launch(kernel, grid, *views, tiles=forced, **meta)
        for original, copy in fenced.values():
            crossed = int((copy[:FENCE] != 0xFF).sum() + (copy[FENCE + original.numel() :] != 0xFF).sum())
            if crossed:
                size = original.numel()
                self.crossed.append(f"{name} {forced}: {crossed} bytes written outside a {size}-byte storage")
            original.copy_(copy[FENCE : FENCE + original.numel()])


def _force(monkeypatch: pytest.MonkeyPatch, tiles: dict[str, int]) -> FencedLaunches:
    launches = FencedLaunches(tiles)
    for module in (gla_triton, delta_triton):
        monkeypatch.setattr(module, "_launch", launches)
    return launches


# K = V = 64: the autotuner keeps BK, BV in {32, 64} (`_fitting_tiles`); each config meets one kind of decay.
CONFIGS = [dict(zip(("BK", "BV"), tiles)) for tiles in itertools.product((32, 64), repeat=2)]


def _cases(modes: list[str]) -> list:
    return [pytest.param(c, m, id=f"BK{c['BK']}-BV{c['BV']}-{m}") for c, m in zip(CONFIGS, modes, strict=True)]

GLA_KERNELS = {
    "_fwd_state_kernel", "_fwd_output_kernel", "_bwd_dstate_kernel", "_bwd_dscores_kernel", "_bwd_dv_kernel",
    "_bwd_inter_kernel",
}  # fmt: skip
DELTA_KERNELS = {"_ut_fwd_kernel", "_delta_state_kernel", "_dv_local_kernel", "_delta_dstate_kernel", "_ut_bwd_kernel"}


@pytest.mark.parametrize("tiles, mode", _cases(["channel+normalizer", "head", "none", "channel"]))
def test_chunked_gla_at_every_tile(tiles: dict[str, int], mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """o, the final state and every gradient: 3 chunks of 32 in 2 segments, GQA, with an initial state."""
    decay, normalizer = mode.removesuffix("+normalizer"), mode.endswith("+normalizer")
    inputs = make_inputs(1, 2, 1, 70, 64, 64, decay=decay != "none", state=True)
    if decay == "head":
        inputs["g"] = inputs["g"].detach()[..., :1].requires_grad_()
    reference_inputs = dict(inputs)
    if normalizer:  # the [K] normalizer beside the state is a value column of ones (`ops.with_normalizer`)
        state = torch.cat([inputs["initial_state"].detach(), torch.rand(1, 1, 64, 1)], -1)
        inputs["initial_state"] = state.requires_grad_()
        reference_inputs = dict(inputs, v=torch.cat([inputs["v"], torch.ones(1, 1, 70, 1)], -1))
    want = outputs_and_grads(gla_parallel, reference_inputs)
    if normalizer:
        want[4] = want[4][..., :-1]  # dv: the ones column's share is not v's
    monkeypatch.setattr(gla_triton, "_segment_len", lambda N, programs: 2)
    launches = _force(monkeypatch, tiles)
    got = outputs_and_grads(lambda *a: gla_triton.chunk_gla_triton(*a, chunk_size=32, normalizer=normalizer), inputs)
    assert launches.crossed == [], "\n".join(launches.crossed)
    assert GLA_KERNELS <= launches.launched
    assert_all_close(got, want)


@pytest.mark.parametrize("tiles, decay", _cases(["channel", "head", "channel", "head"]))
def test_chunked_delta_rule_at_every_tile(tiles: dict[str, int], decay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta rule's own tuned kernels and GLA's that it reuses, against the recurrence."""
    inputs = delta_inputs(1, 2, 1, 45, 64, 64, decay=decay, state=True)
    want = delta_outputs_and_grads(delta_recurrent, inputs, scale=0.8)
    launches = _force(monkeypatch, tiles)
    got = delta_outputs_and_grads(delta_triton.chunk_delta_triton, inputs, scale=0.8, chunk_size=16)
    assert launches.crossed == [], "\n".join(launches.crossed)
    assert DELTA_KERNELS <= launches.launched
    assert_all_close(got, want)


def test_the_fence_catches_a_stray_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch whose output is shorter than T rows writes into the fence, and is caught."""
    launches = _force(monkeypatch, {"BK": 64, "BV": 64})
    g, gc = torch.zeros(1, 1, 32, 64), torch.zeros(1, 1, 16, 64)
    launches(gla_triton._chunk_cumsum_kernel, lambda t: (1, 2, 1), g, gc, 32, tiles={"BK": 64}, K=64, BT=16)
    assert launches.crossed == ["_chunk_cumsum_kernel {'BK': 64}: 4096 bytes written outside a 4096-byte storage"]
