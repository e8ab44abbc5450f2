"""Perplexity of a causal LM on a token stream, at one window length or against context length: what a
conversion reports before and after training, and what eval sweeps.

Windows hold `seq_len` input tokens. The first window scores every token it can predict; each later
window moves `stride` tokens on and scores only its last `stride` predictions, so each scored token
sees at least `seq_len - stride + 1` tokens of context (the first window's tokens see what precedes
them). `stride == seq_len` gives plain non-overlapping blocks; a smaller stride costs
`seq_len / stride` times more compute and gets closer to full-context perplexity.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SCORE_CHUNK_TOKENS = 256  # positions whose logits exist at once when a window is scored


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


@contextmanager
def final_hidden_states(model: PreTrainedModel) -> Iterator[list[torch.Tensor]]:
    """Collect the decoder's last hidden states on each forward, so the loss can make logits a chunk at a time."""
    captured: list[torch.Tensor] = []
    hook = model.base_model.register_forward_hook(
        lambda module, args, output: captured.append(getattr(output, "last_hidden_state", None))
    )
    try:
        yield captured
    finally:
        hook.remove()


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The family's logits from final hidden states: its output head, logit scaling and final soft-capping."""
    logits = model.get_output_embeddings()(hidden)
    config = model.base_model.config
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return logits.float()


def _rowwise_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) from full logits, one row's log-softmax at a time: no float copy of the whole batch's logits."""
    return torch.stack(
        [torch.log_softmax(row.float(), -1).gather(-1, target[:, None]).squeeze(-1) for row, target in zip(logits, labels)]
    )


def _token_logprobs(
    model: PreTrainedModel, inputs: torch.Tensor, labels: torch.Tensor, keep: int, chunked: bool | None
) -> tuple[torch.Tensor, bool]:
    """(log p(label) [B, keep] of the last `keep` positions, whether they were made in chunks).

    Logits are made SCORE_CHUNK_TOKENS positions at a time from the final hidden states when the
    model's head reproduces its own last logits (its scaling and soft-capping are known; `chunked`
    None checks this, True trusts an earlier check), so no [B, keep, vocabulary] tensor exists; any
    other model is scored from its full logits.
    """
    labels = labels[:, -keep:]
    if chunked is not False:
        with final_hidden_states(model) as hidden:
            last = model(inputs, use_cache=False, logits_to_keep=1).logits
        states = hidden[0][:, -keep:] if len(hidden) == 1 and hidden[0] is not None else None
        if chunked is None:
            chunked = states is not None and torch.allclose(
                head_logits(model, states[:, -1:]), last.float(), rtol=1e-4, atol=1e-4
            )
        if chunked:
            parts = []
            for start in range(0, keep, SCORE_CHUNK_TOKENS):
                logits = head_logits(model, states[:, start : start + SCORE_CHUNK_TOKENS])
                target = labels[:, start : start + SCORE_CHUNK_TOKENS, None]
                parts.append(logits.log_softmax(-1).gather(-1, target).squeeze(-1))
            return torch.cat(parts, dim=1), True
    logits = model(inputs, use_cache=False, logits_to_keep=keep).logits[:, -keep:]
    return _rowwise_logprobs(logits, labels), False


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
    chunked = None  # whether logits can be made a chunk at a time: checked on the first window
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
                if keep_logits:
                    logp, chunked = _token_logprobs(model, inputs, labels, keep, chunked)
                else:
                    logp = _rowwise_logprobs(model(inputs, use_cache=False).logits[:, -keep:], labels[:, -keep:])
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


def usable_contexts(contexts: Iterable[int], n_tokens: int, max_positions: int | None = None) -> list[int]:
    """The requested context lengths this text and model can score: at most `max_positions`, and
    with at least one full window of text; sorted, without duplicates."""
    out = sorted({int(c) for c in contexts})
    if not out or out[0] < 2:
        raise ValueError(f"bad context lengths {sorted(contexts)}: give lengths of at least 2 tokens")
    dropped = [c for c in out if (max_positions and c > max_positions) or c > n_tokens - 1]
    if dropped:
        logger.info("dropping context lengths %s (model limit %s, text of %d tokens)", dropped, max_positions, n_tokens)
    kept = [c for c in out if c not in dropped]
    if not kept:
        raise ValueError(
            f"the text has {n_tokens} tokens, too few for any of the context lengths {out}: give more text"
        )
    return kept


def shared_tokens(ids: list[int], lengths: list[int]) -> list[int]:
    """The stream cut to a whole number of the longest (last) length's windows, plus the last target: every
    length then scores the same tokens."""
    budget = (len(ids) - 1) // lengths[-1] * lengths[-1]
    return ids[: budget + 1]


def perplexity_by_context(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    text: str | list[int],
    contexts: Iterable[int],
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
    ids = shared_tokens(ids, lengths)
    rows = []
    for length in lengths:
        res = perplexity(model, None, ids, seq_len=length, stride=length, batch_size=batch_size, progress=progress)
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
