"""Sliding-window perplexity: every token scored exactly once, always with a long left context.

Windows hold `seq_len` input tokens. The first window scores every token it can predict; each later
window moves `stride` tokens on and scores only its last `stride` predictions, so each scored token
sees at least `seq_len - stride + 1` tokens of context (the first window's tokens see what precedes
them). `stride == seq_len` gives plain non-overlapping blocks; a smaller stride costs
`seq_len / stride` times more compute and gets closer to full-context perplexity.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".json", ".parquet")


def windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(input_start, input_end, n_scored) per window; window i predicts ids[start+1:end+1], scoring the last n."""
    if seq_len < 1 or not 1 <= stride <= seq_len:
        raise ValueError(f"need 1 <= stride <= seq_len, got seq_len={seq_len}, stride={stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n_tokens}: give more text")
    out = []
    first = min(seq_len + 1, n_tokens)  # targets [1, first) in the first window
    out.append((0, first - 1, first - 1))
    t = first
    while t < n_tokens:
        e = min(t + stride, n_tokens)  # targets [t, e)
        start = max(0, e - 1 - seq_len)
        out.append((start, e - 1, e - t))
        t = e
    return out


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    text: str | list[int] | torch.Tensor,
    seq_len: int = 512,
    stride: int = 256,
    max_tokens: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> dict[str, float | int]:
    """Perplexity of `model` on `text` (a string, tokenized with the tokenizer's defaults, or token ids).

    Returns {"ppl": exp(nll), "nll": mean negative log-likelihood per scored token in nats,
    "tokens": number of scored tokens}. `max_tokens` truncates the token stream first.
    """
    if isinstance(text, str):
        if tokenizer is None:
            raise ValueError("text given as a string needs a tokenizer: pass one or pass token ids")
        ids = tokenizer(text, verbose=False)["input_ids"]
    elif isinstance(text, torch.Tensor):
        ids = text.flatten().tolist()
    else:
        ids = list(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    plan = windows(len(ids), seq_len, stride)
    device = _device_of(model)
    stream = torch.tensor(ids, dtype=torch.long, device=device)
    keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    # Windows of equal input length batch together (all but possibly the first have seq_len).
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in plan:
        groups.setdefault(w[1] - w[0], []).append(w)
    total_nll = torch.zeros((), dtype=torch.float64)
    scored = 0
    was_training = model.training
    model.eval()  # no dropout while scoring
    bar = tqdm(total=len(plan), desc="perplexity", unit="win", disable=not progress)
    try:
        for group in groups.values():
            for i in range(0, len(group), batch_size):
                batch = group[i : i + batch_size]
                inputs = torch.stack([stream[s:e] for s, e, _ in batch])
                labels = torch.stack([stream[s + 1 : e + 1] for s, e, _ in batch])
                keep = max(n for _, _, n in batch)
                kwargs: dict[str, Any] = {"use_cache": False}
                if keep_logits:
                    kwargs["logits_to_keep"] = keep
                logits = model(inputs, **kwargs).logits[:, -keep:].float()
                logp = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, -keep:, None]).squeeze(-1)
                # Row r scores only its last n_r predictions.
                pos = torch.arange(keep, device=device)
                mask = pos[None, :] >= torch.tensor([keep - n for _, _, n in batch], device=device)[:, None]
                total_nll -= logp[mask].double().sum().cpu()
                scored += int(mask.sum())
                bar.update(len(batch))
    finally:
        bar.close()
        model.train(was_training)
    nll = float(total_nll) / scored
    return {"ppl": math.exp(nll), "nll": nll, "tokens": scored}


def _read_file(path: Path, column: str) -> list[str]:
    if path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as fh:
            rows = json.load(fh) if path.suffix == ".json" else [json.loads(line) for line in fh if line.strip()]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and column in r for r in rows):
            raise ValueError(f"{path}: expected records with a {column!r} field: pass --column")
        return [str(r[column]) for r in rows]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if column not in table.column_names:
            raise ValueError(f"{path} has no column {column!r} (has {table.column_names}): pass --column")
        return [str(x) for x in table.column(column).to_pylist()]
    return [path.read_text(encoding="utf-8")]


