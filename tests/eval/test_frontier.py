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


def fake_part(part: str, student: float = 1.031, state_off: float = 1.062) -> dict:
    if part == "perplexity":
        rows = lambda: [  # noqa: E731
            {"context": 16, "tokens": 128, "teacher": 10.0, "student": 10.0, "ratio": 1.0, "state_off": 10.0, "state_off_ratio": 1.0},
            {"context": 64, "tokens": 128, "teacher": 8.0, "student": 8.0 * student, "ratio": student, "state_off": 8.0 * state_off, "state_off_ratio": state_off},
        ]  # fmt: skip
        return {"pydoc": rows(), "britannica": rows()}
    if part == "recall":
        return {"1024": {"student": 0.5, "teacher": 0.5, "ratio": 1.0}, "2048": {"student": 0.3, "teacher": 0.4, "ratio": 0.75}}
    decode = {"status": "ok", "student_cache_bytes": 3 * 2**20, "teacher_cache_bytes": 12 * 2**20}
    return {"eager": {**decode, "decode_speedup": 1.5}, "compiled": {**decode, "decode_speedup": 2.5}}


def test_describe_export_reads_the_plan_from_the_report(export):
    described = fr.describe_export(export)
    assert described["summary"] == "3:1" and described["placement"] == "spread" and described["linear_layers"] == 3
    assert described["softmax_layers"] == [3] and described["plan"] == "LLLS"
    assert described["transfer_tokens"] == 0 and described["attention"]["window"] == 16
    with pytest.raises(FileNotFoundError, match="has no report.json: pass folders that `linearize` converted"):
        fr.describe_export(export.parent)


def test_frontier_keeps_parts_and_writes_the_table_and_plot(export, tmp_path, monkeypatch):
    calls = []

    def measure(part, folder, settings):
        calls.append(part)
        return fake_part(part)

    monkeypatch.setattr(fr, "measure_part", measure)
    rows = fr.frontier([export], tmp_path, SETTINGS, parts=("perplexity", "recall"))
    assert calls == ["perplexity", "recall"] and len(rows) == 1
    md = (tmp_path / "frontier.md").read_text()
    assert "| 3:1 | spread | 3 | 1.000 | 1.031 | 1.000 | 1.031 | 1.062 | 1.062 | 1.00 | 0.75 | - | - | - | 0 + 0 |" in md
    (row,) = fr.frontier([export], tmp_path, SETTINGS)  # the kept parts are reused; decode is measured now
    assert calls == ["perplexity", "recall", "decode"]
    assert row["ppl_ratio"]["pydoc"]["64"] == pytest.approx(1.031) and row["state_off_ratio"]["britannica"] == pytest.approx(1.062)
    md = (tmp_path / "frontier.md").read_text()
    assert "| layers L:S | placement | softmax layers | ppl S/T pydoc 16 | ppl S/T pydoc 64 |" in md
    assert "| 3:1 | spread | 3 | 1.000 | 1.031 | 1.000 | 1.031 | 1.062 | 1.062 | 1.00 | 0.75 | 3.0 | 1.50 | 2.50 | 0 + 0 |" in md
    assert "the teacher's cache there is 12.0 MiB" in md and "needles at 0%, 50% depth" in md
    assert (tmp_path / "frontier.png").stat().st_size > 0
    assert json.loads((tmp_path / "frontier.json").read_text())["rows"][0]["decode_compiled"] == 2.5
    fr.frontier([export], tmp_path, {**SETTINGS, "recall_samples": 2})  # other recall settings: only recall again
    assert calls == ["perplexity", "recall", "decode", "recall"]
    # a table made without measuring leaves out a kept part measured under other settings
    (row,) = fr.frontier([export], tmp_path, {**SETTINGS, "recall_samples": 2, "decode_tokens": 8}, parts=("perplexity",))
    assert calls[-1] == "recall" and row["decode_compiled"] is None and row["recall_ratio"]["2048"] == 0.75


def test_frontier_refuses_bad_arguments_before_measuring(linearize_main, export, tmp_path):
    code, _, err = linearize_main("frontier", str(export), str(export), "--output", str(tmp_path))
    assert code == 2 and "two folders share a name" in err
    code, _, err = linearize_main("frontier", str(export), "--output", str(tmp_path), "--context-tokens", "100")
    assert code == 2 and "--context-tokens 100 is below the longest context: give at least 8192" in err
    code, _, err = linearize_main("frontier", str(export), "--output", str(tmp_path), "--parts", "speed")
    assert code == 2 and "bad --parts 'speed': use some of perplexity, recall, decode" in err
