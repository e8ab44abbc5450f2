"""Every Triton kernel launch of the library compiled for named NVIDIA GPUs, on a machine without one.

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels) executes their arithmetic but never
their compiler: bf16 operands (the interpreter multiplies them as fp32), register allocation, spills and
shared memory are first met on a GPU. Triton compiles for any target it is told, with the ptxas it
ships, and needs no driver for that. So this runs the library's kernel entry points (GLA's chunked
forward and backward and its decoding step, the delta rule's, the fused feature maps) on CPU tensors
with a stand-in driver that names one GPU at a time: every launch compiles for it and none runs.

Each compiled kernel's shared memory is checked against that GPU's limit per block, as Triton checks it
when it loads a kernel; over it, the stand-in refuses the launch as Triton would, so the library's own
answer (`gla_triton._launch` retries at fewer pipeline stages; the delta rule's scans then at narrower
value tiles and shorter chunks) runs here too. A launch fails the check when it does not compile or
when nothing the library tries fits. Registers and spilled bytes (ptxas's stack and local memory, read
from each cubin with the cuobjdump Triton ships) are reported: spills cost speed, not correctness.
`--autotune` compiles every config the autotuner would time instead of the fixed tiles. `--quick` is the
CI subset (K = V = 64, sm_86 and sm_90: about a minute each with an empty Triton cache, seconds with a
warm one).

    python -m linearize.kernels.compile_check [--quick] [--targets sm_80 ...] [--only TEXT] [--autotune] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """A GPU generation: its compute capability and the shared memory one program may use (opt-in maximum)."""

    capability: int
    shared_limit: int
    gpus: str


TARGETS = {
    "sm_80": Target(80, 166912, "A100, A30"),
    "sm_86": Target(86, 101376, "A10, A40, RTX A6000, RTX 30"),
    "sm_89": Target(89, 101376, "L4, L40S, RTX 40"),
    "sm_90": Target(90, 232448, "H100, H200"),
    "sm_100": Target(100, 232448, "B200"),
    "sm_120": Target(120, 101376, "RTX 50"),
}
QUICK_TARGETS = ("sm_86", "sm_90")
FIXED_STAGES = 3  # Triton's default pipeline depth, where a fixed-tile launch starts
REGISTERS_PER_BLOCK = 65536
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Compiled:
    """One kernel as compiled for one target, with the case that first launched it."""

    target: str
    kernel: str
    case: str
    constants: dict[str, Any]
    warps: int
    stages: int
    shared: int
    registers: int
    spilled: int  # bytes per thread in ptxas's stack and local memory
    seconds: float
    fits: bool  # its shared memory and registers within the target's limits


@dataclass
class CaseResult:
    target: str
    case: str
    passed: bool
    error: str | None = None


class _CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: reports `target` as the current GPU, so a launch compiles for it.
    Each target has its own device number, so Triton's per-device kernel caches never mix targets."""

    def __init__(self, name: str, target: Target) -> None:
        from triton.backends.compiler import GPUTarget

        self.gpu = GPUTarget("cuda", target.capability, 32)
        self.device = 1000 + list(TARGETS).index(name)

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.gpu


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, spilled bytes per thread) of a compiled kernel, from cuobjdump's resource usage."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
    found = {key: int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    if "REG" not in found:
        raise RuntimeError(f"cuobjdump printed no register count: {usage.strip()!r}")
    return found["REG"], found.get("STACK", 0) + found.get("LOCAL", 0)


@contextmanager
def compiling_for(name: str, record: Callable[[Any, str, float], None]) -> Iterator[None]:
    """Within: every Triton launch compiles for target `name` and does not run; `record(kernel, function name,
    seconds)` sees each compiled kernel and raises OutOfResources, as loading it would, for one that does not fit.

    An autotuned launch (`LINEARIZE_AUTOTUNE=1`) compiles every config its pruning keeps, as the autotuner
    would before timing them. The autotuner skips a config the GPU refuses, so the launch fits when one of
    them does; when none does, the autotuner launches its first config anyway, and that refusal is raised.
    """
    import triton
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    original = JITFunction.run, Autotuner.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        started = time.perf_counter()
        kernel = original[0](self, *args, grid=grid, warmup=True, **kwargs)
        record(kernel, self.__name__, time.perf_counter() - started)
        return kernel

    def compile_every_config(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        fitting, refusal = None, None
        try:
            for config in self.prune_configs(kwargs):
                try:
                    kernel = self.fn.run(*args, **kwargs, **config.all_kwargs())
                except triton.runtime.errors.OutOfResources as err:
                    refusal = refusal or err
                else:
                    fitting = fitting or kernel
        finally:
            self.nargs = None
        if fitting is None:
            raise refusal
        return fitting

    drivers = triton.runtime.driver
    previous = drivers._active  # None until a real driver was asked for: none may exist here
    drivers.set_active(_CompileOnlyDriver(name, TARGETS[name]))
    JITFunction.run, Autotuner.run = compile_only, compile_every_config
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = original
        drivers._active = previous


@dataclass(frozen=True)
class Plan:
    key_dims: tuple[int, ...]
    value_dims: tuple[int, ...]
    seq_len: int = 128
    heads: tuple[int, int, int] = (1, 4, 2)  # B, query heads, key/value heads: GQA groups of 2
    feature_dims: tuple[int, ...] = (64, 128)  # Hedgehog head dims and features; Performer features


FULL = Plan(key_dims=(64, 128, 256), value_dims=(64, 128))
QUICK = Plan(key_dims=(64,), value_dims=(64,), feature_dims=(64,))


def _placeholder(*shape: int, dtype: torch.dtype, grad: bool = False) -> torch.Tensor:
    """Placeholder inputs: nothing runs, so only shapes, dtypes and alignment matter."""
    return torch.zeros(*shape, dtype=dtype).requires_grad_(grad)


def _backward(outputs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> None:
    torch.autograd.grad(outputs, inputs, [torch.zeros_like(x) for x in outputs])


def cases(plan: Plan) -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, run) for every launch family: each run calls one entry point, forward and backward where it has one."""
    from .delta_triton import chunk_delta_triton, fused_recurrent_delta_triton
    from .feature_maps_triton import hedgehog_triton, performer_triton
    from .gla_triton import chunk_gla_triton, fused_recurrent_gla_triton

    B, HQ, H = plan.heads
    T = plan.seq_len
    for dtype_name, dtype in DTYPES.items():
        for K in plan.key_dims:
            for V in plan.value_dims:
                shape = f"{dtype_name} K={K} V={V}"
                variants = [("channel", False, torch.float32), ("head", False, torch.float32), ("none", False, torch.float32),
                            ("channel", True, torch.float32)]  # fmt: skip
                if dtype == torch.bfloat16:
                    variants.append(("channel", True, torch.bfloat16))
                for decay, normalizer, state_dtype in variants:
                    label = f"gla-chunk {shape} decay={decay}" + " normalizer" * normalizer
                    label += " bf16-state" * (state_dtype == torch.bfloat16)

                    def gla_chunk(decay=decay, normalizer=normalizer, state_dtype=state_dtype, K=K, V=V, dtype=dtype):
                        q, k = _placeholder(B, HQ, T, K, dtype=dtype, grad=True), _placeholder(B, H, T, K, dtype=dtype, grad=True)
                        v = _placeholder(B, H, T, V, dtype=dtype, grad=True)
                        g = None if decay == "none" else _placeholder(B, H, T, K if decay == "channel" else 1, dtype=torch.float32, grad=True)
                        h0 = _placeholder(B, H, K, V + normalizer, dtype=torch.float32, grad=True)
                        o, ht = chunk_gla_triton(q, k, v, g, K**-0.5, h0, state_dtype=state_dtype, normalizer=normalizer)
                        _backward((o, ht), [x for x in (q, k, v, g, h0) if x is not None])

                    yield label, gla_chunk
                for normalizer in (False, True):

                    def gla_step(normalizer=normalizer, K=K, V=V, dtype=dtype):
                        with torch.no_grad():
                            q, k = _placeholder(B, HQ, 1, K, dtype=dtype), _placeholder(B, H, 1, K, dtype=dtype)
                            state = _placeholder(B, H, K, V + normalizer, dtype=torch.float32)
                            fused_recurrent_gla_triton(q, k, _placeholder(B, H, 1, V, dtype=dtype), _placeholder(B, H, 1, K, dtype=torch.float32),
                                                       K**-0.5, state, normalizer=normalizer)  # fmt: skip

                    yield f"gla-step {shape}" + " normalizer" * normalizer, gla_step
                for decay in ("channel", "head"):

                    def delta_chunk(decay=decay, K=K, V=V, dtype=dtype):
                        q, k = _placeholder(B, HQ, T, K, dtype=dtype, grad=True), _placeholder(B, H, T, K, dtype=dtype, grad=True)
                        v, beta = _placeholder(B, H, T, V, dtype=dtype, grad=True), _placeholder(B, H, T, dtype=dtype, grad=True)
                        g = _placeholder(B, H, T, K if decay == "channel" else 1, dtype=torch.float32, grad=True)
                        h0 = _placeholder(B, H, K, V, dtype=torch.float32, grad=True)
                        o, ht = chunk_delta_triton(q, k, v, beta, g, K**-0.5, h0)
                        _backward((o, ht), [q, k, v, beta, g, h0])

                    yield f"delta-chunk {shape} decay={decay}", delta_chunk

                def delta_step(K=K, V=V, dtype=dtype):
                    with torch.no_grad():
                        q, k = _placeholder(B, HQ, 1, K, dtype=dtype), _placeholder(B, H, 1, K, dtype=dtype)
                        v, beta = _placeholder(B, H, 1, V, dtype=dtype), _placeholder(B, H, 1, dtype=dtype)
                        fused_recurrent_delta_triton(q, k, v, beta, _placeholder(B, H, 1, K, dtype=torch.float32), K**-0.5,
                                                     _placeholder(B, H, K, V, dtype=torch.float32))  # fmt: skip

                yield f"delta-step {shape}", delta_step
        for D in plan.feature_dims:

            def hedgehog(D=D, dtype=dtype):
                x = _placeholder(B, H, T, D, dtype=dtype, grad=True)
                weight, bias = _placeholder(H, D, D, dtype=dtype, grad=True), _placeholder(H, D, dtype=dtype, grad=True)
                _backward((hedgehog_triton(x, weight, bias),), [x, weight, bias])

            def performer(M=D, dtype=dtype):
                logits, stabilizer = _placeholder(B, H, T, M, dtype=dtype, grad=True), _placeholder(B, H, T, 1, dtype=dtype, grad=True)
                _backward((performer_triton(logits, stabilizer),), [logits, stabilizer])

            yield f"hedgehog {dtype_name} D=F={D}", hedgehog
            yield f"performer {dtype_name} M={D}", performer


class _Recorder:
    """Keeps each kernel compiled for one target once (with the case that first launched it) and refuses, as
    loading it on that GPU would, a launch whose shared memory or registers the GPU cannot hold."""

    def __init__(self, name: str) -> None:
        self.name, self.target, self.case = name, TARGETS[name], ""
        self.kernels: dict[str, Compiled] = {}

    def __call__(self, kernel: Any, function: str, seconds: float) -> None:
        import triton

        meta = kernel.metadata
        if meta.hash not in self.kernels:
            registers, spilled = resources(kernel.asm["cubin"])
            per_block = -(-registers // 8) * 8 * meta.num_warps * 32  # allocated in units of 8 per thread
            names = kernel.src.fn.arg_names
            constants = {names[path[0]]: value for path, value in kernel.src.constants.items() if len(path) == 1}
            constants = {k: v if isinstance(v, (int, float, bool, str)) else str(v) for k, v in constants.items()}
            fits = meta.shared <= self.target.shared_limit and per_block <= REGISTERS_PER_BLOCK
            self.kernels[meta.hash] = Compiled(self.name, function, self.case, constants, meta.num_warps, meta.num_stages,
                                               meta.shared, registers, spilled, seconds, fits)  # fmt: skip
        entry = self.kernels[meta.hash]
        if entry.shared > self.target.shared_limit:
            raise triton.runtime.errors.OutOfResources(entry.shared, self.target.shared_limit, "shared memory")
        if not entry.fits:
            raise triton.runtime.errors.OutOfResources(entry.registers * entry.warps * 32, REGISTERS_PER_BLOCK, "registers")


def check(targets: tuple[str, ...], plan: Plan, only: str | None = None) -> tuple[list[Compiled], list[CaseResult]]:
    """Every case (whose name contains `only`, if given) compiled for every target: the kernels compiled (once
    each) and each case's verdict."""
    from . import delta_triton, gla_triton

    all_cases = [(case, run) for case, run in cases(plan) if only is None or only in case]
    if not all_cases:
        raise ValueError(
            f"no case name contains {only!r}: names read like 'gla-chunk bf16 K=64 V=64 decay=channel', "
            "'delta-step fp32 K=128 V=64', 'hedgehog bf16 D=F=64'"
        )
    compiled: list[Compiled] = []
    results: list[CaseResult] = []
    for name in targets:
        recorder = _Recorder(name)
        gla_triton._fallbacks.clear()  # what an earlier target refused: each target starts as a fresh process would
        delta_triton._chunk_lens.clear()
        with compiling_for(name, recorder):
            for case, run in tqdm(all_cases, desc=f"compiling for {name}", disable=bool(os.environ.get("LINEARIZE_NO_PROGRESS"))):
                recorder.case = case
                try:
                    run()
                    results.append(CaseResult(name, case, True))
                except Exception as err:  # recorded: the other cases and targets still run
                    logger.warning("%s, %s: %s", name, case, err)
                    results.append(CaseResult(name, case, False, f"{type(err).__name__}: {err}"))
        compiled += recorder.kernels.values()
        passed = sum(r.passed for r in results if r.target == name)
        logger.info("%s: %d kernels compiled, %d of %d cases passed", name, len(recorder.kernels), passed, len(all_cases))
    return compiled, results


def summary(
    compiled: list[Compiled], results: list[CaseResult], targets: tuple[str, ...], default_stages: int = FIXED_STAGES
) -> list[dict[str, Any]]:
    """One row per target: kernels, cases passed, the widest shared memory launched, refusals, spills.
    `default_stages` is the depth a launch starts at: Triton's 3 for fixed tiles, the tuned configs' deepest."""
    rows = []
    for name in targets:
        mine = [c for c in compiled if c.target == name]
        launched = [c for c in mine if c.fits]
        rows.append({
            "target": name,
            "gpus": TARGETS[name].gpus,
            "shared_limit": TARGETS[name].shared_limit,
            "kernels": len(mine),
            "cases_passed": sum(r.passed for r in results if r.target == name),
            "cases": sum(r.target == name for r in results),
            "max_shared_launched": max((c.shared for c in launched), default=0),
            "refused": sorted({c.kernel for c in mine if not c.fits}),  # at some depth, for some case
            "launched_shallower": sum(c.stages < default_stages for c in launched),
            "max_registers": max((c.registers for c in mine), default=0),
            "spilling": sorted({c.kernel for c in launched if c.spilled}),
            "max_spilled": max((c.spilled for c in launched), default=0),
        })  # fmt: skip
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m linearize.kernels.compile_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"K = V = 64 for {' and '.join(QUICK_TARGETS)} only (CI)")
    p.add_argument("--targets", nargs="+", choices=list(TARGETS), help="GPU generations (default: all)")
    p.add_argument("--only", metavar="TEXT", help="only the cases whose name contains TEXT (e.g. 'delta-chunk bf16')")
    p.add_argument(
        "--autotune",
        action="store_true",
        help="compile every config LINEARIZE_AUTOTUNE=1 would time instead of the fixed tiles (a launch fits if one does)",
    )
    p.add_argument("--out", type=Path, default=Path("out/compile_check"), help="folder for compile_check.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ["LINEARIZE_AUTOTUNE"] = "1" if args.autotune else "0"  # read when the kernels are imported
    try:
        import triton

        from . import gla_triton
    except ImportError as err:
        print(f"compile_check: error: triton is not importable ({err}): pip install triton", file=sys.stderr)
        return 2
    if gla_triton._interpreting():
        print("compile_check: error: TRITON_INTERPRET is set, so nothing would compile: unset it", file=sys.stderr)
        return 2
    targets = tuple(args.targets or (QUICK_TARGETS if args.quick else TARGETS))
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    try:
        compiled, results = check(targets, plan, args.only)
    except ValueError as err:
        print(f"compile_check: error: {err}", file=sys.stderr)
        return 2
    rows = summary(compiled, results, targets, gla_triton.STAGES if args.autotune else FIXED_STAGES)
    passed = all(r.passed for r in results)
    report = {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "plan": asdict(plan),
        "autotune": args.autotune,
        "passed": passed,
        "seconds": time.perf_counter() - started,
        "targets": rows,
        "failures": [asdict(r) for r in results if not r.passed],
        "kernels": [asdict(c) for c in compiled],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "compile_check.json"
    path.write_text(json.dumps(report, indent=1))
    _print(rows, report, path)
    return 0 if passed else 1


def _print(rows: list[dict[str, Any]], report: dict[str, Any], path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    tiles = "every autotuned config" if report["autotune"] else "fixed tiles"
    table = Table(title=f"Triton kernels compiled per GPU ({tiles}, triton {report['triton']}, {report['seconds']:.0f} s)")
    for column in ("target", "GPUs", "kernels", "cases passed", "widest launched / limit (KB)", "kernels refused",
                   "launched shallower", "max regs", "spilling kernels", "max spill (B/thread)"):  # fmt: skip
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["target"], row["gpus"], str(row["kernels"]), f"{row['cases_passed']}/{row['cases']}",
            f"{row['max_shared_launched'] / 1024:.1f} / {row['shared_limit'] / 1024:.0f}", str(len(row["refused"])),
            str(row["launched_shallower"]), str(row["max_registers"]), str(len(row["spilling"])), str(row["max_spilled"]),
        )  # fmt: skip
    console.print(table)
    for failure in report["failures"]:
        console.print(f"FAILED {failure['target']}, {failure['case']}: {failure['error']}")
    console.print(f"{'PASSED' if report['passed'] else 'FAILED'}; wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
