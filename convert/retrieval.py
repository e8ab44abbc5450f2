"""Retrieval placement: keep softmax in the layers whose teacher attention fetches facts from far back.

A converted layer is exact softmax over its window and sinks; further back it has only the linear
state, which blurs single tokens. The heads that copy a planted fact from thousands of tokens back
(retrieval heads) therefore have to stay softmax for the student to keep long-context recall, and
they sit in a few layers. A layer's score is the attention its heads put on the fact's tokens from
the positions that produce the answer, averaged over the recall suite's needle tasks with every fact
placed further back than the window. The prompts use the training text as haystack, never the
held-out slice the recall suite and perplexity are measured on; only the teacher runs, no training.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..modeling.modeling_linearize import LinearAttention, linear_attentions
from ..modeling.modes import teacher_attention
from . import needles
from .plan import LINEAR
from .swap import linearize_model

logger = logging.getLogger(__name__)

PROBE_DEPTHS = (0.0, 0.25, 0.5)  # the fact's depth in the haystack; kept only where it lies beyond the window
PROBE_SAMPLES = 2  # documents per task and depth
MIN_PROBE_TOKENS = 2048
ANSWER_TOKENS = 12  # room left after the prompt, as the recall suite leaves for generation
HAYSTACK_CHARS = 400_000  # training text the probes cut their haystacks from


def probe_length(window: int, max_positions: int | None) -> int:
    """Probe prompt length: at least 4 windows (so the facts sit well outside it), within the model's context."""
    length = max(MIN_PROBE_TOKENS, 4 * window)
    return min(length, max_positions) if max_positions else length


def haystack_text(texts: Iterable[str], chars: int = HAYSTACK_CHARS) -> str:
    """The first `chars` characters of the documents (a streamed dataset is read only that far)."""
    parts, size = [], 0
    for text in texts:
        parts.append(text)
        size += len(text)
        if size >= chars:
            break
    return "\n\n".join(parts)[:chars]


def probe_depths(length: int, window: int) -> list[float]:
    """The probe depths whose fact lies more than two windows before the end of a `length`-token prompt."""
    return [depth for depth in PROBE_DEPTHS if (1 - depth) * length > 2 * window]


def probe_token_count(window: int, max_positions: int | None) -> int:
    """Tokens the probe runs through the teacher (the budget's time estimate)."""
    length = probe_length(window, max_positions)
    return len(needles.TASKS) * len(probe_depths(length, window)) * PROBE_SAMPLES * length


def probe_tokens(tokenizer: PreTrainedTokenizerBase, text: str, answer: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt + answer token ids, positions of the prompt tokens that spell the answer, positions that predict it)."""
    encoded = tokenizer(text, return_offsets_mapping=True, verbose=False)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    starts = [i for i in range(len(text)) if text.startswith(answer, i)]
    fact = [j for j, (a, b) in enumerate(offsets) if b > a and any(a < s + len(answer) and b > s for s in starts)]
    written = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    return ids + written, fact, list(range(len(ids) - 1, len(ids) + len(written) - 1))


def probe_documents(
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    window: int,
    haystack: str,
    seed: int = 0,
    tasks: Sequence[str] = needles.TASKS,
) -> list[tuple[list[int], list[int], list[int]]]:
    """The probes as `probe_tokens` triples: `PROBE_SAMPLES` of every task at each of `probe_depths`.

    A task whose instruction, needles and question alone do not fit `length` is left out; the list is
    empty when no depth puts a fact beyond the window.
    """
    if not tokenizer.is_fast:
        raise ValueError("retrieval placement needs a fast tokenizer (token offsets): use measured or spread placement")
    documents = []
    for task in tasks:
        task_documents = []
        try:
            for depth in probe_depths(length, window):
                for sample in range(PROBE_SAMPLES):
                    rng = random.Random(f"linearize-placement:{seed}:{task}:{depth!r}:{sample}")
                    text, answer = needles.make_prompt(task, tokenizer, length - ANSWER_TOKENS, depth, rng, haystack)
                    task_documents.append(probe_tokens(tokenizer, text, answer))
        except needles.PromptTooShort:
            continue  # the task's fixed text alone overflows `length`, at every depth alike
        documents += task_documents
    return documents


def attention_on_facts(
    teacher: PreTrainedModel, linear_attention: dict, documents: list[tuple[list[int], list[int], list[int]]]
) -> dict[int, float]:
    """Per layer: the teacher's attention mass (summed over heads) on the fact while it writes the fact, averaged.

    The weights are recomputed from each layer's own q and k (the family's projections and RoPE), for
    the few answer positions only, so no [T, T] attention map of the teacher is ever materialized.
    """
    n_layers = teacher.config.get_text_config().num_hidden_layers
    device = next(teacher.parameters()).device
    # The unused linear parts' random init must not move the run's RNG: a kept plan then trains the same student.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        every = linearize_model(teacher, [LINEAR] * n_layers, linear_attention)
    scores = torch.zeros(n_layers, dtype=torch.float64)
    probe: dict[str, torch.Tensor] = {}

    def record(module: LinearAttention, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        rotary = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        q, k, _ = module.project(hidden)
        q, k = module.apply_rotary(q, k, *rotary)
        queries = probe["queries"]
        k = k.repeat_interleave(module.kv_groups, dim=1).float()
        logits = (q[:, :, queries].float() @ k.transpose(-1, -2)) * module.scaling
        later = torch.arange(k.shape[2], device=k.device)[None, :] > queries[:, None]
        weights = logits.masked_fill(later, float("-inf")).softmax(-1)
        scores[module.layer_idx] += weights[..., probe["fact"]].sum(-1).mean(-1).sum().item()

    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in linear_attentions(every)]
    try:
        with teacher_attention(every), torch.no_grad():
            for ids, fact, queries in tqdm(documents, desc="retrieval probe", unit="doc", leave=False):
                probe["fact"] = torch.tensor(fact, device=device)
                probe["queries"] = torch.tensor(queries, device=device)
                every.base_model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {i: float(s) / len(documents) for i, s in enumerate(scores.tolist())}


def retrieval_scores(
    teacher: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, linear_attention: dict, haystack: str, seed: int = 0
) -> dict[int, float]:
    """The retrieval placement's per-layer scores: probes sized to the window, on `haystack` (training text).

    Empty when the model's context is too short to place a fact beyond the window.
    """
    window = linear_attention.get("window") or 0
    length = probe_length(window, getattr(teacher.config.get_text_config(), "max_position_embeddings", None))
    documents = probe_documents(tokenizer, length, window, haystack, seed)
    if not documents:
        logger.warning(
            "retrieval placement: the model's %d-token context holds no fact beyond the %d-token window, so no "
            "layer retrieves past it; the softmax layers are spread instead",
            length,
            window,
        )
        return {}
    logger.info("retrieval probe: %d documents of %d tokens", len(documents), length)
    return attention_on_facts(teacher, linear_attention, documents)
