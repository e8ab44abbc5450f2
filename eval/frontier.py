"""The ratio frontier: quality against decoding speed for conversions of one teacher at several ratios and
placements, measured the same way and put in one table and one plot.

    linearize frontier out/smollm2-gla-3to1 out/smollm2-gla-7to1 ... --output out/frontier

Each export is measured once, in three parts (`--parts`): each part is kept in OUTPUT/rows/<folder
name>.json with the settings it was measured under, so adding an export, or a part left for later, measures
only what is missing. A row holds:
- held-out perplexity against the teacher at each context (default 512, 2K, 8K) on each text, with the
  state-off control (every linear layer's state weighed 0: what the state carries);
- recall, the student's mean over the recall suite's tasks and depths against the teacher's, per length;
- the cache bytes of one sequence at the decode context (default 16K), and decode speed against the
  teacher there at batch 1, eager and compiled (`compile_decoding`), each in a run that times both models;
- conversion time and budgets from the export's report.json.
The table goes to frontier.md and frontier.json; frontier.png plots the perplexity ratio at the longest
context against compiled (else eager) decode speed, one point per export.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from ..options import ListOption, Parser

log = logging.getLogger(__name__)

MiB = 2**20


def describe_export(folder: Path) -> dict[str, Any]:
    """What a conversion was: its plan (ratio, placement, softmax layers), budgets and time, from report.json."""
    path = folder / "report.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no report.json: pass folders that `linearize` converted")
    report = json.loads(path.read_text())
    recipe = yaml.safe_load(report["recipe_yaml"])
    types = report["layer_types"]
    linear = types.count("linear_attention")
    softmax = len(types) - linear
    layers = recipe.get("layers", {})
    return {
        "name": folder.name,
        "folder": str(folder),
        "ratio": layers.get("ratio"),
        "placement": layers.get("placement") if not layers.get("linear_layers") else "explicit",
        "linear_layers": linear,
        "softmax_layers": [i for i, kind in enumerate(types) if kind != "linear_attention"],
        "plan": report["plan"],
        "attention": {k: report["attention"].get(k) for k in ("kind", "feature_map", "feature_dim", "window", "sink")},
        "transfer_tokens": recipe.get("transfer", {}).get("tokens"),
        "finetune_tokens": recipe.get("finetune", {}).get("tokens"),
        "seconds": report.get("seconds"),
        "summary": f"{linear}:{softmax}",
    }


PARTS = {  # what each part of a row measures, and the settings it depends on
    "perplexity": ("contexts", "texts", "context_tokens", "device"),
    "recall": ("recall_lengths", "recall_depths", "recall_samples", "device"),
    "decode": ("decode_context", "decode_tokens", "compiled", "device"),
}


def _part_settings(part: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {key: settings[key] for key in PARTS[part]}


def measure_part(part: str, folder: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """One part of an export's row against its recorded teacher (see the module docstring)."""
    from .bench import run_bench
    from .models import teacher_spec
    from .perplexity import context_report
    from .recall import run_recall
    from ..convert.data import eval_text

    teacher = teacher_spec(str(folder), None)
    if part == "perplexity":
        texts = {name: eval_text(name) for name in settings["texts"]}
        report = context_report(
            str(folder), teacher, texts, settings["contexts"], settings["context_tokens"], settings["device"],
            progress=True, controls=["state-off"],
        )  # fmt: skip
        return report["contexts"]
    if part == "recall":
        report = run_recall(
            str(folder), teacher, settings["recall_lengths"], settings["recall_depths"], settings["recall_samples"],
            device=settings["device"],
        )  # fmt: skip
        return report["summary"]["per_length"]
    decode = {}
    for mode in ("eager", "compiled") if settings["compiled"] else ("eager",):
        bench = run_bench(
            str(folder), teacher, [settings["decode_context"]], [1], settings["decode_tokens"], settings["device"],
            compile_student=mode == "compiled", scoring_lengths=[],
        )  # fmt: skip
        (row,) = bench["rows"]
        keys = ("status", "decode_speedup", "student_decode_tok_s", "teacher_decode_tok_s", "student_cache_bytes", "teacher_cache_bytes")
        decode[mode] = {key: row[key] for key in keys} | {"device": bench["device"]}
    return decode


