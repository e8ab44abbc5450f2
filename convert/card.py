"""The model card: the export's README.md, ready for the Hub.

It opens with the Hub's front matter (base_model, license, pipeline_tag, library_name, tags), names
the teacher by its own name, shows usage that runs as written (`trust_remote_code=True` wherever a
loader reads the export's config, the chat template for instruct teachers), and ends with the
measured tables. Each table sits in its own marked block: the conversion writes its report, and
`linearize eval`, `ppl`, `recall` and `bench` each replace their block when they run again.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from .plan import LINEAR, SLIDING, describe

logger = logging.getLogger(__name__)

# Marked blocks in the order a first run of each verb adds them, with the heading each gets.
SECTIONS = {
    "conversion": "Conversion",
    "perplexity": "Perplexity against context",
    "eval": "Benchmarks",
    "recall": "Long-context recall",
    "bench": "Speed and memory",
}
HUB = "https://huggingface.co/"


def markers(section: str) -> tuple[str, str]:
    return f"<!-- linearize-{section} -->", f"<!-- /linearize-{section} -->"


def teacher_facts(spec: str, chat_template: bool) -> dict[str, Any]:
    """What the card says of the teacher: its name, its hub id and license where the source tells them, and
    whether it is an instruct model with a chat template. Nothing here fails a conversion: an unknown fact is None."""
    from .sources import EMBEDDED, _gguf_file, resolve

    facts: dict[str, Any] = {"name": None, "hub_id": None, "license": None, "chat": chat_template}
    try:
        source = resolve(spec)
    except (ValueError, OSError):  # a model in memory: its recorded name is all there is
        return facts | {"name": Path(spec).name or None}
    if source.kind in ("embedded", "gguf"):
        gguf = _gguf_file(source)
        hub_id = EMBEDDED[source.location].hub_id if source.kind == "embedded" else None
        facts.update(hub_id=hub_id, name=hub_id.split("/")[-1] if hub_id else gguf.stem, license=_gguf_license(gguf))
    elif source.kind == "hub":
        facts.update(hub_id=spec, name=spec.split("/")[-1], license=_front_matter(_hub_readme(spec)).get("license"))
    else:
        front = _front_matter(Path(source.location) / "README.md")
        base = front.get("base_model")
        facts.update(
            name=Path(source.location).resolve().name,
            hub_id=base if isinstance(base, str) else None,
            license=front.get("license"),
        )
    return facts


def _gguf_license(path: Path) -> str | None:
    """`general.license` from a GGUF file's metadata (no tensor is read)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("general.license")
        return None if field is None else str(field.contents())
    except Exception as err:  # a card without a license is better than a failed conversion
        logger.info("could not read the GGUF license of %s: %s", path, err)
        return None


def _hub_readme(hub_id: str) -> Path | None:
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(hub_id, "README.md"))
    except Exception as err:  # offline, gated, or no card: the export's card goes without the license
        logger.info("could not read the model card of %s: %s", hub_id, err)
        return None


