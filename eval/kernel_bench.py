"""Kernel benchmark: chunked GLA against causal softmax attention (SDPA), and the decode step.

Prefill: forward, and forward + backward, of `gated_linear_attention(mode="chunk")` (Triton on CUDA,
PyTorch on CPU) against `scaled_dot_product_attention(is_causal=True)` with the same GQA layout,
and fla's `chunk_gla` when `fla` is importable on CUDA. Decode: one token against a state prefilled
with T tokens (`mode="recurrent"`), against one query over a KV cache of T tokens: the state does
not grow with T, the cache does.

Times are medians over repeats after warmup, with CUDA synchronized around each call.

    python -m linearize.eval.kernel_bench [--device cpu] [--seq-lens 1024 2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels.ops import gated_linear_attention, kernel_backend
from ..options import DTYPE_HELP, ListOption, Parser, dtype_name, fail, parse_list

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PrefillRow:
    seq_len: int
    head_dim: int
    method: str
    forward_ms: float
    forward_backward_ms: float | None


@dataclass
class DecodeRow:
    context: int
    method: str
    step_ms: float
    cache_bytes: int


def sync(device: torch.device) -> None:
    """Wait for the device: timings must cover the work, not only its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, repeats: int, interleave: bool = True
) -> dict[str, float]:
    """Median wall time of each fn() in milliseconds.

    Interleaved, the repeats go round-robin so load spikes on a shared machine hit every method alike;
    decode steps are timed back to back instead, or the big KV-cache scan of one method would evict
    the other's few kilobytes of state from cache before every call.
    """
    order = [name for _ in range(repeats) for name in fns] if interleave else [n for n in fns for _ in range(repeats)]
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in order:
        sync(device)
        start = time.perf_counter()
        fns[name]()
        sync(device)
        times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _inputs(args: argparse.Namespace, T: int, D: int, device: torch.device, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(T + D)
    B, HQ, H = args.batch, args.heads, args.kv_heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    g = F.logsigmoid(torch.randn(B, H, T, D, generator=gen) + 4.0).to(device=device, dtype=dtype)
    return {"q": randn(B, HQ, T, D), "k": randn(B, H, T, D), "v": randn(B, H, T, D), "g": g}


def _gla(x: dict, D: int) -> torch.Tensor:
    return gated_linear_attention(x["q"], x["k"], x["v"], x["g"], scale=D**-0.5, mode="chunk")[0]


def _sdpa(x: dict, D: int) -> torch.Tensor:
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True)


def _fla_runner() -> Callable[[dict, int], torch.Tensor] | None:
    """fla's chunk_gla in its [B, T, H, D] layout, with K/V/g repeated to the query heads (no GQA there)."""
    try:
        from fla.ops.gla import chunk_gla
    except ImportError:
        return None
    layout = {"head_first": False} if "head_first" in inspect.signature(chunk_gla).parameters else {}

    def run(x: dict, D: int) -> torch.Tensor:
        return chunk_gla(x["fla_q"], x["fla_k"], x["fla_v"], x["fla_g"], scale=D**-0.5, **layout)[0]

    return run


def _add_fla_layout(x: dict) -> None:
    group = x["q"].shape[1] // x["k"].shape[1]
    x["fla_q"] = x["q"].transpose(1, 2).contiguous()
    for name in ("k", "v", "g"):
        x[f"fla_{name}"] = x[name].repeat_interleave(group, dim=1).transpose(1, 2).contiguous()


def _forward_backward(run: Callable[[dict, int], torch.Tensor], x: dict, D: int, names: tuple[str, ...]) -> Callable[[], None]:
    leaves = {n: x[n].detach().requires_grad_() for n in names}
    inputs = {**x, **leaves}
    probe = torch.randn_like(run({n: t.detach() for n, t in inputs.items()}, D))

    def step() -> None:
        out = run(inputs, D)
        torch.autograd.grad(out, list(leaves.values()), probe)

    return step


def prefill_rows(
    methods: dict[str, tuple[Callable[[dict, int], torch.Tensor], tuple[str, ...]]],
    x: dict,
    T: int,
    D: int,
    device: torch.device,
    warmup: int,
    repeats: int,
    backward: bool = True,
) -> list[PrefillRow]:
    """One row per method on the same inputs: forward in inference mode, then forward + backward.

    `methods` maps a name to (run(x, D) -> output, the names in x it differentiates).
    """
    with torch.inference_mode():
        fwd = time_calls({name: partial(run, x, D) for name, (run, _) in methods.items()}, device, warmup, repeats)
    fwd_bwd: dict[str, float | None] = dict.fromkeys(methods)
    if backward:
        steps = {name: _forward_backward(run, x, D, names) for name, (run, names) in methods.items()}
        fwd_bwd.update(time_calls(steps, device, warmup, repeats))
    return [PrefillRow(T, D, name, fwd[name], fwd_bwd[name]) for name in methods]


