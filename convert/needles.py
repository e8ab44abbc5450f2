"""Needle-in-a-haystack documents: a fact planted at a depth of filler text, and a question about it.

One generator serves two users: the recall suite (`linearize recall`, `eval/recall.py`) scores
models on them, and retrieval placement (`retrieval.py`) probes which teacher layers fetch the
fact. Tasks (plain completion prompts; every answer is one number):
- `passkey`: the classic pass-key retrieval; a 5-digit key stated in one spot of repeated filler.
- `niah_single`: one "special magic number for <key> is: <7 digits>" needle in real prose (the
  held-out slice of the embedded corpus by default, repeated where a haystack needs more).
- `niah_multikey`: four such needles with different keys and numbers; the question asks for the
  one at the requested depth, the others sit at evenly spaced depths from it.
- `variable_tracking`: a chain `VAR A = 52819.` ... `VAR B = VAR A.` ... (four variables) starting at
  the requested depth, plus a distractor chain with another number at seeded depths; the question
  asks which number the last variable of the first chain holds.

A prompt is measured with the tokenizer as lm-eval's `hf` model encodes it (special tokens
included) and is at most `TOLERANCE` tokens short of its target, never over. The haystack is the
text between the instruction and the question; a needle at depth d starts at the sentence boundary
nearest to d of the haystack's tokens (0: first, 1: last, right before the question).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from .data import heldout_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TASKS = ("passkey", "niah_single", "niah_multikey", "variable_tracking")
TOLERANCE = 8  # a prompt is at most this many tokens short of its target
MULTIKEY_NEEDLES = 4
CHAIN_VARIABLES = 4

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_ADJECTIVES = (
    "amber", "ancient", "bitter", "brave", "calm", "crimson", "curious", "dusty", "eager", "fancy", "gentle",
    "golden", "hollow", "humble", "icy", "jolly", "lively", "lucky", "misty", "noble", "quiet", "rapid",
    "rusty", "silent", "silver", "sleepy", "sturdy", "tender", "vivid", "wild", "witty", "young",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "basket", "beacon", "candle", "canyon", "cedar", "comet", "falcon", "feather", "garden",
    "harbor", "island", "lantern", "meadow", "mirror", "otter", "pebble", "pepper", "piano", "river", "saddle",
    "shadow", "spruce", "thistle", "tiger", "tunnel", "valley", "violin", "walnut", "willow", "zebra",
)  # fmt: skip
_SENTENCE_END = re.compile(r"[.!?](?=\s)")
# Where a needle may go: after a sentence's trailing whitespace, or at the start of a line (the
# docs have long tables and code listings with neither sentences nor blank lines).
_BOUNDARY = re.compile(r"(?:[.!?]\s+|\n)\s*")
# Where an excerpt may start: a word, or any punctuation (so runs like "=====" in tables stay divisible).
_START = re.compile(r"(?<=\s)\S|[^\w\s]")
_HEADER_NIAH = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n\n"
)


class PromptTooShort(ValueError):
    """A length too short for a task's fixed text (instruction, needles, question)."""


@dataclass(frozen=True)
class Prompt:
    """What a task puts around the haystack; needles are (depth, sentence) in the order they must appear."""

    header: str
    needles: list[tuple[float, str]]
    question: str
    answer: str


def _numbers(rng: random.Random, digits: int, n: int) -> list[str]:
    low = 10 ** (digits - 1)
    return [str(v) for v in rng.sample(range(low, 10 * low), n)]


