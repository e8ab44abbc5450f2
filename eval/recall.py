"""Long-context recall (RULER-style): synthetic needle tasks at set token lengths and depths, as lm-eval tasks.

Short multiple-choice benchmarks fit inside a converted layer's softmax window plus sinks, where it
computes exact softmax; these prompts are thousands of tokens long, so the answer has to come
through the linear state (or the remaining softmax layers).

The documents come from `convert/needles.py` (passkey, niah_single, niah_multikey,
variable_tracking), on the held-out slice. They are plain completion prompts with no chat template,
scored by exact match of the first number in the greedy generation. Copying the only number in sight
does not solve variable_tracking: the model has to follow the chain to pick between two.

Length and depth: a cell's `length` is the context it occupies, prompt plus the `MAX_GEN_TOKS`
generated tokens (as RULER counts it, and so lm-eval, which keeps `max_length - max_gen_toks`
prompt tokens, never truncates a prompt of a model whose context is `length`).

Chance is about 0 for a uniform guess of the digits (`CHANCE`); a model that copies a random
number from the prompt would score 1/4 on `niah_multikey` and 1/2 on `variable_tracking`.

Shell use: `lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --tasks
linearize_recall --include_path "$(python -m linearize.eval.recall --tokenizer DIR)"`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import random
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from ..convert.card import update_section
from ..convert.needles import PASSKEY_FILLER, TASKS, count_tokens, heldout_prose, make_prompt
from .models import dtype_name, remote_code_ok
from .tasks import default_dest as _tasks_dest

if TYPE_CHECKING:
    from lm_eval.api.model import LM
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

TAG = "linearize_recall"
# Probability that a uniform random guess of the answer's digits is right.
CHANCE = {
    "passkey": 1 / 90_000,
    "niah_single": 1 / 9_000_000,
    "niah_multikey": 1 / 9_000_000,
    "variable_tracking": 1 / 90_000,
}
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_GEN_TOKS = 12
# Bump when the generated prompts or task files change, so stale caches are rebuilt.
FORMAT_VERSION = 1


def _check_depth(depth: float) -> float:
    if not (isinstance(depth, (int, float)) and 0.0 <= depth <= 1.0):
        raise ValueError(f"bad depth {depth!r}: give fractions of the haystack from 0 to 1 (CLI: percent 0..100)")
    return float(depth)


def depth_key(depth: float) -> str:
    """Depth as a percent label ("0", "25", "12.5"): the grid's keys."""
    return f"{depth * 100:g}"


def resolve_recall_tasks(tasks: Iterable[str] | None) -> list[str]:
    """Validated task names (all of them for None); an unknown one is an error naming the valid ones."""
    if tasks is None:
        return list(TASKS)
    out = []
    for name in tasks:
        if name not in TASKS:
            raise ValueError(f"unknown recall task {name!r}: choose from {', '.join(TASKS)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"no recall task given: choose from {', '.join(TASKS)}")
    return out


def _check_settings(lengths: Iterable[int], depths: Iterable[float], samples: int) -> tuple[list[int], list[float]]:
    lengths = sorted(set(lengths))
    if not lengths or any(not isinstance(n, int) or n <= MAX_GEN_TOKS for n in lengths):
        raise ValueError(f"bad lengths {lengths}: give token counts above {MAX_GEN_TOKS}, e.g. 1024,4096")
    depths = sorted({_check_depth(d) for d in depths})
    if not depths:
        raise ValueError("no depths given: e.g. 0,50,100 (percent)")
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"bad samples {samples!r}: give 1 or more documents per cell")
    return lengths, depths


