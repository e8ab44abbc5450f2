"""Long-context recall suite: the generator (determinism, lengths, depths), the lm-eval task files and
their scoring (through an oracle that reads the needles), the runner on a tiny random llama, the CLI."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from lm_eval.api.model import LM

from linearize.convert.card import markers
from linearize.convert import needles
from linearize.eval import recall as R

LENGTH = 1024  # tiny tokenizer: about 2.5 KB of text, enough room for every task's needles
NEEDLE = re.compile(
    r" ?(?:The pass key is \d+\. Remember it\. \d+ is the pass key\."
    r"|One of the special magic numbers for \S+ is: \d+\."
    r"|VAR [A-Z]+ = (?:VAR [A-Z]+|\d+)\.) ?"
)


def oracle(prompt: str) -> str:
    """Answer a recall prompt by reading it: find the asked key's needle, or follow the asked variable's chain."""
    if prompt.endswith("The pass key is"):
        return re.search(r"The pass key is (\d+)\.", prompt).group(1)
    asked = re.search(r"which number does VAR ([A-Z]+) hold", prompt)
    if asked:
        assignments = dict(re.findall(r"VAR ([A-Z]+) = (?:VAR )?([A-Z]+|\d+)\.", prompt))
        value = asked.group(1)
        while not value.isdigit():
            value = assignments[value]
        return value
    key = re.search(r"special magic number for (\S+) mentioned", prompt).group(1)
    return re.search(rf"magic numbers for {re.escape(key)} is: (\d+)\.", prompt).group(1)


class OracleLM(LM):
    """An lm-eval model that answers with `oracle` (or one more than it, with `wrong`)."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.wrong = wrong

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers = [oracle(r.args[0]) for r in requests]
        return [f" {int(a) + 1 if self.wrong else a}.\n" for a in answers]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def _needle_span(doc: dict) -> tuple[int, int]:
    """Where the needle the question asks about sits in the prompt."""
    prompt, answer = doc["input"], doc["answer"]
    pattern = {
        "passkey": rf"The pass key is {answer}\.",
        "variable_tracking": rf"VAR [A-Z]+ = {answer}\.",
    }.get(doc["task"], rf"One of the special magic numbers for \S+ is: {answer}\.")
    m = re.search(pattern, prompt)
    return m.start(), m.end()


def filler_depth(tokenizer, doc: dict) -> float:
    """Tokens of haystack filler before the asked needle over all filler tokens (needles left out)."""
    prompt = doc["input"]
    start, end = prompt.index("\n\n") + 2, prompt.rindex("\n\n")  # after the instruction, before the question
    at, _ = _needle_span(doc)
    before = R.count_tokens(tokenizer, NEEDLE.sub(" ", prompt[start:at]).strip(), special=False)
    total = R.count_tokens(tokenizer, NEEDLE.sub(" ", prompt[start:end]).strip(), special=False)
    return before / total


@pytest.fixture(scope="module")
def docs(tiny_tokenizer) -> dict[str, list[dict]]:
    return {task: R.generate_docs(task, tiny_tokenizer, LENGTH, R.DEFAULT_DEPTHS, 1) for task in R.TASKS}


def test_generator_is_deterministic(tiny_tokenizer, docs):
    for task in R.TASKS:
        again = R.generate_docs(task, tiny_tokenizer, LENGTH, R.DEFAULT_DEPTHS, 1)
        assert again == docs[task]
    a = R.generate_docs("niah_single", tiny_tokenizer, 512, (0.5,), 2, seed=0)
    b = R.generate_docs("niah_single", tiny_tokenizer, 512, (0.5,), 2, seed=1)
    assert a[0]["answer"] != a[1]["answer"] and a[0]["input"] != a[1]["input"]  # samples differ
    assert [d["answer"] for d in a] != [d["answer"] for d in b] and a[0]["input"] != b[0]["input"]


