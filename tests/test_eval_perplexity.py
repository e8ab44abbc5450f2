"""Sliding-window perplexity against a per-token hand computation on a tiny random Llama."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from linearize.eval.perplexity import load_text, perplexity, windows

VOCAB = 128


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval()


def hand_nll(model: LlamaForCausalLM, ids: list[int], seq_len: int, stride: int) -> tuple[float, int]:
    """Mean NLL by one forward per token, with the context the documented windowing gives it.

    Token t (t >= 1) sits in the first window when t <= seq_len (context: everything before it);
    otherwise in chunk k = ceil((t - seq_len) / stride), whose targets end at
    e = min(seq_len + 1 + k * stride, N), and it sees ids[e - 1 - seq_len : t].
    """
    n = len(ids)
    total = 0.0
    for t in range(1, n):
        if t <= seq_len:
            start = 0
        else:
            k = math.ceil((t - seq_len) / stride)
            e = min(seq_len + 1 + k * stride, n)
            start = e - 1 - seq_len
        with torch.no_grad():
            logits = model(torch.tensor([ids[start:t]])).logits[0, -1]
        total -= torch.log_softmax(logits.double(), -1)[ids[t]].item()
    return total / (n - 1), n - 1


@pytest.mark.parametrize("seq_len,stride", [(16, 5), (16, 16), (8, 1), (64, 32)])
def test_matches_hand_computation(tiny, seq_len, stride):
    g = torch.Generator().manual_seed(seq_len * 100 + stride)
    ids = torch.randint(0, VOCAB, (41,), generator=g).tolist()
    got = perplexity(tiny, None, ids, seq_len=seq_len, stride=stride, batch_size=3)
    nll, count = hand_nll(tiny, ids, seq_len, stride)
    assert got["tokens"] == count == len(ids) - 1
    assert got["nll"] == pytest.approx(nll, rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_full_context_equals_model_loss(tiny):
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))
    got = perplexity(tiny, None, ids, seq_len=64, stride=32)
    with torch.no_grad():
        loss = tiny(ids[None], labels=ids[None]).loss.item()
    assert got["nll"] == pytest.approx(loss, rel=1e-5)


def test_batch_size_and_max_tokens(tiny):
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    a = perplexity(tiny, None, ids, seq_len=16, stride=4, batch_size=1)
    b = perplexity(tiny, None, ids, seq_len=16, stride=4, batch_size=7)
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-6)
    c = perplexity(tiny, None, ids, seq_len=16, stride=4, max_tokens=50)
    assert c["tokens"] == 49


def test_each_token_scored_once():
    for n, seq_len, stride in [(2, 4, 2), (100, 16, 5), (17, 16, 16), (1000, 64, 63)]:
        targets = []
        for start, end, k in windows(n, seq_len, stride):
            assert end - start <= seq_len and 1 <= k <= end - start
            targets.extend(range(end + 1 - k, end + 1))
        assert targets == list(range(1, n))


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="stride"):
        windows(10, 8, 9)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(tiny, None, [1], seq_len=8, stride=4)
    with pytest.raises(ValueError, match="tokenizer"):
        perplexity(tiny, None, "some text")


def test_load_text_sources(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "row one"}) + "\n" + json.dumps({"text": "row two"}) + "\n")
    pq.write_table(pa.table({"text": ["parquet row"]}), tmp_path / "c.parquet")
    text = load_text([tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet"])
    assert text == "plain text\n\nrow one\n\nrow two\n\nparquet row"
    with pytest.raises(ValueError, match="--column"):
        load_text([tmp_path / "b.jsonl"], column="body")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_text([tmp_path / "missing.txt"])
    folder = tmp_path / "hubstyle"
    folder.mkdir()
    (folder / "test.jsonl").write_text(json.dumps({"body": "from a dataset folder"}) + "\n")
    # A folder is loaded by `datasets.load_dataset`, the same call a hub name goes through.
    assert load_text(dataset=str(folder), split="test", column="body") == "from a dataset folder"
    heldout = load_text()
    assert isinstance(heldout, str) and len(heldout) > 1000