def generate_docs(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 1,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The documents of one (task, length): `samples` per depth, deterministic in `seed`.

    Each document: input (the prompt), answer, task, length, depth, sample, prompt_tokens.
    """
    (task,) = resolve_recall_tasks([task])
    docs = []
    for depth in map(_check_depth, depths):
        for sample in range(samples):
            rng = random.Random(f"linearize-recall:{seed}:{task}:{length}:{depth!r}:{sample}")
            text, answer = make_prompt(task, tokenizer, length - MAX_GEN_TOKS, depth, rng)
            docs.append(
                {
                    "input": text,
                    "answer": answer,
                    "task": task,
                    "length": length,
                    "depth": depth,
                    "sample": sample,
                    "prompt_tokens": count_tokens(tokenizer, text),
                }
            )
    return docs


def task_name(task: str, length: int) -> str:
    return f"recall_{task}_{length}"


def task_yaml(task: str, length: int, data_file: Path) -> dict[str, Any]:
    """lm-eval config of one (task, length): greedy until newline, exact match on the first number generated."""
    return {
        "task": task_name(task, length),
        "tag": [TAG, f"{TAG}_{task}"],
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{input}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "do_sample": False, "temperature": 0.0, "max_gen_toks": MAX_GEN_TOKS},
        "filter_list": [
            {
                "name": "first_number",
                "filter": [{"function": "regex", "regex_pattern": r"(\d+)"}, {"function": "take_first"}],
            }
        ],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "num_fewshot": 0,
        "metadata": {"version": FORMAT_VERSION},
    }


def default_dest() -> Path:
    """User cache root for recall tasks, beside the offline benchmark tasks."""
    return _tasks_dest().parent / "recall"


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Identifies what the prompts were measured with: vocabulary and special-token behaviour."""
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((type(tokenizer).__name__, tokenizer(PASSKEY_FILLER)["input_ids"])).encode())
    return h.hexdigest()