@pytest.mark.parametrize("task", R.TASKS)
def test_prompt_length_and_needle_depth(tiny_tokenizer, docs, task):
    target = LENGTH - R.MAX_GEN_TOKS
    for doc in docs[task]:
        n = R.count_tokens(tiny_tokenizer, doc["input"])
        assert n == doc["prompt_tokens"] and target - needles.TOLERANCE <= n <= target
        assert doc["input"].endswith(("is", "number")) and doc["answer"].isdigit()
        assert oracle(doc["input"]) == doc["answer"]
        assert filler_depth(tiny_tokenizer, doc) == pytest.approx(doc["depth"], abs=0.05)


def test_chains_need_tracking(docs):
    """Variable tracking: two chains with different numbers, the asked one starting at the depth."""
    for doc in docs["variable_tracking"]:
        values = re.findall(r"VAR [A-Z]+ = (\d+)\.", doc["input"])
        refs = re.findall(r"VAR [A-Z]+ = VAR [A-Z]+\.", doc["input"])
        assert len(values) == 2 and doc["answer"] in values and len(refs) == 2 * (needles.CHAIN_VARIABLES - 1)


def test_input_errors(tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown recall task"):
        R.resolve_recall_tasks(["passkey", "needle"])
    with pytest.raises(ValueError, match="bad depth"):
        R.generate_docs("passkey", tiny_tokenizer, 512, (1.5,))
    with pytest.raises(ValueError, match="too few"):
        R.generate_docs("niah_multikey", tiny_tokenizer, 128, (0.5,))
    with pytest.raises(ValueError, match="bad lengths"):
        R.build_recall_tasks(tiny_tokenizer, tmp_path, lengths=[0])
    with pytest.raises(ValueError, match="bad --depths"):
        R.parse_depths("0,101")
    assert R.parse_depths("0, 50,100") == [0.0, 0.5, 1.0]


@pytest.fixture(scope="module")
def include(tiny_tokenizer, tmp_path_factory) -> Path:
    return R.build_recall_tasks(tiny_tokenizer, tmp_path_factory.mktemp("recall"), [512], (0.0, 0.5, 1.0), 1)


def test_task_files_build_and_load(include, tiny_tokenizer):
    from lm_eval.tasks import TaskManager

    names = [R.task_name(t, 512) for t in R.TASKS]
    assert sorted(p.stem for p in include.glob("*.yaml")) == sorted(names)
    cfg = yaml.safe_load((include / "recall_passkey_512.yaml").read_text())
    assert cfg["output_type"] == "generate_until" and cfg["doc_to_text"] == "{{input}}"
    assert cfg["generation_kwargs"]["max_gen_toks"] == R.MAX_GEN_TOKS and cfg["generation_kwargs"]["until"] == ["\n"]
    rows = [json.loads(line) for line in Path(cfg["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()]
    assert [r["depth"] for r in rows] == [0.0, 0.5, 1.0] and {r["length"] for r in rows} == {512}
    manager = TaskManager(include_path=str(include), include_defaults=False)
    assert set(names) <= set(manager.all_tasks) and R.TAG in manager.all_tasks
    loaded = manager.load([R.TAG])["tasks"]
    assert sorted(loaded) == sorted(names) and len(loaded["recall_passkey_512"].eval_docs) == 3
    again = R.build_recall_tasks(tiny_tokenizer, include.parent, [512], (0.0, 0.5, 1.0), 1)
    assert again == include  # cached: same settings, same folder
    assert R.build_recall_tasks(tiny_tokenizer, include.parent, [512], (0.0, 1.0), 1, ["passkey"]) != include


@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_scores_through_lm_eval(include, wrong):
    """The YAMLs' filter + metric: reading the needle scores 1.0 in every cell, an off-by-one answer 0.0."""
    names = [R.task_name(t, 512) for t in R.TASKS]
    out = R.evaluate_tasks(OracleLM(wrong=wrong), include, names)
    grid = R.recall_grid(out["samples"])
    assert set(grid) == set(R.TASKS)
    expected = 0.0 if wrong else 1.0
    for task in R.TASKS:
        assert grid[task] == {"512": {"0": expected, "50": expected, "100": expected}}
        assert out["results"][R.task_name(task, 512)]["exact_match,first_number"] == expected


def test_summary_and_tables():
    report = {
        "settings": {"tasks": ["passkey"], "lengths": [1024], "depths": [0.0, 1.0]},
        "grid": {
            "teacher": {"passkey": {"1024": {"0": 1.0, "100": 0.5}}},
            "student": {"passkey": {"1024": {"0": 0.5, "100": 0.5}}},
        },
    }
    report["summary"] = R.summarize(report["grid"], ["passkey"], [1024], [0.0, 1.0])
    assert report["summary"]["ratio"]["passkey"]["1024"] == {"0": 0.5, "100": 1.0}
    assert report["summary"]["per_length"]["1024"] == {"student": 0.5, "teacher": 0.75, "ratio": pytest.approx(2 / 3)}
    md = R.markdown_table(report)
    assert "| passkey | 1024 | 1.00 / 0.50 | 0.50 / 0.50 | 0.75 / 0.50 | 0.67 |" in md
    assert "| **all tasks** | **1024** |  |  | **0.75 / 0.50** | **0.67** |" in md
    R.render_table(report)


def test_run_recall_on_tiny_llama(tiny_llama_dir, tmp_path, one_torch_thread, monkeypatch):
    """End to end through lm-eval's `hf` model: grid shape, dropped lengths, report files, model card,
    and the teacher evaluated once: its samples are reused by the second run."""
    student = tmp_path / "student"
    shutil.copytree(tiny_llama_dir, student)
    (student / "README.md").write_text("# tiny\n\n<!-- linearize-eval -->\neval table\n<!-- /linearize-eval -->\n")
    evaluated = []
    real = R.evaluate_tasks
    monkeypatch.setattr(R, "evaluate_tasks", lambda model, *a, **k: evaluated.append(str(model)) or real(model, *a, **k))
    grids = []
    for _ in range(2):  # the second run replaces the card block instead of adding one
        grids.append(R.run_recall(
            student,
            teacher=str(tiny_llama_dir),
            lengths=(256, 1024),  # 1024 exceeds the tiny llama's 512 positions
            depths=(0.0, 1.0),
            tasks=["passkey"],
            dest=tmp_path / "tasks",
        ))
    report = grids[-1]
    assert evaluated == [str(tiny_llama_dir), str(student), str(student)]
    assert grids[0]["grid"] == grids[1]["grid"]
    assert report["settings"]["lengths"] == [256] and report["settings"]["dropped_lengths"] == [1024]
    for role in ("teacher", "student"):
        cells = report["grid"][role]["passkey"]["256"]
        assert set(cells) == {"0", "100"} and all(0.0 <= v <= 1.0 for v in cells.values())
    assert [(r["depth"], r["answer"].isdigit()) for r in report["responses"]["student"]] == [(0.0, True), (1.0, True)]
    saved = json.loads((student / "recall.json").read_text())
    assert saved["grid"] == report["grid"] and set(saved["summary"]["ratio"]["passkey"]["256"]) == {"0", "100"}
    assert (student / "recall.png").stat().st_size > 0
    assert "| passkey | 256 |" in (student / "recall.md").read_text()
    card = (student / "README.md").read_text()
    begin, end = markers("recall")
    assert card.count(begin) == 1 and card.count(end) == 1 and "eval table" in card


@pytest.mark.parametrize(
    "args, message",
    [
        (["--depths", "0,150"], "--depths"),
        (["--depths", "half"], "--depths"),
        (["--lengths", "1k"], "--lengths"),
        (["--tasks", "passkey,needle"], "unknown recall task"),
    ],
)
def test_cli_rejects_bad_input(linearize_main, tiny_llama_dir, args, message):
    code, out, err = linearize_main("recall", tiny_llama_dir, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out


def test_cli_rejects_missing_dir(linearize_main, tmp_path):
    code, _, err = linearize_main("recall", tmp_path / "missing", "--skip-teacher")
    assert code == 2 and "does not exist" in err


def test_module_main_prints_include_path(tiny_llama_dir, tmp_path, capsys):
    argv = ["--tokenizer", str(tiny_llama_dir), "--lengths", "512", "--depths", "50", "--tasks", "passkey"]
    assert R.main([*argv, "--dest", str(tmp_path)]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path and (path / "recall_passkey_512.yaml").is_file()