def frontier_row(export: dict[str, Any], measured: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """One row of the table: the export's plan and its figures against the teacher (None where not measured)."""
    longest = max(settings["contexts"])
    contexts = measured.get("perplexity", {}).get("value", {})
    recall = measured.get("recall", {}).get("value", {})
    decode = measured.get("decode", {}).get("value", {})
    eager = decode.get("eager", {})
    return {
        **export,
        "ppl_ratio": {name: {str(r["context"]): r["ratio"] for r in rows} for name, rows in contexts.items()},
        "state_off_ratio": {
            name: next((r["state_off_ratio"] for r in rows if r["context"] == longest), None) for name, rows in contexts.items()
        },
        "recall_ratio": {length: cell["ratio"] for length, cell in recall.items()},
        "cache_bytes": eager.get("student_cache_bytes"),
        "teacher_cache_bytes": eager.get("teacher_cache_bytes"),
        "decode_eager": eager.get("decode_speedup"),
        "decode_compiled": decode.get("compiled", {}).get("decode_speedup"),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    """The frontier as Markdown: one row per export, the teacher's figures as 1.000 throughout."""
    texts, contexts, lengths = settings["texts"], settings["contexts"], settings["recall_lengths"]
    longest = max(contexts)
    k = {n: f"{n // 1024}K" if n >= 1024 else str(n) for n in [*contexts, *lengths, settings["decode_context"]]}
    headers = ["layers L:S", "placement", "softmax layers"]
    headers += [f"ppl S/T {text} {k[c]}" for text in texts for c in contexts]
    headers += [f"state off S/T {text} {k[longest]}" for text in texts]
    headers += [f"recall S/T {k[n]}" for n in lengths]
    ctx = k[settings["decode_context"]]
    headers += [f"cache MiB at {ctx}", f"decode x T {ctx} eager", f"decode x T {ctx} compiled", "transfer + finetune tokens", "conversion s"]
    lines = ["| " + " | ".join(headers) + " |", "|---|---|---|" + "---:|" * (len(headers) - 3)]
    for r in sorted(rows, key=lambda r: (r["linear_layers"], r["placement"])):
        cells = [r["summary"], r["placement"], ",".join(map(str, r["softmax_layers"])) or "none"]
        cells += [_fmt(r["ppl_ratio"].get(text, {}).get(str(c)), ".3f") for text in texts for c in contexts]
        cells += [_fmt(r["state_off_ratio"].get(text), ".3f") for text in texts]
        cells += [_fmt(r["recall_ratio"].get(str(n)), ".2f") for n in lengths]
        cells += [
            _fmt(None if r["cache_bytes"] is None else r["cache_bytes"] / MiB, ".1f"),
            _fmt(r["decode_eager"], ".2f"),
            _fmt(r["decode_compiled"], ".2f"),
            f"{r['transfer_tokens']:,} + {r['finetune_tokens']:,}",
            _fmt(r["seconds"], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    teacher_cache = next((r["teacher_cache_bytes"] for r in rows if r["teacher_cache_bytes"]), None)
    note = (
        f"S/T: student over teacher, same tokens or prompts in the same run. Perplexity: held-out texts in "
        f"non-overlapping windows, {settings['context_tokens']:,} tokens per text and length; state off: every "
        "linear layer's state weighed 0 (window and sinks only). Recall: the mean over the recall suite's tasks "
        f"and depths ({settings['recall_samples']} document(s) per cell, needles at "
        f"{', '.join(f'{100 * d:g}%' for d in settings['recall_depths'])} depth). "
        f"Decode: greedy tokens/s at batch 1 after a {settings['decode_context']:,}-token prompt, against the "
        f"teacher (eager) in the same run; the teacher's cache there is "
        f"{_fmt(None if teacher_cache is None else teacher_cache / MiB, '.1f')} MiB."
    )
    return "\n".join(lines) + "\n\n" + note + "\n"


def plot(rows: list[dict[str, Any]], settings: dict[str, Any], path: Path) -> Path:
    """Perplexity ratio at the longest context (mean over texts) against decode speed over the teacher."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = str(max(settings["contexts"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, placement in enumerate(sorted({r["placement"] for r in rows})):
        points = []
        for r in rows:
            speed = r["decode_compiled"] or r["decode_eager"]
            ratios = [r["ppl_ratio"].get(t, {}).get(longest) for t in settings["texts"]]
            if r["placement"] == placement and speed and all(ratios):
                points.append((len(r["softmax_layers"]), speed, sum(ratios) / len(ratios), r["summary"]))
        if not points:
            continue
        points = [p[1:] for p in sorted(points, reverse=True)]  # along the ratio: fewer softmax layers
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i}", label=placement)
        for x, y, label in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.plot([1.0], [1.0], marker="*", color="k", ms=12, ls="none", label="teacher")
    ax.set_xlabel(f"decode speed over the teacher at {settings['decode_context']:,} tokens, batch 1\n(compiled where measured, else eager)")
    ax.set_ylabel(f"perplexity over the teacher at {int(longest):,} tokens")
    ax.set_title("ratio frontier (linear:softmax layers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def frontier(folders: list[Path], output: Path, settings: dict[str, Any], parts: tuple[str, ...] = tuple(PARTS)) -> list[dict[str, Any]]:
    """Measure the `parts` not measured yet under these settings, then write frontier.json, .md and .png.

    Each export's parts are kept in OUTPUT/rows/<name>.json as they finish, so an interrupted run, a new export
    or a part left for later (e.g. decode timed on an idle machine) measures only what is missing.
    """
    (output / "rows").mkdir(parents=True, exist_ok=True)
    exports = [describe_export(folder) for folder in folders]  # every folder is checked before any work
    rows = []
    for export in exports:
        kept = output / "rows" / f"{export['name']}.json"
        measured = json.loads(kept.read_text()) if kept.is_file() else {}
        for part in parts:
            wanted = _part_settings(part, settings)
            if measured.get(part, {}).get("settings") != wanted:
                log.info("measuring %s of %s", part, export["folder"])
                measured[part] = {"settings": wanted, "value": measure_part(part, Path(export["folder"]), settings)}
                tmp = kept.with_name(f".{kept.name}.tmp")
                tmp.write_text(json.dumps(measured, indent=1))
                tmp.replace(kept)
        # a kept part measured under other settings than these is left out of the table, not mislabelled
        current = {part: kept_part for part, kept_part in measured.items() if kept_part.get("settings") == _part_settings(part, settings)}
        rows.append(frontier_row(export, current, settings))
    (output / "frontier.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    (output / "frontier.md").write_text(markdown(rows, settings))
    plot(rows, settings, output / "frontier.png")
    return rows


def frontier_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="linearize frontier",
        description="Quality against decoding speed for several conversions of one teacher (ratios, placements): "
        "perplexity with the state-off control, recall, cache and decode speed, in one table and plot.",
    )
    p.add_argument("dirs", nargs="+", help="converted model folders")
    p.add_argument("--output", required=True, help="folder for frontier.md, frontier.json, frontier.png and the kept rows")
    p.add_argument("--contexts", action=ListOption, default="512,2048,8192", help="perplexity contexts (default %(default)s)")
    p.add_argument("--texts", action=ListOption, default="pydoc,britannica", help="held-out texts (default %(default)s)")
    p.add_argument("--context-tokens", type=int, default=8192, help="tokens scored per text and length (default %(default)s)")
    p.add_argument("--recall-lengths", action=ListOption, default="1024,2048,4096,8192", help="(default %(default)s)")
    p.add_argument("--recall-depths", action=ListOption, default="0,50,100", help="percent (default %(default)s)")
    p.add_argument("--recall-samples", type=int, default=1, help="documents per task, length and depth (default 1)")
    p.add_argument("--decode-context", type=int, default=16384, help="prompt tokens before decoding (default %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy decode steps timed (default %(default)s)")
    p.add_argument("--eager-only", action="store_true", help="skip the compiled decode (each export compiles its step)")
    p.add_argument(
        "--parts",
        action=ListOption,
        default=",".join(PARTS),
        help="what to measure now, comma-separated; kept parts are reused (default %(default)s)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    return p


def frontier_main(argv: list[str] | None = None) -> int:
    """`linearize frontier DIR [DIR ...] --output OUT`: every argument is checked before anything is measured."""
    from .cli import _run

    def body(args: argparse.Namespace) -> int:
        from rich.console import Console

        from .bench import parse_int_list
        from .recall import parse_depths

        folders = [Path(d) for d in args.dirs]
        names = [f.name for f in folders]
        if len(set(names)) != len(names):
            raise ValueError(f"two folders share a name in {names}: each row is kept under its folder's name")
        settings = {
            "contexts": parse_int_list(args.contexts, "contexts"),
            "texts": [t for t in args.texts.split(",") if t],
            "context_tokens": args.context_tokens,
            "recall_lengths": parse_int_list(args.recall_lengths, "recall-lengths"),
            "recall_depths": parse_depths(args.recall_depths),
            "recall_samples": args.recall_samples,
            "decode_context": args.decode_context,
            "decode_tokens": args.decode_tokens,
            "compiled": not args.eager_only,
            "device": args.device,
        }
        if settings["context_tokens"] < max(settings["contexts"]):
            raise ValueError(f"--context-tokens {args.context_tokens} is below the longest context: give at least {max(settings['contexts'])}")
        parts = tuple(p for p in args.parts.split(",") if p)
        unknown = [p for p in parts if p not in PARTS]
        if unknown or not parts:
            raise ValueError(f"bad --parts {args.parts!r}: use some of {', '.join(PARTS)}")
        rows = frontier(folders, Path(args.output), settings, parts)
        Console().print((Path(args.output) / "frontier.md").read_text())
        log.info("%d rows; wrote %s", len(rows), Path(args.output) / "frontier.png")
        return 0

    return _run(frontier_parser(), argv, body)
