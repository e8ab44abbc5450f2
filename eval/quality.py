"""Benchmark quality of a student against its teacher with lm-eval, and the model-card table.

Both models run through lm-eval's own `hf` model and the local copies of the stock tasks
(`eval/tasks.py`), zero-shot, so the numbers compare with published lm-eval numbers. Per task we
report `acc_norm` where the stock task reports it, else `acc`, with lm-eval's standard error, and
the student/teacher ratio ("recovery"); the average recovery is the mean ratio over tasks.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..convert.card import update_section
from .models import (
    dtype_name,
    is_model_dir,
    load,
    remote_code_ok,
    resolve_device_dtype,
    student_config,
    teacher_spec,
)
from .perplexity import context_markdown_report, context_report, plot_contexts
from .tasks import SUFFIX, build_tasks, default_dest, resolve_task_names

log = logging.getLogger(__name__)

# Accuracy of a uniform random guess: numbers near it say little about recovery.
CHANCE = {"hellaswag": 0.25, "piqa": 0.5, "arc_easy": 0.25, "arc_challenge": 0.25, "winogrande": 0.5, "boolq": 0.5}
_KEEP = (
    "results",
    "n-samples",
    "n-shot",
    "versions",
    "higher_is_better",
    "lm_eval_version",
    "transformers_version",
    "date",
)


def run_lm_eval(
    pretrained: str | PreTrainedModel,
    tasks: list[str] | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    trust_remote_code: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
    include_path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Run lm-eval's `hf` model on the local tasks; returns lm-eval's output (results, n-samples, ...).

    `pretrained` is a model folder (passed as `model_args` exactly as on the lm_eval command line)
    or a loaded model (then `tokenizer` is needed; `device` and `dtype` are then the model's own).
    `tasks` takes stock or `_local` names. A folder's remote code runs only for a linearize export or
    with `trust_remote_code` (`models.remote_code_ok`).
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    names = resolve_task_names(tasks)
    include = build_tasks(Path(include_path) if include_path else default_dest(), names)
    if isinstance(pretrained, (str, Path)):
        if "," in str(pretrained) or "=" in str(pretrained):
            raise ValueError(
                f"model path {str(pretrained)!r} has ',' or '=', which lm-eval's model_args cannot carry: rename it"
            )
        trust = remote_code_ok(pretrained, trust_remote_code)
        model_args: str | dict[str, Any] = (
            f"pretrained={pretrained},trust_remote_code={trust},dtype={dtype_name(dtype)}"
        )
    else:
        if tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: pass tokenizer=")
        model_args = {"pretrained": pretrained, "tokenizer": tokenizer, "trust_remote_code": trust_remote_code}
    shown = pretrained if isinstance(pretrained, (str, Path)) else type(pretrained).__name__
    log.info("lm-eval on %s: %s (limit %s)", shown, names, limit)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=[n + SUFFIX for n in names],
        limit=limit,
        batch_size=batch_size,
        device=device,
        task_manager=TaskManager(include_path=str(include), include_defaults=False),
        log_samples=False,
    )
    return {k: out[k] for k in _KEEP if k in out}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def primary_metric(task_result: dict[str, Any]) -> str:
    """`acc_norm` where the task reports it, else `acc`."""
    return "acc_norm" if "acc_norm,none" in task_result else "acc"


def compare(student: dict[str, Any], teacher: dict[str, Any] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-task rows (teacher, student, ratio, stderrs) and a summary with the average recovery."""
    rows = []
    for name, res in student["results"].items():
        task = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
        metric = primary_metric(res)
        tres = (teacher or {}).get("results", {}).get(name, {})
        row = {
            "task": task,
            "metric": metric,
            "n": student.get("n-samples", {}).get(name, {}).get("effective"),
            "chance": CHANCE.get(task),
            "student": _number(res.get(f"{metric},none")),
            "student_stderr": _number(res.get(f"{metric}_stderr,none")),
            "teacher": _number(tres.get(f"{metric},none")),
            "teacher_stderr": _number(tres.get(f"{metric}_stderr,none")),
        }
        row["ratio"] = row["student"] / row["teacher"] if row["student"] is not None and row["teacher"] else None
        rows.append(row)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    summary = {
        "average_recovery": sum(ratios) / len(ratios) if ratios else None,
        "tasks": len(rows),
        "student_average": _mean([r["student"] for r in rows]),
        "teacher_average": _mean([r["teacher"] for r in rows]),
    }
    return rows, summary


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals and len(vals) == len(values) else None


def _score(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} ± {stderr:.3f}" if stderr is not None else f"{value:.3f}"


def _cells(row: dict[str, Any]) -> list[str]:
    return [
        row["task"],
        row["metric"],
        "-" if row["n"] is None else str(row["n"]),
        "-" if row["chance"] is None else f"{row['chance']:.2f}",
        _score(row["teacher"], row["teacher_stderr"]),
        _score(row["student"], row["student_stderr"]),
        "-" if row["ratio"] is None else f"{row['ratio']:.3f}",
    ]


HEADERS = ["task", "metric", "n", "chance", "teacher", "student", "student/teacher"]


def _summary_cells(summary: dict[str, Any]) -> list[str]:
    values = (summary["teacher_average"], summary["student_average"], summary["average_recovery"])
    return ["average", "", "", "", *("-" if v is None else f"{v:.3f}" for v in values)]


def _time_cells(summary: dict[str, Any]) -> list[str] | None:
    """The wall-time row (lm-eval's run for each model, loading included), when the run measured it."""
    if summary.get("student_seconds") is None:
        return None
    values = (summary.get("teacher_seconds"), summary["student_seconds"])
    cells = ["-" if v is None else f"{v:.0f}" for v in values]
    ratio = "-" if values[0] is None else f"{values[1] / values[0]:.2f}"
    return ["wall time", "seconds", "", "", *cells, ratio]


