"""Speed and memory of a student against its teacher: prefill, decode, peak memory, cache size.

Method (the same for both models, in one process):
- Input: seeded random token ids (speed does not depend on content), `B x context`.
- Prefill: one forward with a fresh `DynamicCache(config=model.config)`, keeping only the last
  position's logits (full logits at 16K x 8 x 49K vocab would dominate memory and time).
- Decode: UNTIMED_STEPS greedy steps (a compiled step compiles at the first position, and an eager
  one lays out its weights), then `decode_tokens` timed greedy steps, one token per sequence per step.
  tokens/s counts all sequences in the batch. The steps run in DECODE_ROUNDS rounds, and models
  benched together (student and teacher) take turns round by round, so both are timed over the same
  stretch of wall-clock time: on a shared machine whose speed drifts by tens of percent over
  minutes, the ratio then moves far less than either rate. Each model runs its own forward, as a
  user runs it; only the order of the calls is interleaved.
- Cache bytes: exact, summed over the cache's tensors after decoding (`cache_nbytes`).
- Peak memory: the extra memory a model's prefill and first decode round needed above what was in
  use before them (later rounds only grow the cache by a few tokens).
  CUDA: `torch.cuda.max_memory_allocated` minus the allocation before the point.
  CPU: the process's peak resident set (Linux `VmHWM`, reset through `/proc/self/clear_refs`
  before the point, after `malloc_trim`) minus the resident set before it; where that reset is
  unavailable, RSS is sampled every 2 ms instead. This counts everything the process touched
  (activations, cache, allocator slack), so it is an honest upper bound, not a tensor count.
- Bandwidth bound: a decoding step must read every weight once (the input embedding only for its
  B rows, unless the output head shares it) and the whole cache. Those bytes over the machine's
  read bandwidth give the ideal tokens/s; `bound_fraction` is the measured tokens/s over it. The
  bandwidth (`read_bandwidth`: the best of two sums over a buffer far larger than the caches) is
  measured after every decode round, and a point's bound spends each round's steps at the bandwidth
  measured right after it (`paired_bandwidth`), so rate and bound come from the same stretch of time,
  as the interleaving does for the speedup. A shared machine's bandwidth can switch between levels
  within seconds (about 32 and 55 GB/s on one 2-core host), and a rate spanning both levels, held against
  the best figure of the whole run, would read the switching as slowness. Every sample is kept in
  the point (`bandwidth_samples_bytes_s`). The cache read is the cache after decoding, so the bound
  is slightly strict.
- Points whose predicted cache would not fit in the free memory are skipped, not crashed into.
- Each model gets one small warm-up point first, so one-time costs are not timed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..convert.card import update_section
from .kernel_bench import sync

log = logging.getLogger(__name__)

DEFAULT_CONTEXTS = (1024, 4096, 16384)
DEFAULT_BATCH_SIZES = (1, 8)
DECODE_ROUNDS = 8  # decode steps are timed in this many rounds, models taking turns (module docstring)
UNTIMED_STEPS = 2  # after each prefill, before the timed steps (module docstring)
MiB = 1024**2


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a transformers cache: keys/values of attention layers plus the
    `recurrent_states` / `conv_states` of linear-attention layers (logical tensor sizes)."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for name in ("recurrent_states", "conv_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                tensors.extend(states.values())
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") is not None


def _malloc_trim() -> None:
    """Hand freed heap back to the OS so the next baseline RSS is not inflated by earlier points."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Context manager measuring the peak extra memory of a block, in bytes (see module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = 0
        self.method = ""
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "cuda max_memory_allocated"
            return self
        _malloc_trim()
        self._base = psutil.Process().memory_info().rss
        if _reset_peak_rss():
            self.method = "peak RSS (VmHWM)"
        else:
            self.method = "sampled RSS (2 ms)"
            self._sampled = self._base
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(0.002):
            self._sampled = max(self._sampled, proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            peak = max(self._sampled, psutil.Process().memory_info().rss)
        else:
            peak = (_proc_status_kib("VmHWM") or 0) * 1024
        self.peak_bytes = max(0, peak - self._base)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


BANDWIDTH_BUFFER_BYTES = 512 * MiB  # far past any last-level cache


def read_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes per second the device streams from memory: the best of `repeats` sums over a large fp32 buffer."""
    buffer = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first touches the pages
        sync(device)
        start = time.perf_counter()
        buffer.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BUFFER_BYTES / best


def weight_bytes_per_step(model: PreTrainedModel, batch: int) -> int:
    """Weight bytes a decoding step of `batch` tokens reads: every tensor once, the input embedding only for its rows."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is not None and (head is None or head.weight.data_ptr() != embedding.weight.data_ptr()):
        table = embedding.weight
        total -= table.numel() * table.element_size() - batch * table.shape[1] * table.element_size()
    return total


class _Runner:
    """Prefill + greedy decode with a transformers DynamicCache, as `generate` would do it."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = _device_of(model)
        self.vocab = model.config.get_text_config().vocab_size
        self.keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self.keep else {}
        out = self.model(ids, cache=DynamicCache(config=self.model.config), use_cache=True, **kwargs)
        return out.logits[:, -1].argmax(-1, keepdim=True), out.cache

    def decode(self, token: torch.Tensor, cache: Any, steps: int) -> tuple[torch.Tensor, Any]:
        for _ in range(steps):
            out = self.model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            cache = out.cache
        return token, cache

    def cache_per_token(self) -> tuple[float, float]:
        """(fixed, per-token) cache bytes for one sequence, from two short prefills."""
        sizes = []
        for n in (8, 16):
            _, cache = self.prefill(torch.zeros(1, n, dtype=torch.long, device=self.device))
            sizes.append(cache_nbytes(cache))
        slope = (sizes[1] - sizes[0]) / 8
        return sizes[0] - 8 * slope, slope


def decode_rounds(steps: int) -> list[int]:
    """`steps` split into at most DECODE_ROUNDS near-equal rounds (none for 0 steps)."""
    rounds = min(DECODE_ROUNDS, steps)
    return [steps // rounds + (i < steps % rounds) for i in range(rounds)]


@contextlib.contextmanager
def _marks_oom(point: dict[str, Any]) -> Any:
    """Run a model's work at a point; running out of memory marks the point "oom" instead of raising."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        memory = isinstance(err, (torch.OutOfMemoryError, MemoryError))
        if not memory and "can't allocate memory" not in str(err) and "out of memory" not in str(err):
            raise
        point["status"] = "oom"
        log.warning("%s ctx=%d B=%d ran out of memory", point["model"], point["context"], point["batch"])


def _timed(device: torch.device, fn: Any, *args: Any) -> tuple[Any, float]:
    sync(device)
    start = time.perf_counter()
    result = fn(*args)
    sync(device)
    return result, time.perf_counter() - start


@torch.no_grad()
def bench_models(
    models: dict[str, PreTrainedModel],
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    decode_tokens: int = 32,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, list[dict[str, Any]]]:
    """Per model, one dict per (context, batch): timings, tokens/s, the bandwidth bound, peak memory, cache
    bytes, and `status` ("ok", "skipped: ..." when the predicted cache does not fit, "oom" when it ran out anyway).

    At each point every model prefills the same ids in turn, then their decode rounds alternate, and the
    read bandwidth is sampled after each round for the point's bound (see the module docstring).
    """
    runners = {name: _Runner(model) for name, model in models.items()}
    device = next(iter(runners.values())).device
    idle_bandwidth = read_bandwidth(device)  # the bound of points without decode rounds; a failed sample's fallback
    sizes = {}
    for name, runner in runners.items():  # warm-up: first calls pay for lazy init, kernel selection, allocator growth
        runner.decode(*runner.prefill(torch.zeros(1, 16, dtype=torch.long, device=device)), 2)
        sizes[name] = runner.cache_per_token()
    rounds = decode_rounds(decode_tokens)
    points: dict[str, list[dict[str, Any]]] = {name: [] for name in models}
    grid = [(c, b) for c in contexts for b in batch_sizes]
    bar = tqdm(grid, desc=f"bench {', '.join(models)}", unit="pt", disable=not progress)
    for context, batch in bar:
        bar.set_postfix_str(f"ctx={context} B={batch}")
        ids = torch.randint(
            0, min(r.vocab for r in runners.values()), (batch, context),
            generator=torch.Generator().manual_seed(seed + context + batch),
        ).to(device)  # fmt: skip
        live: dict[str, dict[str, Any]] = {}
        for name, runner in runners.items():
            point: dict[str, Any] = {"model": name, "context": context, "batch": batch, "decode_tokens": decode_tokens}
            points[name].append(point)
            fixed, per_token = sizes[name]
            predicted = batch * (fixed + per_token * (context + decode_tokens))
            if 1.5 * predicted > _free_bytes(device):
                point["status"] = f"skipped: predicted cache {predicted / MiB:.0f} MiB does not fit in free memory"
                log.warning("%s ctx=%d B=%d %s", name, context, batch, point["status"])
                continue
            with _marks_oom(point), PeakMemory(device) as mem:
                (token, cache), prefill_s = _timed(device, runner.prefill, ids)
                token, cache = runner.decode(token, cache, UNTIMED_STEPS)
                (token, cache), decode_s = _timed(device, runner.decode, token, cache, rounds[0] if rounds else 0)
                live[name] = {"token": token, "cache": cache, "decode_s": decode_s}
            gc.collect()  # the prefill's activations, before the next model's prefill is measured
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if name not in live:
                continue
            point.update(
                prefill_s=prefill_s,
                prefill_tok_s=batch * context / prefill_s,
                peak_mem_bytes=mem.peak_bytes,
                memory_method=mem.method,
            )
        samples = [_sample_bandwidth(device, idle_bandwidth)] if rounds else []
        for steps in rounds[1:]:
            for name, state in list(live.items()):
                with _marks_oom(points[name][-1]):
                    (state["token"], state["cache"]), seconds = _timed(
                        device, runners[name].decode, state["token"], state["cache"], steps
                    )
                    state["decode_s"] += seconds
                if points[name][-1].get("status") == "oom":
                    del live[name]
            samples.append(_sample_bandwidth(device, samples[-1]))
        for name, state in live.items():
            point, cache_bytes, decode_s = points[name][-1], cache_nbytes(state["cache"]), state["decode_s"]
            decode_tok_s = batch * decode_tokens / decode_s if decode_tokens else None
            point.update(
                status="ok",
                decode_s=decode_s,
                decode_tok_s=decode_tok_s,
                step_bytes=weight_bytes_per_step(models[name], batch) + cache_bytes,
                cache_bytes=cache_bytes,
                bandwidth_samples_bytes_s=samples,
            )
            log.debug("%s ctx=%d B=%d decode %.1f tok/s", name, context, batch, decode_tok_s or 0)
        del live, ids
        gc.collect()
    for point in (p for model_points in points.values() for p in model_points if p.get("status") == "ok"):
        bandwidth = paired_bandwidth(rounds, point["bandwidth_samples_bytes_s"]) if rounds else idle_bandwidth
        bound_tok_s = point["batch"] * bandwidth / point["step_bytes"]
        rate = point["decode_tok_s"]
        point.update(bandwidth_bytes_s=bandwidth, bound_tok_s=bound_tok_s, bound_fraction=None if rate is None else rate / bound_tok_s)
    return points


SCORING_LENGTHS = (128, 512)
SCORING_REPEATS = 3


@torch.no_grad()
def bench_scoring(
    models: dict[str, PreTrainedModel],
    lengths: Sequence[int] = SCORING_LENGTHS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    repeats: int = SCORING_REPEATS,
    seed: int = 0,
) -> dict[str, list[dict[str, Any]]]:
    """Batched prefill as lm-eval scores: one forward over B x T ids, every position's logits, the model's
    default cache. Per model, one dict per (length, batch) with the median of `repeats` timed forwards
    (after one untimed); the models take turns forward by forward, as decode rounds do."""
    device = _device_of(next(iter(models.values())))
    vocab = min(model.config.get_text_config().vocab_size for model in models.values())
    points: dict[str, list[dict[str, Any]]] = {name: [] for name in models}
    for length in lengths:
        for batch in batch_sizes:
            gen = torch.Generator().manual_seed(seed + length + batch)
            ids = torch.randint(0, vocab, (batch, length), generator=gen).to(device)
            times: dict[str, list[float]] = {name: [] for name in models}
            for repeat in range(repeats + 1):
                for name, model in models.items():
                    _, seconds = _timed(device, model, ids)
                    if repeat:
                        times[name].append(seconds)
            for name, measured in times.items():
                median = statistics.median(measured)
                points[name].append({"length": length, "batch": batch, "seconds": median, "tok_s": batch * length / median})
    return points


def scoring_rows(points: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (length, batch): each model's tokens/s and the student's over the teacher's."""
    teacher = {(p["length"], p["batch"]): p["tok_s"] for p in points.get("teacher", [])}
    rows = []
    for p in points["student"]:
        t = teacher.get((p["length"], p["batch"]))
        rows.append({"length": p["length"], "batch": p["batch"], "student_tok_s": p["tok_s"], "teacher_tok_s": t, "speed_ratio": _ratio(p["tok_s"], t)})
    return rows


SCORING_TITLE = "batched prefill as scoring runs it: tokens/s, every position's logits (S/T: student over teacher)"
SCORING_COLUMNS = (
    ("tokens", "length", 1, "d"),
    ("B", "batch", 1, "d"),
    ("student tok/s", "student_tok_s", 1.0, ".0f"),
    ("teacher tok/s", "teacher_tok_s", 1.0, ".0f"),
    ("S/T", "speed_ratio", 1.0, ".2f"),
)


def render_scoring_table(rows: list[dict[str, Any]]) -> Any:
    """A rich Table of `scoring_rows` output."""
    from rich.table import Table

    table = Table(title=SCORING_TITLE)
    for header, *_ in SCORING_COLUMNS:
        table.add_column(header, justify="right")
    for r in rows:
        table.add_row(*_cells(r, SCORING_COLUMNS))
    return table


def _sample_bandwidth(device: torch.device, last: float) -> float:
    """`read_bandwidth` between decode rounds; on a device that the caches filled, the `last` figure."""
    try:
        return read_bandwidth(device, repeats=2)
    except torch.OutOfMemoryError:
        return last


def paired_bandwidth(rounds: Sequence[int], samples: Sequence[float]) -> float:
    """The bandwidth at which reading a step's bytes takes as long, over all rounds, as reading them at each
    round's own sample: steps over the sum of steps / bandwidth (a harmonic mean weighted by steps)."""
    return sum(rounds) / sum(steps / bandwidth for steps, bandwidth in zip(rounds, samples, strict=True))


def bandwidth_range(points: dict[str, list[dict[str, Any]]]) -> tuple[float, float] | None:
    """(lowest, highest) bandwidth sampled at any point, bytes/s; None before any point decoded."""
    samples = [b for model_points in points.values() for p in model_points for b in p.get("bandwidth_samples_bytes_s", ())]
    return (min(samples), max(samples)) if samples else None


def bench_model(model: PreTrainedModel, *args: Any, name: str = "model", **kwargs: Any) -> list[dict[str, Any]]:
    """`bench_models` for one model."""
    return bench_models({name: model}, *args, **kwargs)[name]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


METRICS = ("prefill_s", "decode_tok_s", "bound_tok_s", "bound_fraction", "peak_mem_bytes", "cache_bytes")


def ratio_rows(student: list[dict[str, Any]], teacher: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Per (context, batch): both models' numbers, speedups (> 1: student faster) and memory ratios
    student/teacher (< 1: student smaller); None where either side has no measurement."""
    by_key = {(p["context"], p["batch"]): p for p in teacher or [] if p.get("status") == "ok"}
    rows = []
    for s in student:
        t = by_key.get((s["context"], s["batch"]), {})
        ok = s.get("status") == "ok"
        row: dict[str, Any] = {"context": s["context"], "batch": s["batch"], "status": s.get("status")}
        for key in METRICS:
            row[f"student_{key}"] = s.get(key) if ok else None
            row[f"teacher_{key}"] = t.get(key)
        row["prefill_speedup"] = _ratio(row["teacher_prefill_s"], row["student_prefill_s"])
        row["decode_speedup"] = _ratio(row["student_decode_tok_s"], row["teacher_decode_tok_s"])
        row["peak_mem_ratio"] = _ratio(row["student_peak_mem_bytes"], row["teacher_peak_mem_bytes"])
        row["cache_ratio"] = _ratio(row["student_cache_bytes"], row["teacher_cache_bytes"])
        rows.append(row)
    return rows


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if value is None else format(value if scale == 1 else value / scale, spec)


def _cells(row: dict[str, Any], columns: tuple) -> list[str]:
    """A row's cells as `columns` (header, key, scale, format) format them."""
    return [_fmt(row[key], scale, spec) for _, key, scale, spec in columns]


def _markdown(columns: tuple, rows: list[list[str]]) -> str:
    """A Markdown table of right-aligned columns, the headers on one line."""
    lines = ["| " + " | ".join(header.replace("\n", " ") for header, *_ in columns) + " |", "|" + "---:|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


TABLE_COLUMNS = (
    # header, row key, scale, format
    ("ctx", "context", 1, "d"),
    ("B", "batch", 1, "d"),
    ("prefill\ns", "student_prefill_s", 1.0, ".2f"),
    ("prefill\n×", "prefill_speedup", 1.0, ".2f"),
    ("decode\ntok/s", "student_decode_tok_s", 1.0, ".1f"),
    ("decode\n×", "decode_speedup", 1.0, ".2f"),
    ("bound\ntok/s", "student_bound_tok_s", 1.0, ".1f"),
    ("of bound\nS", "student_bound_fraction", 1.0, ".0%"),
    ("of bound\nT", "teacher_bound_fraction", 1.0, ".0%"),
    ("cache\nMiB", "student_cache_bytes", MiB, ".1f"),
    ("cache\nS/T", "cache_ratio", 1.0, ".3f"),
    ("peak\nMiB", "student_peak_mem_bytes", MiB, ".0f"),
    ("peak\nS/T", "peak_mem_ratio", 1.0, ".2f"),
)


TITLE = (
    "student speed and memory (×: speedup over teacher, S/T: student/teacher; bound: the decode tokens/s that "
    "reading the weights and cache at the measured bandwidth allows, of bound: measured / bound)"
)


def render_table(rows: list[dict[str, Any]], title: str = TITLE) -> Any:
    """A rich Table of `ratio_rows` output; speedups > 1 and memory ratios < 1 favour the student."""
    from rich.table import Table

    table = Table(title=title)
    for header, *_ in TABLE_COLUMNS:
        table.add_column(header, justify="right")
    for r in rows:
        cells = _cells(r, TABLE_COLUMNS)
        if r["status"] != "ok":
            cells[2] = str(r["status"])
        table.add_row(*cells)
    return table


# The model card's table: the columns a reader compares, from the terminal table's.
MARKDOWN_COLUMNS = tuple(
    column
    for column in TABLE_COLUMNS  # `_markdown` puts each header on one line
    if column[1] not in ("student_bound_tok_s", "student_bound_fraction", "teacher_bound_fraction", "student_peak_mem_bytes")
)


def markdown_table(report: dict[str, Any]) -> str:
    """The bench rows as Markdown for the model card, with what was measured and how."""
    rows = []
    for r in report["rows"]:
        cells = _cells(r, MARKDOWN_COLUMNS)
        if r["status"] != "ok":
            cells[2] = str(r["status"])
        rows.append(cells)
    note = (
        f"{report['device']}, {report['dtype']}, student decoding {report['student_decoding']}, "
        f"{report['decode_tokens']} decoded tokens per point. ×: speedup over the teacher (`{report['teacher']}`), "
        "S/T: student over teacher. Reproduce: `linearize bench DIR --contexts "
        f"{','.join(map(str, report['contexts']))} --batch-sizes {','.join(map(str, report['batch_sizes']))}`."
    )
    text = _markdown(MARKDOWN_COLUMNS, rows) + "\n\n" + note + "\n"
    if report.get("scoring"):
        lengths = ",".join(map(str, report["scoring_lengths"]))
        scoring = _markdown(SCORING_COLUMNS, [_cells(r, SCORING_COLUMNS) for r in report["scoring"]])
        text += (
            "\nBatched prefill as lm-eval scores (one forward, every position's logits, median of "
            f"{SCORING_REPEATS}; `--scoring-lengths {lengths}`):\n\n" + scoring + "\n"
        )
    return text


def plot(points: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """PNG with prefill tokens/s, decode tokens/s and memory against context, one line per model and batch;
    dashed beside decoding its bandwidth bound, beside the cache the peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (  # (solid, dashed, label, scale)
        ("prefill_tok_s", None, "prefill tokens/s", 1.0),
        ("decode_tok_s", "bound_tok_s", "decode tokens/s (solid: measured, dashed: bound)", 1.0),
        ("cache_bytes", "peak_mem_bytes", "MiB (solid: cache, dashed: peak)", MiB),
    )
    for ax, (key, dashed, ylabel, scale) in zip(axes, panels, strict=True):
        for model, pts in points.items():
            for batch in sorted({p["batch"] for p in pts}):
                ok = [p for p in pts if p["batch"] == batch and p.get("status") == "ok" and p.get(key) is not None]
                if not ok:
                    continue
                xs = [p["context"] for p in ok]
                line = ax.plot(xs, [p[key] / scale for p in ok], marker="o", label=f"{model} B={batch}")[0]
                beside = [p for p in ok if dashed and p.get(dashed) is not None]
                if beside:
                    ax.plot([p["context"] for p in beside], [p[dashed] / scale for p in beside], marker="x", ls="--", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p["context"] for pts in points.values() for p in pts}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_int_list(text: str, what: str) -> list[int]:
    """'1024,4096' -> [1024, 4096]; anything else is a one-line error naming the expected form."""
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"bad --{what} {text!r}: give positive integers separated by commas, e.g. 1024,4096")
    return values


def _check_compilable(student_dir: str | Path) -> None:
    """Refuse `--compile` before anything loads when the export's remote code has no compiled decoding."""
    folder = Path(student_dir).expanduser()  # the export's model code: flat .py files (convert/export.py)
    if not any("def compile_decoding(" in code.read_text() for code in folder.glob("*.py")):
        raise ValueError(f"{student_dir}'s model code predates compiled decoding: convert it again, or bench without --compile")


def run_bench(
    student_dir: str | Path,
    teacher: str | None = None,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    decode_tokens: int = 32,
    device: str = "auto",
    skip_teacher: bool = False,
    progress: bool = True,
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    compile_student: bool = False,
    scoring_lengths: Sequence[int] = SCORING_LENGTHS,
) -> dict[str, Any]:
    """Bench the student folder (and its teacher) and write `bench.json` + `bench.png` into the folder.

    The teacher defaults to the one the student's config records. With `compile_student` the student
    decodes through `compile_decoding`'s graph, and so does a teacher that is itself a linearize export
    (two exports benched against each other, e.g. before and after a code change, decode alike); any
    other teacher runs as loaded. `device` / `dtype` take "auto"
    (`models.resolve_device_dtype`); a teacher that is not a linearize export runs no remote code
    unless `trust_remote_code`. `scoring_lengths` (empty: none) adds `bench_scoring`'s batched prefill at
    these lengths and `batch_sizes`. Returns the JSON report with `rows` (see `ratio_rows`), `scoring`
    (see `scoring_rows`) and the written `paths`.
    """
    from .models import dtype_name, load, resolve_device_dtype, student_config, teacher_spec

    student_config(student_dir)
    if compile_student:
        _check_compilable(student_dir)
    device, torch_dtype = resolve_device_dtype(device, dtype)
    if decode_tokens < 0:
        raise ValueError(f"bad --decode-tokens {decode_tokens}: give 0 or more")
    tspec = None if skip_teacher else teacher_spec(student_dir, teacher)
    dev = torch.device(device)
    specs = {"student": str(student_dir)} | ({"teacher": tspec} if tspec else {})
    points: dict[str, list[dict[str, Any]]] = {}
    scoring: dict[str, list[dict[str, Any]]] = {}
    loaded: dict[str, PreTrainedModel] = {}
    schedule = "interleaved" if len(specs) > 1 else "one model"
    decoding = dict.fromkeys(specs, "eager")

    def bench_loaded() -> None:
        points.update(bench_models(loaded, contexts, batch_sizes, decode_tokens, progress=progress))
        if scoring_lengths:
            scoring.update(bench_scoring(loaded, scoring_lengths, batch_sizes))
        loaded.clear()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for role, spec in specs.items():
        # Both models stay loaded so their decode rounds can alternate, where memory allows it beside
        # the caches; otherwise the student is benched and freed before the teacher loads.
        if loaded and _free_bytes(dev) < 2 * max(weight_bytes_per_step(m, 1) for m in loaded.values()):
            log.warning("the teacher does not fit beside the student: benching them one after the other")
            schedule = "sequential"
            bench_loaded()
        loaded[role], _, _ = load(
            spec, device=device, dtype=torch_dtype, with_tokenizer=False, trust_remote_code=trust_remote_code
        )
        if compile_student and hasattr(loaded[role], "compile_decoding"):
            loaded[role].compile_decoding()
            decoding[role] = "compiled"
    bench_loaded()
    rows = ratio_rows(points["student"], points.get("teacher"))
    sampled = bandwidth_range(points)
    out = Path(student_dir)
    report = {
        "student": str(student_dir),
        "teacher": tspec,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "dtype": dtype_name(torch_dtype),
        "torch": torch.__version__,
        "contexts": list(contexts),
        "batch_sizes": list(batch_sizes),
        "decode_tokens": decode_tokens,
        "student_decoding": decoding["student"],
        "teacher_decoding": decoding.get("teacher"),
        "schedule": schedule,
        "read_bandwidth_range_gb_s": None if sampled is None else [b / 1e9 for b in sampled],
        "points": points,
        "rows": rows,
        "scoring_lengths": list(scoring_lengths),
        "scoring_points": scoring,
        "scoring": scoring_rows(scoring) if scoring else [],
        "paths": {"json": str(out / "bench.json"), "png": str(out / "bench.png")},
    }
    plot(points, out / "bench.png")
    tmp = out / f".bench.json.{os.getpid()}"
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(out / "bench.json")
    update_section(out, "bench", markdown_table(report))
    return report
