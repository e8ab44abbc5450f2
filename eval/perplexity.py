"""Perplexity against context length, on named held-out texts: tables, plots and the `ppl` report.

Scoring itself (sliding windows, every token scored once) is `convert.measure.perplexity`, the same
function a conversion reports its before/after numbers with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..convert.card import CONTEXT_COLUMNS, STATE_OFF_COLUMNS, context_cells, context_markdown
from ..convert.measure import compare_contexts, perplexity_by_context
from ..modeling.modes import state_off, state_off_layers
from . import CONTROLS

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".json", ".parquet")


def _read_file(path: Path, text_field: str) -> list[str]:
    if path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as fh:
            rows = json.load(fh) if path.suffix == ".json" else [json.loads(line) for line in fh if line.strip()]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and text_field in r for r in rows):
            raise ValueError(f"{path}: expected records with a {text_field!r} field: pass --text-field")
        return [str(r[text_field]) for r in rows]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise ValueError(f"{path} has no column {text_field!r} (has {table.column_names}): pass --text-field")
        return [str(x) for x in table.column(text_field).to_pylist()]
    return [path.read_text(encoding="utf-8")]


def load_text(
    text_files: Iterable[str | Path] = (),
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "test",
    text_field: str = "text",
) -> str:
    """The text to score: local files, a hub dataset (`datasets.load_dataset`), or the held-out slice.

    Files: .txt/.md/.rst read whole; .jsonl and .parquet contribute `text_field` per row. Documents join
    with blank lines. With neither files nor a dataset: the converter's fixed held-out slice of
    CPython's documentation, which stage 1 and 2 never train on.
    """
    files = [Path(f).expanduser() for f in text_files]
    if files and dataset:
        raise ValueError("pass either text files or --dataset, not both")
    docs: list[str] = []
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"text file {str(path)!r} not found: check the path")
        docs.extend(_read_file(path, text_field))
    if dataset:
        import datasets

        ds = datasets.load_dataset(dataset, dataset_config, split=split)
        if text_field not in ds.column_names:
            raise ValueError(
                f"dataset {dataset!r} has no column {text_field!r} (has {ds.column_names}): pass --text-field"
            )
        docs.extend(str(x) for x in ds[text_field])
    if not files and not dataset:
        from linearize.convert.data import heldout_text

        return heldout_text()
    text = "\n\n".join(d for d in docs if d.strip())
    if not text:
        raise ValueError("the given source holds no text: check the files or --text-field")
    return text


DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192)


def render_context_table(rows: list[dict[str, Any]], title: str) -> Any:
    """The same table for the terminal (rich)."""
    from rich.table import Table

    table = Table(title=title)
    columns = CONTEXT_COLUMNS + (STATE_OFF_COLUMNS if any("state_off" in r for r in rows) else [])
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*context_cells(r))
    return table


def plot_contexts(curves: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """Perplexity against context length (log x), teacher dashed and student solid, one colour per text; the
    ratio panel adds the state-off control (dotted) where it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (name, rows) in enumerate(curves.items()):
        color = f"C{i}"
        x = [r["context"] for r in rows]
        ax.plot(x, [r["student"] for r in rows], marker="o", color=color, label=f"student, {name}")
        if all(r["teacher"] is not None for r in rows):
            ax.plot(x, [r["teacher"] for r in rows], marker="s", ls="--", color=color, label=f"teacher, {name}")
            ax_ratio.plot(x, [r["ratio"] for r in rows], marker="o", color=color, label=name)
            if all(r.get("state_off_ratio") is not None for r in rows):
                ax_ratio.plot(x, [r["state_off_ratio"] for r in rows], marker="x", ls=":", color=color, label=f"{name}, state off")
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xlabel("context length (tokens)")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # the ratio panel stays empty without a teacher
            a.legend(fontsize=8)
    ax.set_ylabel("perplexity")
    ax.set_title("perplexity against context")
    ax_ratio.axhline(1.0, color="k", lw=0.8)
    ax_ratio.set_ylabel("student / teacher")
    ax_ratio.set_title("ratio")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def context_report(
    student: str,
    teacher: str | None,
    texts: dict[str, str],
    contexts: Iterable[int] = DEFAULT_CONTEXTS,
    max_tokens: int | None = 16384,
    device: str = "auto",
    batch_size: int = 1,
    progress: bool = False,
    *,
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    controls: Iterable[str] = (),
) -> dict[str, Any]:
    """Perplexity against context for a model (and its teacher, when given) on each named text; with the
    `state-off` control, also the model's with every linear layer's state switched off (`state_off`).

    Returns {"contexts": {text name: rows of `compare_contexts`}, "teacher", "student", "max_tokens",
    "device", "dtype"}. Lengths beyond the teacher's `max_position_embeddings` are dropped for both
    models. `device` / `dtype` take "auto" (`models.resolve_device_dtype`); remote code runs for
    linearize exports, for other models only with `trust_remote_code`.
    """
    from .models import dtype_name, load, resolve_device_dtype

    unknown = [c for c in controls if c not in CONTROLS]
    if unknown:
        raise ValueError(f"unknown control {unknown[0]!r}: use {', '.join(CONTROLS)}")
    device, torch_dtype = resolve_device_dtype(device, dtype)
    model, tokenizer, _ = load(student, device=device, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if tokenizer is None:
        raise FileNotFoundError(f"{student!r} has no tokenizer: save one next to the model")
    if "state-off" in controls:
        state_off_layers(model)  # a model the control cannot apply to is refused before any scoring
    limit = model.config.max_position_embeddings
    teacher_model = None
    if teacher:
        teacher_model, _, _ = load(
            teacher, device=device, dtype=torch_dtype, with_tokenizer=False, trust_remote_code=trust_remote_code
        )
        limit = min(limit, teacher_model.config.max_position_embeddings)
    lengths = [c for c in contexts if c <= limit]
    curves = {}
    for name, text in texts.items():
        log.info("perplexity against context on %s: %s", name, lengths)
        ids = tokenizer(text, verbose=False)["input_ids"]
        s_rows = perplexity_by_context(model, None, ids, lengths, max_tokens, batch_size, progress)
        t_rows = None
        if teacher_model is not None:
            t_rows = perplexity_by_context(teacher_model, None, ids, lengths, max_tokens, batch_size, progress)
        curves[name] = compare_contexts(s_rows, t_rows)
        if "state-off" in controls:
            with state_off(model):
                off_rows = perplexity_by_context(model, None, ids, lengths, max_tokens, batch_size, progress)
            for row, off in zip(curves[name], off_rows):
                row["state_off"] = off["ppl"]
                row["state_off_ratio"] = None if row["teacher"] is None else off["ppl"] / row["teacher"]
    return {
        "contexts": curves,
        "student": student,
        "teacher": teacher,
        "max_tokens": max_tokens,
        "device": device,
        "dtype": dtype_name(torch_dtype),
        "controls": list(controls),
    }


def context_markdown_report(report: dict[str, Any]) -> str:
    """Every text's table, each under its name, with how it was measured."""
    parts = []
    for name, rows in report["contexts"].items():
        note = (
            f"Held-out text `{name}`, non-overlapping windows of each length, every length scoring the "
            f"same {rows[0]['tokens']} tokens. Teacher: `{report['teacher'] or 'not evaluated'}`."
        )
        parts.append(f"**Perplexity against context: {name}**\n\n" + context_markdown(rows, note))
    return "\n".join(parts)
