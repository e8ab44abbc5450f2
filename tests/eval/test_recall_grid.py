"""`recall_grid` averages every (task, length, depth) cell over its samples, right and wrong answers
mixed: checked against grids computed by hand, from rows written here and from lm-eval's own logging."""

from __future__ import annotations

import json

import pytest
from lm_eval.api.model import LM

from linearize.eval import recall as R


def row(task: str, length: int, depth: float, sample: int, right: bool) -> dict:
    """One logged sample as lm-eval writes it (the fields the grid reads)."""
    doc = {"task": task, "length": length, "depth": depth, "sample": sample, "answer": "7"}
    return {"doc": doc, "exact_match": 1.0 if right else 0.0, "resps": [["7" if right else "8"]]}


def test_each_cell_is_the_mean_of_its_samples():
    # passkey at 512: depth 0 has 3 right of 4, depth 0.25 1 of 3, depth 1 0 of 2; at 1024: depth 0 2 of 2.
    # niah_single at 512: depth 0 1 of 4. Rows of one cell are spread over the list and over task keys.
    samples = {
        "recall_passkey_512": [
            row("passkey", 512, 0.0, 0, True),
            row("passkey", 512, 0.25, 0, False),
            row("passkey", 512, 0.0, 1, False),
            row("passkey", 512, 1.0, 0, False),
            row("passkey", 512, 0.25, 1, True),
            row("passkey", 512, 0.0, 2, True),
            row("passkey", 512, 1.0, 1, False),
            row("passkey", 512, 0.25, 2, False),
        ],
        "recall_passkey_1024": [row("passkey", 1024, 0.0, 0, True), row("passkey", 1024, 0.0, 1, True)],
        "recall_niah_single_512": [
            row("niah_single", 512, 0.0, 0, False),
            row("niah_single", 512, 0.0, 1, False),
            row("niah_single", 512, 0.0, 2, True),
            row("niah_single", 512, 0.0, 3, False),
        ],
        "recall_passkey_512_rerun": [row("passkey", 512, 0.0, 3, True)],
    }
    grid = R.recall_grid(samples)
    assert grid == {
        "passkey": {"512": {"0": 0.75, "25": pytest.approx(1 / 3), "100": 0.0}, "1024": {"0": 1.0}},
        "niah_single": {"512": {"0": 0.25}},
    }
    summary = R.summarize({"student": grid}, ["passkey"], [512], [0.0, 0.25, 1.0])
    # a length's mean weighs each depth's cell alike (not 4 of 9 pooled samples)
    assert summary["per_length"]["512"]["student"] == pytest.approx((0.75 + 1 / 3 + 0.0) / 3)
    # a missing cell leaves the mean undefined rather than biased
    assert R.summarize({"student": grid}, ["passkey", "niah_single"], [512], [0.0, 0.25])["per_length"]["512"]["student"] is None


# Which documents the model below gets wrong, by (task, depth): the samples answered wrongly.
WRONG = {
    ("passkey", 0.0): {0},
    ("passkey", 0.5): set(),
    ("passkey", 1.0): {0, 1, 2},
    ("niah_single", 0.0): {1, 2},
    ("niah_single", 0.5): {2},
    ("niah_single", 1.0): set(),
}


class PlannedLM(LM):
    """Answers each prompt with its document's answer, or one more than it for the documents in WRONG."""

    def __init__(self, docs: dict[str, dict]) -> None:
        super().__init__()
        self.docs = docs

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            doc = self.docs[request.args[0]]
            wrong = doc["sample"] in WRONG[(doc["task"], doc["depth"])]
            out.append(f" {int(doc['answer']) + wrong}.\n")
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def test_grid_from_lm_eval_with_mixed_answers(tiny_tokenizer, tmp_path):
    include = R.build_recall_tasks(tiny_tokenizer, tmp_path, [512], (0.0, 0.5, 1.0), 3, ["passkey", "niah_single"])
    names = [R.task_name(t, 512) for t in ("passkey", "niah_single")]
    docs = {}
    for name in names:
        for line in (include / f"{name}.jsonl").read_text().splitlines():
            doc = json.loads(line)
            docs[doc["input"]] = doc
    assert len(docs) == 18  # 2 tasks x 3 depths x 3 samples, all prompts distinct
    out = R.evaluate_tasks(PlannedLM(docs), include, names)
    grid = R.recall_grid(out["samples"])
    assert grid == {
        "passkey": {"512": {"0": pytest.approx(2 / 3), "50": 1.0, "100": 0.0}},
        "niah_single": {"512": {"0": pytest.approx(1 / 3), "50": pytest.approx(2 / 3), "100": 1.0}},
    }
    # lm-eval's own mean over each task's documents agrees (every cell holds 3 of them)
    assert out["results"]["recall_passkey_512"]["exact_match,first_number"] == pytest.approx(5 / 9)
    assert out["results"]["recall_niah_single_512"]["exact_match,first_number"] == pytest.approx(2 / 3)
    wrong = [(r["task"], r["depth"], r["sample"]) for r in R.responses(out["samples"]) if not r["correct"]]
    assert sorted(wrong) == sorted((t, d, s) for (t, d), samples in WRONG.items() for s in samples)
