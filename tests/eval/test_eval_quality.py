"""lm-eval plumbing on a tiny random model: the Python API, the report files, the CLIs, and the real
`lm_eval` command line over the local tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from linearize.convert.card import markers
from linearize.eval import quality as Q
from linearize.eval.cli import eval_main, ppl_main
from linearize.eval.tasks import build_tasks
from conftest import tiny_fields

TASK = "arc_easy"  # reports acc and acc_norm


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in memory (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["Question: which answer is the right one?\nAnswer: the first one."] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>")


def save_tiny(path: Path, seed: int, teacher: str | None = None) -> Path:
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **tiny_fields(
            vocab_size=len(tokenizer),
            max_position_embeddings=2048,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
    )
    if teacher:
        cfg.linearize_teacher = teacher
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    teacher = save_tiny(root / "teacher", seed=0)
    student = save_tiny(root / "student", seed=1, teacher=str(teacher))
    return student, teacher


@pytest.fixture(scope="module")
def include(tmp_path_factory) -> Path:
    return build_tasks(tmp_path_factory.mktemp("tasks"), [TASK])


def test_run_lm_eval_on_a_local_task(dirs, include):
    out = Q.run_lm_eval(str(dirs[1]), tasks=[TASK], limit=2, batch_size=2, include_path=include)
    res = out["results"][f"{TASK}_local"]
    assert 0.0 <= res["acc_norm,none"] <= 1.0 and "acc,none" in res
    assert out["n-samples"][f"{TASK}_local"]["effective"] == 2
    assert Q.primary_metric(res) == "acc_norm"


def test_evaluate_writes_reports_and_model_card(dirs, tmp_path, monkeypatch):
    student, _ = dirs
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # evaluate() builds its tasks in the user cache
    (student / "README.md").write_text("# tiny\n\ncard text\n")
    for _ in range(2):  # the second run replaces the block instead of adding one
        report = Q.evaluate(student, tasks=[TASK], limit=2, batch_size=2)
    row = report["rows"][0]
    assert row["task"] == TASK and row["metric"] == "acc_norm" and row["n"] == 2
    assert report["teacher"] == str(dirs[1])
    saved = json.loads((student / "eval.json").read_text())
    assert saved["rows"] == report["rows"] and saved["summary"] == report["summary"]
    card = (student / "README.md").read_text()
    assert card.startswith("# tiny\n\ncard text")
    begin, end = markers("eval")
    assert card.count(begin) == 1 and card.count(end) == 1
    assert f"| {TASK} | acc_norm | 2 |" in card
    assert "| task | metric" in (student / "eval.md").read_text()
    summary = report["summary"]
    assert summary["student_seconds"] > 0 and summary["teacher_seconds"] > 0
    ratio = summary["student_seconds"] / summary["teacher_seconds"]
    assert f"| wall time | seconds |  |  | {summary['teacher_seconds']:.0f} | {summary['student_seconds']:.0f} | {ratio:.2f} |" in card


def test_compare_and_tables():
    student = {
        "results": {
            "piqa_local": {
                "acc,none": 0.6,
                "acc_stderr,none": 0.01,
                "acc_norm,none": 0.62,
                "acc_norm_stderr,none": 0.011,
            },
            "winogrande_local": {"acc,none": 0.5, "acc_stderr,none": "N/A"},
        },
        "n-samples": {"piqa_local": {"effective": 100}, "winogrande_local": {"effective": 100}},
    }
    teacher = {
        "results": {
            "piqa_local": {"acc,none": 0.6, "acc_norm,none": 0.64, "acc_norm_stderr,none": 0.011},
            "winogrande_local": {"acc,none": 0.52, "acc_stderr,none": 0.014},
        }
    }
    rows, summary = Q.compare(student, teacher)
    assert [(r["task"], r["metric"]) for r in rows] == [("piqa", "acc_norm"), ("winogrande", "acc")]
    assert rows[0]["ratio"] == pytest.approx(0.62 / 0.64) and rows[1]["student_stderr"] is None
    assert summary["average_recovery"] == pytest.approx((0.62 / 0.64 + 0.5 / 0.52) / 2)
    md = Q.markdown_table(rows, summary)
    assert "| piqa | acc_norm | 100 | 0.50 | 0.640 ± 0.011 | 0.620 ± 0.011 | 0.969 |" in md
    rows, summary = Q.compare(student, None)
    assert rows[0]["ratio"] is None and summary["average_recovery"] is None
    Q.render_table(rows, summary)


def test_eval_cli_input_errors(dirs, tmp_path, capsys):
    student, teacher = dirs
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(tmp_path / "empty")], "no config.json"),
        ([str(student), "--tasks", "mmlu"], "unknown task 'mmlu'"),
        ([str(teacher)], "pass --teacher"),
        ([str(student), "--limit", "0"], "bad --limit"),
    ]
    if not torch.cuda.is_available():
        cases.append(([str(student), "--device", "cuda"], "CUDA is not available"))
    for argv, message in cases:
        assert eval_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("linearize eval: error: ") and message in err and err.count("\n") == 1


def test_ppl_cli(dirs, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("Question: which answer is the right one?\nAnswer: the first one. " * 20)
    assert ppl_main([str(dirs[1]), "--text-file", str(text), "--seq-len", "32", "--stride", "16"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert ppl_main([str(dirs[1]), "--seq-len", "8", "--stride", "9"]) == 2
    assert "stride" in capsys.readouterr().err


@pytest.mark.slow  # a fresh `lm_eval` process indexes every stock task first (~15 s)
def test_lm_eval_command_line(dirs, tmp_path):
    """The documented shell path: build the tasks with `python -m`, then run the `lm_eval` command."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "linearize.eval.tasks", "--tasks", TASK],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    include = built.stdout.strip()
    assert include == str(tmp_path / "xdg" / "linearize" / "tasks")
    lm_eval = Path(sys.executable).parent / "lm_eval"
    run = subprocess.run(
        [str(lm_eval), "--model", "hf", "--model_args", f"pretrained={dirs[0]},trust_remote_code=True",
         "--tasks", f"{TASK}_local", "--include_path", include, "--limit", "2", "--device", "cpu", "--batch_size", "2"],
        capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"{TASK}_local" in run.stdout and "acc_norm" in run.stdout
