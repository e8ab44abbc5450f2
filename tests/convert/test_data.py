"""Training data: packing with BOS/EOS, the fixed held-out slice, local files and folders."""

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from linearize.convert import data


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- packing -------------------------------------------------------------------------------------


def test_pack_joins_documents_with_bos_eos(tiny_tokenizer):
    tok = tiny_tokenizer
    docs = ["def f(x): return x", "The while statement is used for repeated execution.", "import os"]
    stream = []
    for doc in docs:
        stream += [tok.bos_token_id, *ids(tok, doc), tok.eos_token_id]
    rows = data.pack(docs, tok, seq_len=8)
    n = len(stream) // 8
    assert rows.dtype == torch.long and rows.shape == (n, 8)
    assert rows.flatten().tolist() == stream[: n * 8]  # the remainder shorter than a row is dropped
    assert rows[0, 0].item() == tok.bos_token_id
    flat = rows.flatten().tolist()
    first_eos = flat.index(tok.eos_token_id)
    assert flat[first_eos + 1] == tok.bos_token_id  # EOS of one doc, then BOS of the next


def test_pack_respects_the_token_budget(tiny_tokenizer):
    rows = data.pack([data.train_text()], tiny_tokenizer, seq_len=32, max_tokens=256)
    assert rows.shape == (8, 32)
    # a budget below one row still yields one row
    assert data.pack([data.train_text()], tiny_tokenizer, seq_len=32, max_tokens=5).shape == (1, 32)
    # stops reading documents once the budget is met (a generator is not drained)
    seen = []

    def docs():
        for i in range(1000):
            seen.append(i)
            yield "some words of text " * 20

    data.pack(docs(), tiny_tokenizer, seq_len=16, max_tokens=64)
    assert len(seen) < 10


def test_pack_too_little_text_is_a_clear_error(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"fewer than one sequence of 512: lower --seq-len"):
        data.pack(["tiny"], tiny_tokenizer, seq_len=512)


# ---- embedded corpus -----------------------------------------------------------------------------


def test_heldout_and_train_text_are_disjoint_and_fixed():
    from pydoc_data.topics import topics

    train, heldout = data.train_text(), data.heldout_text()
    assert train and heldout
    data._split.cache_clear()
    assert data.train_text() == train and data.heldout_text() == heldout  # fixed: recomputed, the same
    corpus = "\n\n".join(body for _, body in sorted(topics.items()))
    assert train + "\n\n" + heldout == corpus  # one cut at a paragraph break: no overlap, nothing lost
    assert 0.08 < len(heldout) / len(corpus) < 0.12  # about the last tenth


def test_embedded_dataset_splits():
    assert data.load_texts("embedded") == [data.train_text()]
    assert data.load_texts("embedded", split="validation") == [data.heldout_text()]
    digest = hashlib.sha256(data.heldout_text().encode()).hexdigest()
    assert digest == hashlib.sha256(data.load_texts("embedded", split="test")[0].encode()).hexdigest()


# ---- local files ---------------------------------------------------------------------------------


@pytest.fixture
def local_files(tmp_path):
    (tmp_path / "a.txt").write_text("plain text document")
    with (tmp_path / "b.jsonl").open("w") as f:
        for i in range(3):
            f.write(json.dumps({"text": f"jsonl doc {i}", "content": f"other {i}"}) + "\n")
        f.write("\n")  # blank lines are skipped
    pq.write_table(pa.table({"text": ["parquet one", "parquet two"], "content": ["c1", "c2"]}), tmp_path / "c.parquet")
    (tmp_path / "notes.csv").write_text("ignored,file\n")
    return tmp_path


def test_local_txt_jsonl_parquet(local_files):
    assert data.load_texts(str(local_files / "a.txt")) == ["plain text document"]
    assert data.load_texts(str(local_files / "b.jsonl")) == ["jsonl doc 0", "jsonl doc 1", "jsonl doc 2"]
    assert data.load_texts(str(local_files / "b.jsonl"), text_field="content") == ["other 0", "other 1", "other 2"]
    assert data.load_texts(str(local_files / "c.parquet")) == ["parquet one", "parquet two"]
    assert data.load_texts(str(local_files / "c.parquet"), text_field="content") == ["c1", "c2"]


def test_local_folder_reads_every_supported_file_in_order(local_files):
    texts = data.load_texts(str(local_files))
    assert texts == [
        "plain text document",
        "jsonl doc 0",
        "jsonl doc 1",
        "jsonl doc 2",
        "parquet one",
        "parquet two",
    ]


def test_local_data_packs(local_files, tiny_tokenizer):
    rows = data.pack(data.load_texts(str(local_files)), tiny_tokenizer, seq_len=4)
    assert rows.shape[1] == 4 and rows.shape[0] >= 4


@pytest.mark.parametrize("name", ["missing.txt", "missing.jsonl", "missing.parquet", "missing-dir/"])
def test_missing_file_is_a_clear_error(tmp_path, name):
    with pytest.raises(FileNotFoundError, match=r"dataset file '.*missing.*' not found: check the path"):
        data.load_texts(str(tmp_path / name))


def test_folder_without_data_is_a_clear_error(tmp_path):
    (tmp_path / "readme.md").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"has no \.txt, \.jsonl or \.parquet files"):
        data.load_texts(str(tmp_path))


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_missing_text_field_names_the_flag(tmp_path, suffix):
    path = tmp_path / f"d.{suffix}"
    if suffix == "jsonl":
        path.write_text(json.dumps({"body": "x"}) + "\n")
    else:
        pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(ValueError, match=r"has no 'text' field: pass its text column with --text-field"):
        data.load_texts(str(path))
    assert data.load_texts(str(path), text_field="body") == ["x"]
