"""Training and held-out text, and packing it into fixed-length token sequences.

The embedded corpus is CPython's own documentation (`pydoc_data.topics`, always installed), joined
in topic-name order. Its last tenth (cut at a paragraph break) is the held-out slice: never trained
on, used for perplexity.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
HELDOUT_FRACTION = 0.1


@lru_cache(maxsize=1)
def _split() -> tuple[str, str]:
    from pydoc_data.topics import topics

    text = "\n\n".join(body for _, body in sorted(topics.items()))
    cut = text.find("\n\n", int(len(text) * (1 - HELDOUT_FRACTION)))
    return text[:cut], text[cut + 2 :]


def train_text() -> str:
    """The embedded corpus minus the held-out slice."""
    return _split()[0]


def heldout_text() -> str:
    """The fixed held-out slice of the embedded corpus (its last tenth)."""
    return _split()[1]


def _read_local(path: Path, text_field: str) -> list[str]:
    missing = ValueError(f"{str(path)!r} has no {text_field!r} field: pass its text column with --text-field")
    if path.suffix == ".jsonl":
        with path.open() as f:
            try:
                return [json.loads(line)[text_field] for line in f if line.strip()]
            except KeyError:
                raise missing from None
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        if text_field not in pq.read_schema(path).names:
            raise missing
        return [str(x) for x in pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()]
    return [path.read_text()]


def load_texts(dataset: str, split: str = "train", text_field: str = "text", config: str | None = None) -> list[str]:
    """Documents from `embedded`, local .txt/.jsonl/.parquet files (or a folder of them), or a hub dataset name."""
    if dataset == EMBEDDED:
        return [train_text()] if split == "train" else [heldout_text()]
    path = Path(dataset).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".txt", ".jsonl", ".parquet"))
        if not files:
            raise FileNotFoundError(f"{dataset!r} has no .txt, .jsonl or .parquet files: add some or pass a file")
        return [t for f in files for t in _read_local(f, text_field)]
    if path.is_file():
        return _read_local(path, text_field)
    if path.suffix in (".txt", ".jsonl", ".parquet") or dataset.startswith((".", "/")):
        raise FileNotFoundError(f"dataset file {dataset!r} not found: check the path")
    import datasets

    ds = datasets.load_dataset(dataset, config, split=split, streaming=True)
    return (row[text_field] for row in ds)


def pack(
    texts, tokenizer: PreTrainedTokenizerBase, seq_len: int, max_tokens: int | None = None
) -> torch.Tensor:
    """Tokenize documents, join them with BOS/EOS and cut the stream into [N, seq_len] sequences."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream: list[int] = []
    budget = None if max_tokens is None else max(seq_len, max_tokens)
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        stream.extend(([bos] if bos is not None else []) + ids + ([eos] if eos is not None else []))
        if budget is not None and len(stream) >= budget:
            break
    n = len(stream) // seq_len if budget is None else min(len(stream), budget) // seq_len
    if n == 0:
        raise ValueError(f"the dataset gave {len(stream)} tokens, fewer than one sequence of {seq_len}: lower --seq-len")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