def render_table(rows: list[dict[str, Any]], summary: dict[str, Any], title: str = "lm-eval, zero-shot") -> Any:
    """A rich Table of `compare` output, with the average row last."""
    from rich.table import Table

    table = Table(title=title)
    for h in [*HEADERS[:-1], "S/T"]:
        table.add_column(h, justify="left" if h in ("task", "metric") else "right")
    for row in rows:
        table.add_row(*_cells(row))
    table.add_section()
    table.add_row(*_summary_cells(summary), style="bold")
    if (timing := _time_cells(summary)) is not None:
        table.add_row(*timing)
    return table


def markdown_table(rows: list[dict[str, Any]], summary: dict[str, Any], note: str = "") -> str:
    """The same table as Markdown (for eval.md and the model card), with a line saying how it was measured."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * 5) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    lines.append("| " + " | ".join(f"**{c}**" if c else "" for c in _summary_cells(summary)) + " |")
    if (timing := _time_cells(summary)) is not None:
        lines.append("| " + " | ".join(timing) + " |")
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def _eval_teacher(spec: str, **kwargs: Any) -> tuple[dict[str, Any], str]:
    """lm-eval results for a teacher spec, and where it was loaded from.

    Folders go to lm-eval by path; anything else is resolved by the converter (a GGUF teacher is
    cached as safetensors and that folder is evaluated), falling back to the loaded model object.
    """
    if is_model_dir(spec):
        return run_lm_eval(spec, **kwargs), spec
    model, tokenizer, location = load(
        spec,
        device=kwargs.get("device", "cpu"),
        dtype=kwargs.get("dtype", torch.float32),
        trust_remote_code=kwargs.get("trust_remote_code", False),
    )
    if is_model_dir(location):
        del model
        return run_lm_eval(location, **kwargs), location
    return run_lm_eval(model, tokenizer=tokenizer, **kwargs), location


def evaluate(
    student_dir: str | Path,
    teacher: str | None = None,
    tasks: list[str] | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    device: str = "auto",
    skip_teacher: bool = False,
    contexts: list[int] | None = None,
    texts: dict[str, str] | None = None,
    context_tokens: int | None = 16384,
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Evaluate a converted folder and its teacher; write eval.json, eval.md and the README.md tables.

    `device` / `dtype` take "auto" (see `models.resolve_device_dtype`); a teacher that is not a
    linearize export runs no remote code unless `trust_remote_code`.

    With `contexts` (and held-out `texts`), perplexity against context length is measured too and
    plotted to context.png: short benchmarks alone say nothing about a linear layer's long-range part.
    Returns the report written to eval.json (rows, summary, raw lm-eval results, context, paths).
    """
    student_dir = Path(student_dir)
    student_config(student_dir)
    names = resolve_task_names(tasks)
    tspec = None if skip_teacher else teacher_spec(student_dir, teacher)
    device, torch_dtype = resolve_device_dtype(device, dtype)
    kwargs: dict[str, Any] = {
        "tasks": names,
        "limit": limit,
        "batch_size": batch_size,
        "device": device,
        "dtype": torch_dtype,
        "trust_remote_code": trust_remote_code,
    }
    started = time.perf_counter()
    student_res = run_lm_eval(str(student_dir), **kwargs)
    student_seconds, started = time.perf_counter() - started, time.perf_counter()
    teacher_res, teacher_location = _eval_teacher(tspec, **kwargs) if tspec else (None, None)
    teacher_seconds = time.perf_counter() - started if tspec else None
    rows, summary = compare(student_res, teacher_res)
    summary.update(student_seconds=student_seconds, teacher_seconds=teacher_seconds)
    note = (
        f"lm-eval {student_res.get('lm_eval_version', '?')}, zero-shot, {dtype_name(torch_dtype)} on {device}, "
        f"{'all' if limit is None else f'first {limit}'} examples per task, on the stock tasks' prompts and "
        f"metrics over the offline copies in `linearize.eval.tasks` (validation splits; ARC: test). "
        f"Teacher: `{tspec or 'not evaluated'}`. Scores ± standard error; "
        f"student/teacher averaged over tasks is the recovery; wall time: each model's lm-eval run, loading included."
    )
    md = markdown_table(rows, summary, note)
    paths = {
        "json": str(student_dir / "eval.json"),
        "md": str(student_dir / "eval.md"),
        "readme": str(student_dir / "README.md"),
    }
    context = None
    if contexts:
        teacher_dir = teacher_location if teacher_location and is_model_dir(teacher_location) else tspec
        context = context_report(
            str(student_dir),
            teacher_dir,
            texts or {},
            contexts,
            context_tokens,
            device,
            dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
        )
        paths["png"] = str(plot_contexts(context["contexts"], student_dir / "context.png"))
    report = {
        "student": str(student_dir),
        "teacher": tspec,
        "teacher_location": teacher_location,
        "tasks": names,
        "limit": limit,
        "device": device,
        "dtype": dtype_name(torch_dtype),
        "rows": rows,
        "summary": summary,
        "lm_eval": {"student": student_res, "teacher": teacher_res},
        "context": context,
        "paths": paths,
    }
    Path(paths["json"]).write_text(json.dumps(report, indent=2, default=str))
    context_md = "" if context is None else context_markdown_report(context)
    Path(paths["md"]).write_text("# Evaluation\n\n" + md + ("\n" + context_md if context_md else ""))
    update_section(student_dir, "eval", md)
    if context_md:
        update_section(student_dir, "perplexity", context_md)
    return report
