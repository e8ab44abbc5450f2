"""`linearize frontier`: an export's plan from its report, rows kept per export and settings, the table and plot."""

import json

import pytest
from transformers import AutoModelForCausalLM

from linearize.convert.pipeline import convert
from linearize.convert.recipes import load_recipe
from linearize.eval import frontier as fr

SETTINGS = {
    "contexts": [16, 64], "texts": ["pydoc", "britannica"], "context_tokens": 128, "recall_lengths": [1024, 2048],
    "recall_depths": [0.0, 0.5], "recall_samples": 1, "decode_context": 16384, "decode_tokens": 4, "compiled": True,
    "device": "cpu",
}  # fmt: skip


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_llama_dir, tiny_tokenizer):
    recipe = load_recipe("smollm2-gla")
    recipe.layers.placement, recipe.layers.ratio, recipe.layers.measured = "spread", "3:1", None
    recipe.attention.window, recipe.attention.sink = 16, 2
    recipe.transfer.tokens = recipe.finetune.tokens = 0
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    folder = tmp_path_factory.mktemp("frontier") / "tiny-3to1"
    convert(teacher, tiny_tokenizer, recipe=recipe, output=folder, measure=False)
    return folder


def fake_measurement(student: float, state_off: float) -> dict:
    rows = lambda: [  # noqa: E731
        {"context": 16, "tokens": 128, "teacher": 10.0, "student": 10.0, "ratio": 1.0, "state_off": 10.0, "state_off_ratio": 1.0},
        {"context": 64, "tokens": 128, "teacher": 8.0, "student": 8.0 * student, "ratio": student, "state_off": 8.0 * state_off, "state_off_ratio": state_off},
    ]  # fmt: skip
    decode = {"status": "ok", "student_cache_bytes": 3 * 2**20, "teacher_cache_bytes": 12 * 2**20}
    return {
        "perplexity": {"pydoc": rows(), "britannica": rows()},
        "recall": {"1024": 1.0, "2048": 0.75},
        "recall_means": {},
        "decode": {"eager": {**decode, "decode_speedup": 1.5}, "compiled": {**decode, "decode_speedup": 2.5}, "device": "cpu"},
    }


def test_describe_export_reads_the_plan_from_the_report(export):
    described = fr.describe_export(export)
    assert described["summary"] == "3:1" and described["placement"] == "spread" and described["linear_layers"] == 3
    assert described["softmax_layers"] == [3] and described["plan"] == "LLLS"
    assert described["transfer_tokens"] == 0 and described["attention"]["window"] == 16
    with pytest.raises(FileNotFoundError, match="has no report.json: pass folders that `linearize` converted"):
        fr.describe_export(export.parent)


def test_frontier_keeps_rows_and_writes_the_table_and_plot(export, tmp_path, monkeypatch):
    calls = []

    def measure(folder, settings):
        calls.append(settings)
        return fake_measurement(1.031, 1.062)

    monkeypatch.setattr(fr, "measure_export", measure)
    rows = fr.frontier([export], tmp_path, SETTINGS)
    assert len(calls) == 1 and len(rows) == 1
    (row,) = rows
    assert row["ppl_ratio"]["pydoc"]["64"] == pytest.approx(1.031) and row["state_off_ratio"]["britannica"] == pytest.approx(1.062)
    md = (tmp_path / "frontier.md").read_text()
    assert "| ratio (L:S) | placement | softmax layers | ppl S/T pydoc 16 | ppl S/T pydoc 64 |" in md
    assert "| 3:1 | spread | 3 | 1.000 | 1.031 | 1.000 | 1.031 | 1.062 | 1.062 | 1.00 | 0.75 | 3.0 | 1.50 | 2.50 | 0 + 0 |" in md
    assert "the teacher's cache there is 12.0 MiB" in md and "needles at 0%, 50% depth" in md
    assert (tmp_path / "frontier.png").stat().st_size > 0
    assert json.loads((tmp_path / "frontier.json").read_text())["rows"][0]["decode_compiled"] == 2.5
    fr.frontier([export], tmp_path, SETTINGS)  # kept: not measured again
    assert len(calls) == 1
    fr.frontier([export], tmp_path, {**SETTINGS, "recall_samples": 2})  # other settings: measured again
    assert len(calls) == 2


def test_frontier_refuses_bad_arguments_before_measuring(linearize_main, export, tmp_path):
    code, _, err = linearize_main("frontier", str(export), str(export), "--output", str(tmp_path))
    assert code == 2 and "two folders share a name" in err
    code, _, err = linearize_main("frontier", str(export), "--output", str(tmp_path), "--context-tokens", "100")
    assert code == 2 and "--context-tokens 100 is below the longest context: give at least 8192" in err