def _passkey(rng: random.Random, depth: float) -> Prompt:
    (key,) = _numbers(rng, 5, 1)
    return Prompt(
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n\n",
        [(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")],
        "\n\nWhat is the pass key? The pass key is",
        key,
    )


def _niah(rng: random.Random, depth: float, n: int) -> Prompt:
    keys = [f"{a}-{b}" for a, b in rng.sample([(a, b) for a in _ADJECTIVES for b in _NOUNS], n)]
    values = _numbers(rng, 7, n)
    depths = [depth] + [(depth + i / n) % 1.0 for i in range(1, n)]
    needles = [(d, f"One of the special magic numbers for {k} is: {v}.") for d, k, v in zip(depths, keys, values)]
    question = (
        f"\n\nWhat is the special magic number for {keys[0]} mentioned in the provided text? "
        f"The special magic number for {keys[0]} mentioned in the provided text is"
    )
    return Prompt(_HEADER_NIAH, needles, question, values[0])


def _variable_tracking(rng: random.Random, depth: float) -> Prompt:
    names: list[str] = []
    while len(names) < 2 * CHAIN_VARIABLES:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    chain, other = names[:CHAIN_VARIABLES], names[CHAIN_VARIABLES:]
    value, other_value = _numbers(rng, 5, 2)
    other_depths = sorted(rng.random() for _ in other)
    needles = []
    for variables, first, depths in (
        (chain, value, [depth + (1 - depth) * i / CHAIN_VARIABLES for i in range(CHAIN_VARIABLES)]),
        (other, other_value, other_depths),
    ):
        needles += [(depths[0], f"VAR {variables[0]} = {first}.")]
        needles += [(d, f"VAR {v} = VAR {prev}.") for d, v, prev in zip(depths[1:], variables[1:], variables)]
    last = chain[-1]
    return Prompt(
        "Memorize and track the chains of variable assignments hidden in the following text.\n\n",
        needles,
        f"\n\nQuestion: following the assignments, which number does VAR {last} hold? "
        f"Answer: VAR {last} holds the number",
        value,
    )


_PROMPTS: dict[str, Callable[[random.Random, float], Prompt]] = {
    "passkey": _passkey,
    "niah_single": lambda rng, depth: _niah(rng, depth, 1),
    "niah_multikey": lambda rng, depth: _niah(rng, depth, MULTIKEY_NEEDLES),
    "variable_tracking": _variable_tracking,
}


@cache
def heldout_prose() -> str:
    """The default haystack of the prose tasks: the held-out slice, which no stage trains on."""
    return heldout_text().strip()


def _source(task: str, prose: str | None = None) -> tuple[str, str]:
    """The task's filler and the separator between its repeats; `prose` replaces the held-out text."""
    return (PASSKEY_FILLER.strip(), " ") if task == "passkey" else (prose or heldout_prose(), "\n\n")


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str, special: bool = True) -> int:
    """Tokens of `text`; with `special`, as lm-eval's `hf` model encodes a context (e.g. with BOS)."""
    return len(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def _place(tokenizer: PreTrainedTokenizerBase, haystack: str, depths: Sequence[float]) -> list[int]:
    """Character offset for each depth: the boundary whose token prefix is nearest to depth x tokens."""
    bounds = sorted({0, len(haystack), *(m.end() for m in _BOUNDARY.finditer(haystack) if m.end() < len(haystack))})
    counts: dict[int, int] = {}

    def prefix(i: int) -> int:
        if i not in counts:
            counts[i] = count_tokens(tokenizer, haystack[: bounds[i]], special=False)
        return counts[i]

    total = prefix(len(bounds) - 1)
    out = []
    for depth in depths:
        want = depth * total
        lo, hi = 0, len(bounds) - 1  # first boundary with prefix >= want
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if prefix(mid) < want else (lo, mid)
        if lo > 0 and want - prefix(lo - 1) <= prefix(lo) - want:
            lo -= 1
        out.append(bounds[lo])
    return out


def _insert(haystack: str, needles: list[str], offsets: list[int]) -> str:
    """The haystack with each needle at its offset, keeping the given order where offsets tie."""
    parts, prev = [], 0
    for offset, needle in sorted(zip(offsets, needles), key=lambda p: p[0]):
        parts.append(haystack[prev:offset])
        parts.append(" " + needle if offset == len(haystack) else needle + " ")
        prev = offset
    parts.append(haystack[prev:])
    return "".join(parts)


def _render(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, haystack: str) -> str:
    offsets = _place(tokenizer, haystack, [d for d, _ in prompt.needles])
    return prompt.header + _insert(haystack, [s for _, s in prompt.needles], offsets) + prompt.question


def make_prompt(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    tokens: int,
    depth: float,
    rng: random.Random,
    prose: str | None = None,
) -> tuple[str, str]:
    """(prompt, answer) for `task` with `tokens` prompt tokens (at most `TOLERANCE` fewer) and the needle at `depth`.

    `prose`: the prose tasks' haystack instead of the held-out slice (retrieval placement probes the
    teacher on training text).

    The haystack is an excerpt of the task's filler (repeated as needed) that ends at a sentence end
    and starts at a word or punctuation mark; its start is binary-searched so the whole prompt hits the target.
    """
    prompt = _PROMPTS[task](rng, depth)
    fixed = count_tokens(tokenizer, _render(tokenizer, prompt, ""))
    budget = tokens - fixed
    if budget < 1:
        raise PromptTooShort(
            f"{tokens} prompt tokens are too few for {task}: its instruction, needles and question alone take "
            f"{fixed}; use a longer length"
        )
    source, sep = _source(task, prose)
    chars_per_token = len(source) / count_tokens(tokenizer, source, special=False)
    need = int(2 * tokens * chars_per_token) + 200
    tape = sep.join([source] * (need // len(source) + 2))
    end = _SENTENCE_END.search(tape, need + rng.randrange(len(source))).end()  # type: ignore[union-attr]
    starts = [0] + [m.start() for m in _START.finditer(tape, 0, end)]
    best: tuple[int, str] | None = None
    for _ in range(8):
        lo, hi = 0, len(starts) - 1  # the longest excerpt within budget
        while lo < hi:
            mid = (lo + hi) // 2
            if count_tokens(tokenizer, tape[starts[mid] : end], special=False) <= budget:
                hi = mid
            else:
                lo = mid + 1
        text = _render(tokenizer, prompt, tape[starts[lo] : end])
        n = count_tokens(tokenizer, text)
        if n <= tokens and (best is None or n > best[0]):
            best = (n, text)
        if tokens - TOLERANCE <= n <= tokens:
            break
        budget += tokens - n
    if best is None:
        raise ValueError(f"could not fit a {task} prompt into {tokens} tokens")
    return best[1], prompt.answer
