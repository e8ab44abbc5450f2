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