def load_text(
    text_files: Iterable[str | Path] = (),
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "test",
    column: str = "text",
) -> str:
    """The text to score: local files, a hub dataset (`datasets.load_dataset`), or the held-out slice.

    Files: .txt/.md/.rst read whole; .jsonl and .parquet contribute `column` per row. Documents join
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
        docs.extend(_read_file(path, column))
    if dataset:
        import datasets

        ds = datasets.load_dataset(dataset, dataset_config, split=split)
        if column not in ds.column_names:
            raise ValueError(f"dataset {dataset!r} has no column {column!r} (has {ds.column_names}): pass --column")
        docs.extend(str(x) for x in ds[column])
    if not files and not dataset:
        from linearize.convert.data import heldout_text

        return heldout_text()
    text = "\n\n".join(d for d in docs if d.strip())
    if not text:
        raise ValueError("the given source holds no text: check the files or --column")
    return text


DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192)


def usable_contexts(contexts: Iterable[int], n_tokens: int, max_positions: int | None = None) -> list[int]:
    """The requested context lengths this text and model can score: at most `max_positions`, and
    with at least one full window of text; sorted, without duplicates."""
    out = sorted({int(c) for c in contexts})
    if not out or out[0] < 2:
        raise ValueError(f"bad context lengths {sorted(contexts)}: give lengths of at least 2 tokens")
    dropped = [c for c in out if (max_positions and c > max_positions) or c > n_tokens - 1]
    if dropped:
        log.info("dropping context lengths %s (model limit %s, text of %d tokens)", dropped, max_positions, n_tokens)
    kept = [c for c in out if c not in dropped]
    if not kept:
        raise ValueError(
            f"the text has {n_tokens} tokens, too few for any of the context lengths {out}: give more text"
        )
    return kept


def perplexity_by_context(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    text: str | list[int],
    contexts: Iterable[int] = DEFAULT_CONTEXTS,
    max_tokens: int | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> list[dict[str, float | int]]:
    """Perplexity in non-overlapping windows of each context length, every length scoring the same tokens.

    The scored stream is cut to a whole number of the longest windows, so a change across lengths
    comes from context alone and not from which tokens were scored. Returns one row per length:
    {"context", "ppl", "nll", "tokens"}.
    """
    if isinstance(text, str) and tokenizer is None:
        raise ValueError("text given as a string needs a tokenizer: pass one or pass token ids")
    ids = tokenizer(text, verbose=False)["input_ids"] if isinstance(text, str) else list(text)
    if max_tokens is not None:
        ids = ids[: max_tokens + 1]
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    lengths = usable_contexts(contexts, len(ids), max_positions)
    budget = (len(ids) - 1) // lengths[-1] * lengths[-1]
    rows = []
    for length in lengths:
        res = perplexity(model, None, ids[: budget + 1], seq_len=length, stride=length, batch_size=batch_size, progress=progress)
        rows.append({"context": length, **res})
    return rows


def compare_contexts(
    student: list[dict[str, Any]], teacher: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """One row per context length: teacher and student perplexity and their ratio."""
    by_length = {r["context"]: r for r in teacher or []}
    rows = []
    for s in student:
        t = by_length.get(s["context"])
        rows.append(
            {
                "context": s["context"],
                "tokens": s["tokens"],
                "student": s["ppl"],
                "teacher": None if t is None else t["ppl"],
                "ratio": None if t is None else s["ppl"] / t["ppl"],
            }
        )
    return rows


def context_markdown(rows: list[dict[str, Any]], note: str = "") -> str:
    """The perplexity-against-context table as Markdown."""

    def cell(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| context | tokens | teacher ppl | student ppl | student / teacher |", "|---:|---:|---:|---:|---:|"]
    lines += [
        f"| {r['context']} | {r['tokens']} | {cell(r['teacher'], 2)} | {cell(r['student'], 2)} | {cell(r['ratio'], 3)} |"
        for r in rows
    ]
    return "\n".join(lines + ([f"\n{note}"] if note else [])) + "\n"


def render_context_table(rows: list[dict[str, Any]], title: str) -> Any:
    """The same table for the terminal (rich)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("context", "tokens", "teacher ppl", "student ppl", "S/T"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["context"]),
            str(r["tokens"]),
            "-" if r["teacher"] is None else f"{r['teacher']:.2f}",
            "-" if r["student"] is None else f"{r['student']:.2f}",
            "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
        )
    return table


def plot_contexts(curves: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """Perplexity against context length (log x), teacher dashed and student solid, one colour per text."""
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
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xlabel("context length (tokens)")
        a.grid(alpha=0.3)
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
    device: str = "cpu",
    batch_size: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """Perplexity against context for a model (and its teacher, when given) on each named text.

    Returns {"contexts": {text name: rows of `compare_contexts`}, "teacher", "student", "max_tokens"}.
    Lengths beyond the teacher's `max_position_embeddings` are dropped for both models.
    """
    from .models import load

    model, tokenizer, _ = load(student, device=device)
    if tokenizer is None:
        raise FileNotFoundError(f"{student!r} has no tokenizer: save one next to the model")
    limit = model.config.max_position_embeddings
    teacher_model = None
    if teacher:
        teacher_model, _, _ = load(teacher, device=device, with_tokenizer=False)
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
    return {"contexts": curves, "student": student, "teacher": teacher, "max_tokens": max_tokens}


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