def _front_matter(readme: Path | None) -> dict[str, Any]:
    """The YAML front matter of a model card, or {}."""
    if readme is None or not readme.is_file():
        return {}
    import yaml

    match = re.match(r"^---\s*\n(.*?)\n---\s*\n", readme.read_text(encoding="utf-8", errors="replace"), re.DOTALL)
    try:
        data = yaml.safe_load(match.group(1)) if match else None
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def model_id_for(output: Path) -> str:
    """How the card's snippet names the export: the folder relative to where the conversion ran, if below it."""
    try:
        return str(output.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(output.resolve())


def model_card(config: Any, teacher: dict[str, Any], model_id: str, recipe: str | None = None) -> str:
    """The card's text before any measurement: front matter, what the model is, usage, how to publish it."""
    settings = config.linear_attention
    kinds = config.layer_types
    linear = kinds.count(LINEAR)
    softmax = len(kinds) - linear
    sliding = kinds.count(SLIDING)
    name = teacher.get("name") or config.linearize_teacher or config.base_model_type
    kind = settings["kind"]
    front = ["---"]
    if teacher.get("hub_id"):
        front.append(f"base_model: {teacher['hub_id']}")
    if teacher.get("license"):
        front.append(f"license: {teacher['license']}")
    front += [
        "pipeline_tag: text-generation",
        "library_name: transformers",
        "tags:",
        *(f"- {tag}" for tag in ("linearize", "linear-attention", "hybrid-attention", kind)),
        "---",
    ]
    teacher_ref = f"[{teacher['hub_id']}]({HUB}{teacher['hub_id']})" if teacher.get("hub_id") else f"`{name}`"
    window = settings.get("window") or 0
    local = (
        f", with a {window}-token softmax window and {settings.get('sink') or 0} attention sinks inside each linear layer"
        if window
        else ""
    )
    plan = " ".join(describe(kinds))
    body = [
        f"# {name}, linearized ({kind.upper() if kind == 'gla' else kind}, {linear} of {len(kinds)} layers linear)",
        "",
        f"A hybrid of {teacher_ref}: {linear} of its {len(kinds)} attention layers are linear attention "
        f"({kind}, feature map {settings['feature_map']}, gate {settings['gate']}{local}); "
        + {0: "no layer keeps softmax attention. ", 1: "the other keeps softmax attention. "}.get(
            softmax, f"the other {softmax} keep softmax attention. "
        )
        + (f"{sliding} of those are the teacher's sliding-window layers, whose cache is bounded already. " if sliding else "")
        + "A linear layer's cache is a fixed-size state, so its memory does not grow with the "
        "context. Converted with `linearize`"
        + (f" (recipe `{recipe}`; `recipe.yaml` in this folder repeats the run)." if recipe else "."),
        "",
        f"Layer plan (L linear, S softmax, W sliding-window softmax): `{plan}`",
        "",
        "## Usage",
        "",
        "The model's code ships in this folder: it needs `torch` and `transformers` (Triton optional) and",
        "`trust_remote_code=True` wherever a loader reads its config.",
        "",
        "```python",
        *_snippet(model_id, bool(teacher.get("chat"))),
        "```",
        "",
        "The backbone alone (hidden states and the cache): "
        f'`AutoModel.from_pretrained("{model_id}", trust_remote_code=True)`. '
        "With lm-evaluation-harness: "
        f"`lm_eval --model hf --model_args pretrained={model_id},trust_remote_code=True --tasks hellaswag`.",
        "",
        "## Publishing",
        "",
        f"`hf upload YOUR-NAME/{Path(model_id).name} {model_id} .` uploads this folder as a Hub model "
        "(log in first with `hf auth login`); then load it by that repo id.",
        "",
        "## Results",
        "",
        "Measured by linearize; `linearize eval`, `ppl`, `recall` and `bench` add their tables here.",
        "",
    ]
    return "\n".join(front + [""] + body)


def _snippet(model_id: str, chat: bool) -> list[str]:
    lines = [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model_id = "{model_id}"',
        "tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=True)",
        "model = AutoModelForCausalLM.from_pretrained(model_id, trust_remote_code=True)",
        "",
    ]
    if chat:
        lines += [
            'messages = [{"role": "user", "content": "Explain what a hash table is in two sentences."}]',
            "inputs = tokenizer.apply_chat_template(",
            '    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True',
            ")",
        ]
    else:
        lines.append('inputs = tokenizer("The Python programming language", return_tensors="pt")')
    lines += [
        "output = model.generate(**inputs, max_new_tokens=64, do_sample=False)",
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
    ]
    return lines


def update_section(folder: str | Path, section: str, markdown: str) -> None:
    """Put `markdown` in the card's block `section`, replacing the block an earlier run wrote or appending it
    under its heading; the card is replaced in one step."""
    readme = Path(folder) / "README.md"
    begin, end = markers(section)
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + f"### {SECTIONS[section]}\n\n" + block + "\n"
    tmp = readme.with_name(f".{readme.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(readme)


def context_cells(row: dict[str, Any]) -> list[str]:
    """A perplexity-against-context row's cells: length, tokens, teacher, student, S/T, then the state-off
    control where measured (its perplexity, its ratio to the teacher, how much worse than the student)."""

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    cells = [str(row["context"]), str(row["tokens"]), cell(row["teacher"], ".2f"), cell(row["student"], ".2f"), cell(row["ratio"], ".3f")]
    if "state_off" in row:
        carries = row["state_off"] / row["student"] - 1
        cells += [cell(row["state_off"], ".2f"), cell(row["state_off_ratio"], ".3f"), f"{100 * carries:+.1f}%"]
    return cells


CONTEXT_COLUMNS = ["context", "tokens", "teacher ppl", "student ppl", "student / teacher"]
STATE_OFF_COLUMNS = ["state off ppl", "state off / teacher", "state carries"]


def context_markdown(rows: list[dict[str, Any]], note: str = "") -> str:
    """The perplexity-against-context table as Markdown (with the state-off control's columns where measured)."""
    columns = CONTEXT_COLUMNS + (STATE_OFF_COLUMNS if any("state_off" in r for r in rows) else [])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join(context_cells(r)) + " |" for r in rows]
    return "\n".join(lines + ([f"\n{note}"] if note else [])) + "\n"


def heldout_contexts_markdown(rows: list[dict[str, Any]]) -> str:
    """The conversion's perplexity-against-context table (rows of `measure.compare_contexts`)."""
    note = (
        "The last tenth of CPython's pydoc topics, which no stage trains on, in non-overlapping windows of each "
        f"length, every length scoring the same {rows[0]['tokens']:,} tokens. `linearize ppl` measures more texts."
    )
    return context_markdown(rows, note)


def conversion_markdown(report: dict[str, Any]) -> str:
    """The conversion's measurements for the card: held-out perplexity before and after, the stages, memory."""
    ppl = report.get("perplexity") or {}
    parts = []
    if ppl:
        teacher = ppl.get("teacher")
        rows = [("teacher", "teacher"), ("zero_shot", "student before training"), ("student", "student")]
        table = ["| model | perplexity | × teacher |", "|---|---:|---:|"]
        for key, label in rows:
            if key in ppl:
                ratio = f"{ppl[key] / teacher:.3f}" if teacher else "-"
                table.append(f"| {label} | {ppl[key]:.3f} | {ratio} |")
        parts.append(
            f"Held-out perplexity: {report.get('heldout_tokens', 0):,} tokens of the last tenth of CPython's pydoc "
            f"topics, which no stage trains on, in {report.get('heldout_seq_len', 0):,}-token windows.\n\n" + "\n".join(table)
        )
    stages = report.get("stages") or {}
    if stages:
        table = ["| stage | tokens | time | final loss |", "|---|---:|---:|---:|"]
        for name, stage in stages.items():
            loss = "-" if stage.get("final_loss") is None else f"{stage['final_loss']:.4g}"
            table.append(f"| {name} | {stage['tokens']:,} | {stage['seconds']:.0f} s | {loss} |")
        parts.append("\n".join(table))
    facts = []
    kept = [i for i, kind in enumerate(report.get("layer_types") or []) if kind not in (LINEAR, SLIDING)]
    rankings = (("retrieval_scores", "the teacher's retrieval score", ".2f"), ("kl_gains", "the drop in KL to the teacher when restored", ".3g"))
    for key, label, fmt in rankings:
        scores = {int(i): v for i, v in (report.get(key) or {}).items()}
        if scores and kept:
            ranked = sorted(kept, key=lambda i: -scores[i])
            facts.append(f"Softmax layers kept ({label}): " + ", ".join(f"{i} ({scores[i]:{fmt}})" for i in ranked) + ".")
    memory = report.get("memory") or {}
    if memory:
        facts.append(
            f"Peak memory ({memory['kind']}): {memory['peak_bytes'] / 2**30:.2f} GiB, "
            f"{memory['peak_over_weights']:.2f}x the weights' {memory['weight_bytes'] / 2**30:.2f} GiB."
        )
    if report.get("seconds"):
        facts.append(f"Total time: {report['seconds']:.0f} s.")
    if facts:
        parts.append(" ".join(facts))
    return "\n\n".join(parts) + "\n"
