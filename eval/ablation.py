"""Ablations for length: which choices make the linear layers hold up as context grows.

Every variant is the same conversion with a few recipe keys changed (dotted overrides, as the CLI
applies them), trained in memory with no export, then scored by perplexity against context on the
held-out texts. The teacher is scored once, on the same tokens. The result is a table (Markdown and
JSON) and a PNG of student/teacher against context for every variant.

    python -m linearize.eval.ablation --output out/ablation \\
        --variant "baseline:" \\
        --variant "unrotated:attention.rope_features=false" \\
        --variant "4K curriculum:transfer.seq_len=[512,4096]"
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from .perplexity import DEFAULT_CONTEXTS, compare_contexts, perplexity_by_context

log = logging.getLogger(__name__)


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'name:key=value,key=value' -> (name, {key: value}); values are YAML (numbers, lists, booleans)."""
    name, sep, body = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"bad --variant {text!r}: write NAME:key=value,key=value (NAME: alone is the base recipe)")
    overrides: dict[str, Any] = {}
    for part in _split_top(body):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad override {part!r} in --variant {text!r}: write key=value, e.g. transfer.tokens=8192")
        overrides[key.strip()] = yaml.safe_load(value)
    return name.strip(), overrides


def _split_top(body: str) -> list[str]:
    """Split on commas outside brackets, so list values like [512,4096] stay whole."""
    parts, depth, current = [], 0, ""
    for ch in body:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in (x.strip() for x in parts) if p]


def run_ablation(
    variants: list[tuple[str, dict[str, Any]]],
    recipe: str = "smollm2-gla",
    base: dict[str, Any] | None = None,
    texts: dict[str, str] | None = None,
    contexts: list[int] | None = None,
    max_tokens: int = 8192,
    output: str | Path | None = None,
) -> dict[str, Any]:
    """Train each variant (base overrides, then its own) and score it against the teacher by context."""
    from accelerate import Accelerator

    from linearize.convert.data import heldout_text
    from linearize.convert.pipeline import apply_overrides, convert
    from linearize.convert.recipes import load_recipe
    from linearize.convert.sources import load_model

    contexts = list(contexts or DEFAULT_CONTEXTS)
    texts = texts or {"pydoc": heldout_text()}
    base_recipe = apply_overrides(load_recipe(recipe), base or {})
    recipes = [(name, apply_overrides(base_recipe, overrides)) for name, overrides in variants]  # validate first
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    teacher, tokenizer, _ = load_model(base_recipe.model, dtype=base_recipe.torch_dtype(accelerator.device))
    teacher.eval()
    ids = {name: tokenizer(text, verbose=False)["input_ids"] for name, text in texts.items()}
    teacher_rows = {name: _teacher_rows(teacher, i, contexts, max_tokens, output, name) for name, i in ids.items()}
    results = []
    for (name, overrides), (_, variant) in zip(variants, recipes):
        log.info("variant %s: %s", name, overrides)
        started = time.perf_counter()
        student, report = convert(teacher, tokenizer, recipe=variant, accelerator=accelerator, measure=False)
        seconds = time.perf_counter() - started
        curves = {
            text: compare_contexts(perplexity_by_context(student, None, i, contexts, max_tokens), teacher_rows[text])
            for text, i in ids.items()
        }
        results.append({"variant": name, "overrides": overrides, "train_seconds": seconds, "contexts": curves})
        del student
        if output is not None:
            write_outputs(results, base or {}, Path(output))
    return {"recipe": recipe, "base": base or {}, "results": results}


def _teacher_rows(
    teacher: torch.nn.Module, ids: list[int], contexts: list[int], max_tokens: int, output: str | Path | None, name: str
) -> list[dict[str, Any]]:
    """The teacher's perplexity by context, kept in the output folder: it is the same for every run."""
    key = json.dumps([name, len(ids), sum(ids) % 1_000_003, contexts, max_tokens])
    cache = None if output is None else Path(output) / "teacher.json"
    saved = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    if key not in saved:
        saved[key] = perplexity_by_context(teacher, None, ids, contexts, max_tokens)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(saved))
    return saved[key]


def markdown(results: list[dict[str, Any]]) -> str:
    """One row per variant and text: student/teacher perplexity at every context length."""
    contexts = [r["context"] for r in next(iter(results[0]["contexts"].values()))]
    head = "| variant | text | " + " | ".join(str(c) for c in contexts) + " | train s |"
    lines = [head, "|---|---|" + "---:|" * (len(contexts) + 1)]
    for res in results:
        for text, rows in res["contexts"].items():
            cells = " | ".join(f"{r['ratio']:.3f}" for r in rows)
            lines.append(f"| {res['variant']} | {text} | {cells} | {res['train_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = list(results[0]["contexts"])
    fig, axes = plt.subplots(1, len(texts), figsize=(5.5 * len(texts), 3.8), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for res in results:
            rows = res["contexts"][text]
            ax.plot([r["context"] for r in rows], [r["ratio"] for r in rows], marker="o", label=res["variant"])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("student / teacher perplexity")
        ax.set_title(f"ablation, {text}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(results: list[dict[str, Any]], base: dict[str, Any], output: Path) -> None:
    """ablation.json, ablation.md and ablation.png, rewritten after every variant (nothing is lost)."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "ablation.json").write_text(json.dumps({"base": base, "results": results}, indent=1))
    (output / "ablation.md").write_text(markdown(results))
    plot(results, output / "ablation.png")


def main(argv: list[str] | None = None) -> int:
    from linearize.convert.data import eval_text

    from .bench import parse_int_list

    p = argparse.ArgumentParser(prog="python -m linearize.eval.ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True, help="NAME:key=value,... (repeatable)")
    p.add_argument("--recipe", default="smollm2-gla")
    p.add_argument("--base", default="", help="overrides every variant starts from, key=value,...")
    p.add_argument("--texts", default="pydoc", help="held-out texts, comma-separated (pydoc, britannica)")
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens scored per text and length")
    p.add_argument("--output", required=True, help="folder for ablation.json/.md/.png")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        variants = [parse_variant(v) for v in args.variant]
        base = parse_variant(f"base:{args.base}")[1]
        texts = {name: eval_text(name) for name in args.texts.split(",") if name}
        result = run_ablation(
            variants, args.recipe, base, texts, parse_int_list(args.contexts, "contexts"), args.max_tokens, args.output
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    print(markdown(result["results"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
