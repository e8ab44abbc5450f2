"""Sliding-window perplexity against a per-token hand computation on a tiny random Llama."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from linearize.convert.card import context_markdown
from linearize.convert.measure import compare_contexts, perplexity, perplexity_by_context, usable_contexts, windows
from linearize.eval.perplexity import load_text, plot_contexts
from conftest import tiny_fields

VOCAB = 128


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**tiny_fields(vocab_size=VOCAB, max_position_embeddings=256))
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


@pytest.mark.parametrize("softcap", [None, 0.05])
def test_logits_come_a_chunk_at_a_time_when_the_head_is_known(tiny, monkeypatch, softcap):
    from linearize.convert import measure

    monkeypatch.setattr(measure, "SCORE_CHUNK_TOKENS", 5)
    # Llama's forward ignores a soft-cap its config names: the head then is not the one head_logits knows.
    monkeypatch.setattr(tiny.config, "final_logit_softcapping", softcap, raising=False)
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(3))
    logp, chunked = measure._token_logprobs(tiny, ids[:, :-1], ids[:, 1:], 23, None)
    assert chunked is (softcap is None)
    with torch.no_grad():
        reference = torch.log_softmax(tiny(ids[:, :-1]).logits[:, -23:].double(), -1).gather(-1, ids[:, -23:, None])
    torch.testing.assert_close(logp.double(), reference.squeeze(-1), rtol=1e-5, atol=1e-5)
    got = perplexity(tiny, None, ids[0], seq_len=16, stride=5, batch_size=2)
    nll, _ = hand_nll(tiny, ids[0].tolist(), 16, 5)
    assert got["nll"] == pytest.approx(nll, rel=1e-5)


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
    with pytest.raises(ValueError, match="--text-field"):
        load_text([tmp_path / "b.jsonl"], text_field="body")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_text([tmp_path / "missing.txt"])
    folder = tmp_path / "hubstyle"
    folder.mkdir()
    (folder / "test.jsonl").write_text(json.dumps({"body": "from a dataset folder"}) + "\n")
    # A folder is loaded by `datasets.load_dataset`, the same call a hub name goes through.
    assert load_text(dataset=str(folder), split="test", text_field="body") == "from a dataset folder"
    heldout = load_text()
    assert isinstance(heldout, str) and len(heldout) > 1000


def test_perplexity_by_context_matches_hand_computation(tiny):
    """Each length: non-overlapping windows over the same tokens; every token sees only its own window."""
    ids = torch.randint(0, VOCAB, (75,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = perplexity_by_context(tiny, None, ids, contexts=[32, 8, 16])
    assert [r["context"] for r in rows] == [8, 16, 32]
    budget = 64  # 74 predictable tokens, cut to a whole number of the longest (32-token) windows
    for row in rows:
        L = row["context"]
        total = 0.0
        with torch.no_grad():
            for start in range(0, budget, L):
                window = torch.tensor([ids[start : start + L + 1]])
                logp = torch.log_softmax(tiny(window[:, :-1]).logits.double(), -1)
                total -= logp[0].gather(-1, window[0, 1:, None]).sum().item()
        assert row["tokens"] == budget
        assert row["nll"] == pytest.approx(total / budget, rel=1e-5)
        assert row["ppl"] == pytest.approx(math.exp(total / budget), rel=1e-5)


def test_contexts_past_the_model_or_text_are_dropped(tiny):
    assert usable_contexts([512, 64, 128], n_tokens=200, max_positions=256) == [64, 128]
    assert usable_contexts([64, 128, 512], n_tokens=10_000, max_positions=256) == [64, 128]
    with pytest.raises(ValueError, match="too few"):
        usable_contexts([512], n_tokens=100)
    rows = perplexity_by_context(tiny, None, list(range(2, 100)), contexts=[16, 512])  # tiny allows 256
    assert [r["context"] for r in rows] == [16]


def test_context_comparison_table_and_plot(tmp_path):
    student = [{"context": 8, "ppl": 12.0, "tokens": 64}, {"context": 16, "ppl": 10.0, "tokens": 64}]
    teacher = [{"context": 8, "ppl": 10.0, "tokens": 64}, {"context": 16, "ppl": 8.0, "tokens": 64}]
    rows = compare_contexts(student, teacher)
    assert [r["ratio"] for r in rows] == [pytest.approx(1.2), pytest.approx(1.25)]
    md = context_markdown(rows)
    assert "| 16 | 64 | 8.00 | 10.00 | 1.250 |" in md
    png = plot_contexts({"text": rows}, tmp_path / "context.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--contexts", "512,big"], "--contexts"),
        (["--context-tokens", "0"], "--context-tokens"),
        (["--texts", "wiki"], "pydoc, britannica"),
        (["--texts", ","], "--texts is empty"),
    ],
)
def test_ppl_refuses_bad_context_settings_before_loading(linearize_main, args, message):
    code, out, err = linearize_main("ppl", "/no/such/model", *args)  # a model load would fail differently
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out
