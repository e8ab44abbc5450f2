"""The Triton kernels' launches as a GPU runs them, checked under the interpreter: every tile, no stray access, no race.

Tiles: on a GPU the autotuner (LINEARIZE_AUTOTUNE=1) times each config of BK / BV several times on the
real buffers. Fixed tiles are the default (on an H200 tuning stopped with an illegal memory access,
docs/gpu.md), so these configs never run in the other tests. Here each one must give the
reference result, with every tuned launch repeated as a timing rerun repeats it, and must neither write
outside its buffers nor read past them: each launch runs on copies of its tensors' storages fenced by
0xFF bytes (a NaN in every float dtype), so a stray read turns the result NaN and a stray write shows in
the fence. The kernels without tiles to tune (the decoding steps, the feature maps, the scans' later
passes) run fenced too.

Races: the interpreter runs a grid's programs one after another, a GPU runs them at once in no order.
So no program may read or write an address that another program of the same launch writes; every
load and store is logged with its program to check that.

Devices: Triton launches on the current CUDA device, so every launch must run inside `_device_guard`
of its inputs (a layer on cuda:1 while cuda:0 is current); a launch outside one is named too.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from test_kernels_delta import make_inputs as delta_inputs  # noqa: E402
from test_kernels_delta import outputs_and_grads as delta_outputs_and_grads  # noqa: E402
from test_kernels_triton import assert_all_close, make_inputs, outputs_and_grads  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from linearize.kernels import delta_triton, feature_maps, feature_maps_triton, gla_triton  # noqa: E402
from linearize.kernels.delta_torch import delta_recurrent  # noqa: E402
from linearize.kernels.gla_torch import gla_parallel, gla_recurrent  # noqa: E402

if not isinstance(gla_triton._fwd_state_kernel, InterpretedFunction):
    pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

FENCE = 4096  # bytes of 0xFF on each side of every storage a launch sees
RERUNS = 2  # launches of each tuned kernel per call, as the autotuner's timing runs launch it


def _fenced(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Views of `tensors` into copies of their storages with FENCE bytes of 0xFF on each side (views of one
    storage stay views of one copy), and the (storage bytes, copy) pairs to check and copy back."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    views = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in copies:
            original = torch.empty(0, dtype=torch.uint8).set_(storage)
            copy = torch.full((storage.nbytes() + 2 * FENCE,), 0xFF, dtype=torch.uint8)
            copy[FENCE : FENCE + storage.nbytes()] = original
            copies[storage.data_ptr()] = (original, copy)
        inside = copies[storage.data_ptr()][1][FENCE : FENCE + storage.nbytes()].view(tensor.dtype)
        offset = inside.storage_offset() + tensor.storage_offset()
        views.append(inside.as_strided(tensor.shape, tensor.stride(), offset))
    return views, list(copies.values())


class CheckedLaunches:
    """Wraps every interpreted launch: it runs on fenced copies of its tensors (`crossed` names each launch that
    wrote into a fence), each program's loads and stores are logged (`races` names each launch in which a
    program reads or writes an address that another program of the launch writes: a GPU orders neither), and
    `unguarded` names each launch made outside the kernels' device guard."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.crossed: list[str] = []
        self.races: list[str] = []
        self.unguarded: list[str] = []
        self.launched: set[str] = set()
        self._guards = 0
        guard = gla_triton._device_guard

        @contextlib.contextmanager
        def counted_guard(x: torch.Tensor) -> Iterator[None]:
            with guard(x):
                self._guards += 1
                try:
                    yield
                finally:
                    self._guards -= 1

        for module in (gla_triton, delta_triton, feature_maps_triton):
            monkeypatch.setattr(module, "_device_guard", counted_guard)
        self._reads: list[tuple[int, np.ndarray]] = []
        self._writes: list[tuple[int, np.ndarray]] = []
        builder = interpreter.interpreter_builder
        load, store, run = builder.create_masked_load, builder.create_masked_store, interpreter.GridExecutor.__call__

        def program() -> int:
            (x, y, z), (nx, ny, _) = builder.grid_idx, builder.grid_dim
            return x + nx * (y + ny * z)

        def addresses(ptrs: Any, mask: Any) -> np.ndarray:
            where = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data))
            return np.asarray(ptrs.data)[where].astype(np.int64)

        def logged_load(ptrs, mask, *args):
            self._reads.append((program(), addresses(ptrs, mask)))
            return load(ptrs, mask, *args)

        def logged_store(ptrs, value, mask, *args):
            self._writes.append((program(), addresses(ptrs, mask)))
            return store(ptrs, value, mask, *args)

        def checked_run(executor, *args, **kwargs):
            name = executor.fn.__name__
            self.launched.add(name)
            if not self._guards:
                self.unguarded.append(name)
            views, copies = _fenced([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
            fenced = iter(views)
            args = [next(fenced) if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: next(fenced) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            self._reads, self._writes = [], []
            out = run(executor, *args, **kwargs)
            self._check_races(name)
            for original, copy in copies:
                size = original.numel()
                crossed = int((copy[:FENCE] != 0xFF).sum() + (copy[FENCE + size :] != 0xFF).sum())
                if crossed:
                    self.crossed.append(f"{name}: {crossed} bytes written outside a {size}-byte storage")
                original.copy_(copy[FENCE : FENCE + size])
            return out

        monkeypatch.setattr(builder, "create_masked_load", logged_load)
        monkeypatch.setattr(builder, "create_masked_store", logged_store)
        monkeypatch.setattr(interpreter.GridExecutor, "__call__", checked_run)

    @staticmethod
    def _table(log: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, programs), one row per access."""
        if not log:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate([a for _, a in log]), np.concatenate([np.full(len(a), p) for p, a in log])

    def _check_races(self, name: str) -> None:
        written, writers = self._table(self._writes)
        if not len(written):
            return
        written, writers = np.unique(np.stack([written, writers]), axis=1)  # one row per (address, program)
        shared = int((np.unique(written, return_counts=True)[1] > 1).sum())
        read, readers = self._table(self._reads)
        at = np.minimum(np.searchsorted(written, read), len(written) - 1)
        crossed = int(((written[at] == read) & (writers[at] != readers)).sum())
        if shared or crossed:
            self.races.append(
                f"{name}: {shared} addresses written by several programs, {crossed} reads of another's writes"
            )

    def assert_clean(self) -> None:
        assert self.crossed == [], "\n".join(self.crossed)
        assert self.races == [], "\n".join(self.races)
        assert self.unguarded == [], f"launched outside the device guard: {sorted(set(self.unguarded))}"


def _force(monkeypatch: pytest.MonkeyPatch, tiles: dict[str, int]) -> CheckedLaunches:
    """Every launch checked, and `tiles` forced onto every `_launch` (each kernel it launches is a tuned one, and the
    names in its `tiles` are the ones that kernel tunes), which launches RERUNS times as the autotuner's timing does."""
    launch, chosen = gla_triton._launch, tiles

    def forced(kernel: Any, grid: Any, *args: Any, tiles: dict[str, int], **meta: Any) -> None:
        for _ in range(RERUNS):
            launch(kernel, grid, *args, tiles={tile: chosen[tile] for tile in tiles}, **meta)

    for module in (gla_triton, delta_triton):
        monkeypatch.setattr(module, "_launch", forced)
    return CheckedLaunches(monkeypatch)


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
    launches.assert_clean()
    assert GLA_KERNELS <= launches.launched
    assert_all_close(got, want)


def test_chunked_gla_at_the_widest_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """K = V = 128 lets the autotuner try 128-wide tiles: one mixed with the narrowest, 3 chunks of 16 in 2 segments."""
    inputs = make_inputs(1, 2, 1, 40, 128, 128, decay=True, state=True)
    want = outputs_and_grads(gla_parallel, inputs)
    monkeypatch.setattr(gla_triton, "_segment_len", lambda N, programs: 2)
    launches = _force(monkeypatch, {"BK": 128, "BV": 32})
    got = outputs_and_grads(lambda *a: gla_triton.chunk_gla_triton(*a, chunk_size=16), inputs)
    launches.assert_clean()
    assert_all_close(got, want)


@pytest.mark.parametrize("tiles, decay", _cases(["channel", "head", "channel", "head"]))
def test_chunked_delta_rule_at_every_tile(tiles: dict[str, int], decay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta rule's own tuned kernels and GLA's that it reuses, against the recurrence."""
    inputs = delta_inputs(1, 2, 1, 45, 64, 64, decay=decay, state=True)
    want = delta_outputs_and_grads(delta_recurrent, inputs, scale=0.8)
    launches = _force(monkeypatch, tiles)
    got = delta_outputs_and_grads(delta_triton.chunk_delta_triton, inputs, scale=0.8, chunk_size=16)
    launches.assert_clean()
    assert DELTA_KERNELS <= launches.launched
    assert_all_close(got, want)


def test_the_fence_catches_a_stray_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch whose output (passed by name) is shorter than T rows writes into the fence, and is caught."""
    launches = CheckedLaunches(monkeypatch)
    g, gc = torch.zeros(1, 1, 32, 64), torch.zeros(1, 1, 16, 64)
    gla_triton._chunk_cumsum_kernel[(1, 2, 1)](g, gc=gc, T=32, K=64, BT=16, BK=64)
    assert launches.crossed == ["_chunk_cumsum_kernel: 4096 bytes written outside a 4096-byte storage"]
    assert launches.unguarded == ["_chunk_cumsum_kernel"], "a launch made directly, outside any device guard"


def test_steps_and_feature_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels outside the chunked forms, fenced and logged: both decoding steps with GQA (a query group
    shares the state each updates) and the fused feature maps, forward and backward, against their references."""
    gla = {n: x.detach() for n, x in make_inputs(1, 4, 2, 2, 64, 64, decay=True, state=True).items()}
    delta = {n: x.detach() for n, x in delta_inputs(1, 4, 2, 2, 64, 64, decay="channel", state=True).items()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 20, generator=gen).requires_grad_()
    weight = (torch.randn(3, 20, 24, generator=gen) * 0.3).requires_grad_()
    bias = torch.randn(3, 24, generator=gen).requires_grad_()
    logits = torch.randn(2, 3, 40, 37, generator=gen).requires_grad_()
    stabilizer = torch.randn(2, 3, 40, 1, generator=gen).requires_grad_()

    def run(step_gla, step_delta) -> list[torch.Tensor]:
        state = gla["initial_state"].clone()
        outputs = [step_gla(gla["q"], gla["k"], gla["v"], gla["g"], 0.7, state)[0], state]
        outputs += step_delta(**dict(delta, initial_state=delta["initial_state"].clone()), scale=0.8)
        outputs += torch.autograd.grad(feature_maps.hedgehog(x, weight, bias).pow(2).sum(), [x, weight, bias])
        performer = feature_maps.performer(logits, stabilizer).pow(2).sum()
        return outputs + list(torch.autograd.grad(performer, [logits, stabilizer]))

    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    want = run(gla_recurrent, delta_recurrent)
    monkeypatch.setenv("LINEARIZE_KERNELS", "triton")
    launches = CheckedLaunches(monkeypatch)
    got = run(gla_triton.fused_recurrent_gla_triton, delta_triton.fused_recurrent_delta_triton)
    assert_all_close(got, want)
    launches.assert_clean()
    assert launches.launched == {
        "_fused_recurrent_kernel", "_fused_recurrent_delta_kernel", "_hedgehog_fwd_kernel", "_hedgehog_bwd_kernel",
        "_performer_kernel",
    }  # fmt: skip


@triton.jit
def _neighbour_kernel(x, last):
    """Each of two programs adds one to the other's element and writes its own id to one shared slot: a race."""
    i = tl.program_id(0)
    tl.store(x + i, tl.load(x + 1 - i) + 1.0)
    tl.store(last, i)


def test_the_log_catches_a_race(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = CheckedLaunches(monkeypatch)
    _neighbour_kernel[(2,)](torch.zeros(2), torch.zeros(1, dtype=torch.int32))
    assert launches.races == ["_neighbour_kernel: 1 addresses written by several programs, 2 reads of another's writes"]