def build_recall_tasks(
    tokenizer: PreTrainedTokenizerBase,
    dest: Path | None = None,
    lengths: Iterable[int] = DEFAULT_LENGTHS,
    depths: Iterable[float] = DEFAULT_DEPTHS,
    samples: int = 1,
    tasks: Iterable[str] | None = None,
    seed: int = 0,
) -> Path:
    """Write one JSONL + task YAML per (task, length) and return the folder, lm-eval's include path.

    The folder sits under `dest` (default: the user cache), named by a hash of the tokenizer and
    every setting, so the tag `linearize_recall` in it covers exactly these tasks. It is built
    beside its final name and renamed into place; an existing one is reused as is.
    """
    names = resolve_recall_tasks(tasks)
    lengths, depths = _check_settings(lengths, depths, samples)
    settings = {
        "format": FORMAT_VERSION,
        "lm_eval": importlib.metadata.version("lm_eval"),
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "prose": hashlib.sha256(heldout_prose().encode()).hexdigest(),
        "tasks": names,
        "lengths": lengths,
        "depths": depths,
        "samples": samples,
        "seed": seed,
    }
    # Named by content alone, so every student of one teacher shares the files (and the teacher's cached samples).
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(dest) if dest is not None else default_dest()
    folder = root / f"recall-{digest}"
    if (folder / "manifest.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    log.info("building recall tasks %s x lengths %s in %s", names, lengths, folder)
    for task in names:
        for length in lengths:
            docs = generate_docs(task, tokenizer, length, depths, samples, seed)
            name = task_name(task, length)
            with (tmp / f"{name}.jsonl").open("w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(d) + "\n" for d in docs)
            text = yaml.safe_dump(task_yaml(task, length, folder / f"{name}.jsonl"), sort_keys=False)
            (tmp / f"{name}.yaml").write_text(text)
    (tmp / "manifest.json").write_text(json.dumps({**settings, "task_names": _names(names, lengths)}, indent=2))
    try:
        tmp.rename(folder)
    except OSError:  # another process finished the same folder first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "manifest.json").is_file():
            raise
    return folder


def _names(tasks: Iterable[str], lengths: Iterable[int]) -> list[str]:
    return [task_name(t, n) for t in tasks for n in lengths]


def evaluate_tasks(
    model: str | PreTrainedModel | LM,
    include_path: Path,
    task_names: list[str],
    device: str = "cpu",
    batch_size: int = 1,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """lm-eval output (with logged samples) of recall tasks for a model folder, a loaded model, or an lm-eval LM.

    A folder loads in `dtype` and runs its remote code only for a linearize export or with
    `trust_remote_code` (`models.remote_code_ok`); a loaded model keeps its own device and dtype.
    """
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    model_args: str | dict[str, Any] | None = None
    if isinstance(model, (str, Path)):
        if "," in str(model) or "=" in str(model):
            raise ValueError(
                f"model path {str(model)!r} has ',' or '=', which lm-eval's model_args cannot carry: rename it"
            )
        trust = remote_code_ok(model, trust_remote_code)
        model_args = f"pretrained={model},trust_remote_code={trust},dtype={dtype_name(dtype)}"
        model = "hf"
    elif not isinstance(model, LM):
        if tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: pass tokenizer=")
        model_args = {"pretrained": model, "tokenizer": tokenizer, "trust_remote_code": trust_remote_code}
        model = "hf"
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=task_names,
        batch_size=batch_size,
        device=device,
        task_manager=TaskManager(include_path=str(include_path), include_defaults=False),
        log_samples=True,
    )


def recall_grid(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """accuracy[task][length][depth] (string keys, depth in percent) from lm-eval's logged samples."""
    hits: dict[str, dict[str, dict[str, list[float]]]] = {}
    for rows in samples.values():
        for row in rows:
            doc = row["doc"]
            cell = hits.setdefault(doc["task"], {}).setdefault(str(doc["length"]), {})
            cell.setdefault(depth_key(doc["depth"]), []).append(float(row["exact_match"]))
    return {
        task: {length: {d: sum(v) / len(v) for d, v in cells.items()} for length, cells in by_len.items()}
        for task, by_len in hits.items()
    }


def responses(samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What the model generated for each document, beside the answer: to see how a cell failed."""
    return [
        {
            **{k: row["doc"][k] for k in ("task", "length", "depth", "sample", "answer")},
            "generation": row["resps"][0][0],
            "correct": bool(row["exact_match"]),
        }
        for rows in samples.values()
        for row in rows
    ]


def _context_limit(config: dict[str, Any]) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def _resolve_teacher(
    spec: str, device: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> tuple[str | PreTrainedModel, PreTrainedTokenizerBase | None, str, dict[str, Any]]:
    """(what to give lm-eval, its tokenizer if loaded, location, config), as `quality._eval_teacher` resolves."""
    from .models import is_model_dir, load, student_config

    if is_model_dir(spec):
        return spec, None, spec, student_config(spec)
    model, tokenizer, location = load(spec, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    if is_model_dir(location):
        del model
        return location, None, location, student_config(location)
    return model, tokenizer, location, model.config.to_dict()


def teacher_outputs(
    teacher_model: str | PreTrainedModel,
    location: str,
    include: Path,
    task_names: list[str],
    device: str,
    batch_size: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """The teacher's logged samples on these task files, computed once and kept beside them.

    The teacher and the documents do not change between conversions, and at 8K tokens it is the
    slow half of a run on CPU; a cached result is reused when the same teacher meets the same files
    in the same dtype (bf16 and fp32 can generate differently).
    """
    settings = [str(location), sorted(task_names), dtype_name(dtype)]
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    cached = Path(include) / f"teacher-{key}.json"
    if cached.is_file():
        log.info("reusing the teacher's recall samples from %s", cached)
        return json.loads(cached.read_text())
    out = evaluate_tasks(
        teacher_model, include, task_names, device, batch_size, tokenizer, dtype, trust_remote_code
    )
    kept = {"samples": out["samples"], "lm_eval_version": out.get("lm_eval_version")}
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
    tmp.write_text(json.dumps(kept, default=str))
    tmp.replace(cached)
    return json.loads(cached.read_text())


def _ratio(student: float | None, teacher: float | None) -> float | None:
    return student / teacher if student is not None and teacher else None


def _mean(values: Iterable[float | None]) -> float | None:
    vals = list(values)
    return sum(vals) / len(vals) if vals and None not in vals else None  # type: ignore[arg-type]


def summarize(grid: dict[str, Any], tasks: list[str], lengths: list[int], depths: list[float]) -> dict[str, Any]:
    """Per-cell student/teacher ratios and, per length, each model's mean over tasks and depths and their ratio."""
    student, teacher = grid["student"], grid.get("teacher")

    def cell(g: dict[str, Any] | None, task: str, length: int, depth: float) -> float | None:
        return None if g is None else g.get(task, {}).get(str(length), {}).get(depth_key(depth))

    ratio = {
        t: {
            str(n): {depth_key(d): _ratio(cell(student, t, n, d), cell(teacher, t, n, d)) for d in depths}
            for n in lengths
        }
        for t in tasks
    }
    per_length = {}
    for n in lengths:
        s = _mean(cell(student, t, n, d) for t in tasks for d in depths)
        tm = _mean(cell(teacher, t, n, d) for t in tasks for d in depths) if teacher else None
        per_length[str(n)] = {"student": s, "teacher": tm, "ratio": _ratio(s, tm)}
    return {"ratio": ratio, "per_length": per_length}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[tuple[list[str], bool]]]:
    """Headers and (cells, is_summary) rows shared by the markdown and rich tables."""
    s = report["settings"]
    tasks, lengths, depths = s["tasks"], s["lengths"], s["depths"]
    grid, per_length = report["grid"], report["summary"]["per_length"]
    student, teacher = grid["student"], grid.get("teacher") or {}
    headers = ["task", "length", *(f"{depth_key(d)}% T / S" for d in depths), "mean T / S", "S/T"]
    rows = []
    for n in lengths:
        for t in tasks:
            s_cells = [student.get(t, {}).get(str(n), {}).get(depth_key(d)) for d in depths]
            t_cells = [teacher.get(t, {}).get(str(n), {}).get(depth_key(d)) for d in depths]
            means = (_mean(t_cells) if teacher else None, _mean(s_cells))
            cells = [f"{_fmt(a)} / {_fmt(b)}" for a, b in zip([*t_cells, means[0]], [*s_cells, means[1]])]
            rows.append(([t, str(n), *cells, _fmt(_ratio(means[1], means[0]))], False))
        summary = per_length[str(n)]
        mean = f"{_fmt(summary['teacher'])} / {_fmt(summary['student'])}"
        rows.append((["all tasks", str(n), *[""] * len(depths), mean, _fmt(summary["ratio"])], True))
    return headers, rows


def markdown_table(report: dict[str, Any], note: str = "") -> str:
    """One table: rows task x length, per depth teacher / student accuracy, a summary row per length."""
    headers, rows = table_rows(report)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    for cells, bold in rows:
        lines.append("| " + " | ".join(f"**{c}**" if bold and c else c for c in cells) + " |")
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def render_table(report: dict[str, Any], title: str = "long-context recall (T: teacher, S: student)") -> Any:
    """The markdown table's content as a rich Table."""
    from rich.table import Table

    headers, rows = table_rows(report)
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="left" if h == "task" else "right")
    for cells, bold in rows:
        table.add_row(*cells, style="bold" if bold else None, end_section=bold)
    return table


def plot(report: dict[str, Any], path: Path) -> Path:
    """Heatmaps: one row of panels per model (teacher, student), one panel per task; x depth, y length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["settings"]
    tasks, lengths, depths = s["tasks"], s["lengths"], s["depths"]
    models = [m for m in ("teacher", "student") if report["grid"].get(m)]
    size = (1.5 + max(2.8, 0.9 * len(depths)) * len(tasks), 0.8 + max(1.8, 0.5 * len(lengths)) * len(models))
    fig, axes = plt.subplots(len(models), len(tasks), figsize=size, squeeze=False, layout="constrained")
    image = None
    for row, model in enumerate(models):
        for col, task in enumerate(tasks):
            ax = axes[row][col]
            values = [
                [report["grid"][model].get(task, {}).get(str(n), {}).get(depth_key(d), math.nan) for d in depths]
                for n in lengths
            ]
            image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
            for i, line in enumerate(values):
                for j, v in enumerate(line):
                    ax.text(j, i, "-" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(depths)), [f"{depth_key(d)}%" for d in depths], fontsize=8)
            ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
            ax.set_title(f"{model}: {task}", fontsize=9)
            if row == len(models) - 1:
                ax.set_xlabel("needle depth")
            if col == 0:
                ax.set_ylabel("context")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_recall(
    student_dir: str | Path,
    teacher: str | None = None,
    lengths: Iterable[int] = DEFAULT_LENGTHS,
    depths: Iterable[float] = DEFAULT_DEPTHS,
    samples: int = 1,
    tasks: Iterable[str] | None = None,
    device: str = "auto",
    batch_size: int = 1,
    skip_teacher: bool = False,
    seed: int = 0,
    dest: Path | None = None,
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Recall grid of a converted folder and its teacher; writes recall.json, recall.md, recall.png and the card table.

    Both models see the same documents, measured with the student's tokenizer (a conversion keeps
    the teacher's). Lengths beyond either model's context (max_position_embeddings) are dropped.
    `device` / `dtype` take "auto" (`models.resolve_device_dtype`); a model that is not a linearize
    export runs no remote code unless `trust_remote_code`.
    Returns the report written to recall.json (settings, grid, summary, each generation, paths).
    """
    from transformers import AutoTokenizer

    from .models import resolve_device_dtype, student_config, teacher_spec

    student_dir = Path(student_dir)
    config = student_config(student_dir)
    names = resolve_recall_tasks(tasks)
    lengths, depths = _check_settings(lengths, depths, samples)
    device, torch_dtype = resolve_device_dtype(device, dtype)
    tspec = None if skip_teacher else teacher_spec(student_dir, teacher)
    tokenizer = AutoTokenizer.from_pretrained(
        student_dir, trust_remote_code=remote_code_ok(student_dir, trust_remote_code)
    )
    limits = {"student": _context_limit(config)}
    teacher_model: str | PreTrainedModel | None = None
    teacher_tokenizer, teacher_location = None, None
    if tspec:
        teacher_model, teacher_tokenizer, teacher_location, tconfig = _resolve_teacher(
            tspec, device, torch_dtype, trust_remote_code
        )
        limits["teacher"] = _context_limit(tconfig)
    kept = list(lengths)
    for role, limit in limits.items():
        if limit is not None and any(n > limit for n in kept):
            dropped = [n for n in kept if n > limit]
            log.info("dropping lengths %s: above the %s's context of %d tokens", dropped, role, limit)
            kept = [n for n in kept if n <= limit]
    if not kept:
        raise ValueError(f"no length fits the models' context ({limits}): pass smaller --lengths")
    include = build_recall_tasks(tokenizer, dest, kept, depths, samples, names, seed)
    task_names = _names(names, kept)
    outputs: dict[str, dict[str, Any]] = {}
    if teacher_model is not None:
        outputs["teacher"] = teacher_outputs(
            teacher_model,
            teacher_location,
            include,
            task_names,
            device,
            batch_size,
            teacher_tokenizer,
            torch_dtype,
            trust_remote_code,
        )
        del teacher_model
    outputs["student"] = evaluate_tasks(
        str(student_dir), include, task_names, device, batch_size, None, torch_dtype, trust_remote_code
    )
    grid = {role: recall_grid(out["samples"]) for role, out in outputs.items()}
    generations = {role: responses(out["samples"]) for role, out in outputs.items()}
    report: dict[str, Any] = {
        "student": str(student_dir),
        "teacher": tspec,
        "teacher_location": teacher_location,
        "settings": {
            "tasks": names,
            "lengths": kept,
            "dropped_lengths": [n for n in lengths if n not in kept],
            "depths": depths,
            "samples": samples,
            "seed": seed,
            "device": device,
            "dtype": dtype_name(torch_dtype),
            "max_gen_toks": MAX_GEN_TOKS,
            "include_path": str(include),
            "lm_eval": outputs["student"].get("lm_eval_version"),
        },
        "chance": {t: CHANCE[t] for t in names},
        "grid": grid,
        "responses": generations,
    }
    report["summary"] = summarize(grid, names, kept, depths)
    note = (
        f"Long-context recall (`linearize recall`), lm-eval {report['settings']['lm_eval']}: greedy, exact match "
        f"of the first number generated; {samples} document(s) per cell; depth = needle position in the haystack. "
        f"T: teacher `{tspec or 'not evaluated'}`, S: student; S/T: ratio of the means."
    )
    md = markdown_table(report, note)
    paths = {name: str(student_dir / f"recall.{name}") for name in ("json", "md", "png")}
    paths["readme"] = str(student_dir / "README.md")
    report["paths"] = paths
    plot(report, Path(paths["png"]))
    Path(paths["md"]).write_text("# Long-context recall\n\n" + md)
    tmp = student_dir / f".recall.json.{os.getpid()}"
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(paths["json"])
    update_section(student_dir, "recall", md)
    return report


def parse_depths(text: str) -> list[float]:
    """'0,25,100' (percent) -> [0.0, 0.25, 1.0]; anything else is a one-line error."""
    try:
        values = [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        values = []
    if not values or any(not 0.0 <= v <= 100.0 for v in values):
        raise ValueError(f"bad --depths {text!r}: give percentages from 0 to 100 separated by commas, e.g. 0,50,100")
    return [v / 100 for v in values]


def parse_tasks(text: str) -> list[str]:
    """'passkey,niah_single' -> validated task names."""
    return resolve_recall_tasks([t for t in text.replace(" ", "").split(",") if t])


def main(argv: list[str] | None = None) -> int:
    """`python -m linearize.eval.recall --tokenizer DIR [--lengths ...]`: build the tasks, print the include path."""
    from transformers import AutoTokenizer

    from .bench import parse_int_list

    parser = argparse.ArgumentParser(
        prog="python -m linearize.eval.recall",
        description=f"Build the long-context recall tasks (tag {TAG}) for a tokenizer and print the --include_path.",
    )
    parser.add_argument("--tokenizer", required=True, help="model or tokenizer folder (or hub id) to measure with")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="context lengths in tokens")
    parser.add_argument("--depths", default="0,25,50,75,100", help="needle depths, percent of the haystack")
    parser.add_argument("--samples", type=int, default=1, help="documents per (task, length, depth)")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"from {', '.join(TASKS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dest", type=Path, default=None, help=f"cache root (default {default_dest()})")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run the tokenizer's own code (linearize exports need none)"
    )
    args = parser.parse_args(argv)
    try:
        lengths = parse_int_list(args.lengths, "lengths")
        depths, tasks = parse_depths(args.depths), parse_tasks(args.tasks)
        tokenizer = AutoTokenizer.from_pretrained(
            args.tokenizer, trust_remote_code=remote_code_ok(args.tokenizer, args.trust_remote_code)
        )
        path = build_recall_tasks(tokenizer, args.dest, lengths, depths, args.samples, tasks, args.seed)
    except (ValueError, OSError) as err:
        parser.exit(2, f"error: {' '.join(str(err).split())}\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