def bench_prefill(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[PrefillRow]:
    methods: dict[str, tuple[Callable, tuple[str, ...]]] = {
        f"gla-chunk/{kernel_backend(device)}": (_gla, ("q", "k", "v", "g")),
        "sdpa-causal": (_sdpa, ("q", "k", "v")),
    }
    fla = _fla_runner() if device.type == "cuda" else None
    if fla is not None:
        methods["fla-chunk_gla"] = (fla, ("fla_q", "fla_k", "fla_v", "fla_g"))
    rows = []
    for D in args.head_dims:
        for T in args.seq_lens:
            x = _inputs(args, T, D, device, dtype)
            if fla is not None:
                _add_fla_layout(x)
            rows.extend(prefill_rows(methods, x, T, D, device, args.warmup, args.repeats, not args.no_backward))
            del x
    return rows


def bench_decode(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[DecodeRow]:
    """One new token after T: GLA reads and updates a [K, V] state per head, SDPA reads a cache of T keys and values."""
    D = args.head_dims[0]
    B, H = args.batch, args.kv_heads
    rows = []
    for T in args.decode_contexts:
        x = _inputs(args, T + 1, D, device, dtype)
        past = {n: t[:, :, :T] for n, t in x.items()}
        new = {n: t[:, :, T:].contiguous() for n, t in x.items()}
        with torch.inference_mode():
            _, state = gated_linear_attention(
                past["q"], past["k"], past["v"], past["g"], scale=D**-0.5, mode="chunk"
            )

            def gla_step() -> torch.Tensor:
                return gated_linear_attention(
                    new["q"], new["k"], new["v"], new["g"], scale=D**-0.5, initial_state=state, mode="recurrent"
                )[0]

            k_cache, v_cache = x["k"].contiguous(), x["v"].contiguous()

            def sdpa_step() -> torch.Tensor:
                return F.scaled_dot_product_attention(new["q"], k_cache, v_cache, enable_gqa=True)

            ms = time_calls(
                {"gla": gla_step, "sdpa": sdpa_step}, device, args.warmup, args.decode_repeats, interleave=False
            )
        rows.append(DecodeRow(T, f"gla-recurrent/{kernel_backend(device)}", ms["gla"], state.numel() * state.element_size()))
        rows.append(DecodeRow(T, "sdpa-kv-cache", ms["sdpa"], 2 * B * H * (T + 1) * D * dtype.itemsize))
        del x, past
    return rows


def _render(rows: list[PrefillRow], decode: list[DecodeRow], header: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    console.print(header)
    table = Table(title="Prefill (ms, median); speedup = SDPA time / our time")
    for col in ("T", "D", "method", "forward", "fwd+bwd", "fwd speedup", "fwd+bwd speedup"):
        table.add_column(col, justify="right")
    base = {(r.seq_len, r.head_dim): r for r in rows if r.method == "sdpa-causal"}
    for r in rows:
        ref = base[(r.seq_len, r.head_dim)]
        bwd = "-" if r.forward_backward_ms is None else f"{r.forward_backward_ms:.2f}"
        fwd_x = f"{ref.forward_ms / r.forward_ms:.2f}x"
        bwd_x = "-" if r.forward_backward_ms is None else f"{ref.forward_backward_ms / r.forward_backward_ms:.2f}x"
        table.add_row(str(r.seq_len), str(r.head_dim), r.method, f"{r.forward_ms:.2f}", bwd, fwd_x, bwd_x)
    console.print(table)
    if decode:
        table = Table(title="Decode: one token after a context of T (ms, median)")
        for col in ("context T", "method", "step", "state / KV cache"):
            table.add_column(col, justify="right")
        for r in decode:
            table.add_row(str(r.context), r.method, f"{r.step_ms:.3f}", f"{r.cache_bytes / 2**20:.2f} MiB")
        console.print(table)


def plot_timings(axes, rows: list[PrefillRow], decode: list[DecodeRow]) -> None:
    """Prefill time against T on axes[0] (forward) and axes[1] (forward + backward), the decode step on axes[2]."""
    for ax, field, label in ((axes[0], "forward_ms", "forward"), (axes[1], "forward_backward_ms", "forward + backward")):
        for method in dict.fromkeys(r.method for r in rows):
            for D in dict.fromkeys(r.head_dim for r in rows):
                pts = [(r.seq_len, getattr(r, field)) for r in rows if r.method == method and r.head_dim == D]
                pts = [p for p in pts if p[1] is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{method}, D={D}")
        ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="ms", title=label)
        if ax.lines:
            ax.legend(fontsize=7)
    if decode:
        for method in dict.fromkeys(r.method for r in decode):
            pts = [(r.context, r.step_ms) for r in decode if r.method == method]
            axes[2].plot(*zip(*pts), marker="o", label=method)
        axes[2].set(xscale="log", yscale="log", xlabel="context T", ylabel="ms per token", title="decode step")
        axes[2].legend(fontsize=7)


def _plot(rows: list[PrefillRow], decode: list[DecodeRow], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if decode else 2, figsize=(16 if decode else 11, 4.5))
    plot_timings(axes, rows, decode)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def idle_cores() -> int:
    """Cores this process may use minus the current load: on a shared machine, threads beyond the idle
    cores stall at every parallel region waiting for a descheduled sibling, which punishes code made
    of many small ops (the chunked scan) far more than one fused call (SDPA)."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, cores - round(os.getloadavg()[0])))


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="linearize bench --kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument(
        "--seq-lens", action=ListOption, help="prefill lengths, comma-separated (default 1K..32K on CUDA, 1K..16K on CPU)"
    )
    p.add_argument("--head-dims", action=ListOption, help="head dims, comma-separated (default 64,128 on CUDA, 64 on CPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=9, help="query heads (default 9, as SmolLM2-135M)")
    p.add_argument("--kv-heads", type=int, default=3, help="key/value heads (default 3, as SmolLM2-135M)")
    p.add_argument("--dtype", type=dtype_name, default="auto", help=f"{DTYPE_HELP} (default auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument(
        "--decode-contexts",
        action=ListOption,
        default="1024,4096,16384,65536",
        help="decode contexts, comma-separated ('' skips the decode table; default %(default)s)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-repeats", type=int, default=30)
    p.add_argument("--threads", type=int, help="CPU threads (default: the cores not already busy, at least 1)")
    p.add_argument("--no-backward", action="store_true", help="time the forward pass only")
    p.add_argument("--out", type=Path, default=Path("out/kernel_bench"), help="folder for kernel_bench.{json,png}")
    return p


def kernel_bench_main(argv: list[str]) -> int:
    """CLI entry (also `linearize bench --kernels`): run, print the tables, write JSON and PNG."""
    args = _parser().parse_args(argv)
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    device = torch.device(name)
    cuda = device.type == "cuda"
    try:
        for dest in ("seq_lens", "head_dims", "decode_contexts"):
            text, flag = getattr(args, dest), "--" + dest.replace("_", "-")
            if text is not None:
                setattr(args, dest, parse_list(text, flag, int, "1024,4096", allow_empty=dest == "decode_contexts"))
    except ValueError as err:
        return fail("linearize bench --kernels", str(err))
    args.seq_lens = args.seq_lens or ([1024, 2048, 4096, 8192, 16384, 32768] if cuda else [1024, 2048, 4096, 8192, 16384])
    args.head_dims = args.head_dims or ([64, 128] if cuda else [64])
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if cuda else torch.float32)
    if args.heads % args.kv_heads:
        return fail("linearize bench --kernels", f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if not cuda:
        torch.set_num_threads(args.threads or idle_cores())
    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {threads} thread{'s' * (threads > 1)}"
    header = (
        f"{where}; torch {torch.__version__}; {str(dtype).removeprefix('torch.')}; B={args.batch}, "
        f"heads {args.heads}/{args.kv_heads} (query/kv); warmup {args.warmup}, median of {args.repeats}"
    )
    rows = bench_prefill(args, device, dtype)
    decode = bench_decode(args, device, dtype) if args.decode_contexts else []
    _render(rows, decode, header)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "setup": header,
        "device": where,
        "dtype": str(dtype),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "prefill": [asdict(r) for r in rows],
        "decode": [asdict(r) for r in decode],
    }
    (args.out / "kernel_bench.json").write_text(json.dumps(report, indent=2))
    _plot(rows, decode, args.out / "kernel_bench.png", header)
    print(f"wrote {args.out / 'kernel_bench.json'} and {args.out / 'kernel_bench.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(kernel_bench_main(sys.argv[1:]))
