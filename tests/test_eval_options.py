"""Options shared by `linearize eval`, `bench`, `ppl` and `recall`: --tasks spellings, --device/--dtype
auto, --trust-remote-code (off for anything but a linearize export), and ppl's --text-field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from linearize.eval import models as M
from linearize.eval import quality as Q
from linearize.eval import recall as R
from linearize.eval.cli import bench_main, bench_parser, eval_main, eval_parser, ppl_main, ppl_parser, recall_parser
from linearize.eval.tasks import build_tasks, resolve_task_names

TASK = "arc_easy"
HUB_TEACHER = "someorg/tiny-teacher"  # never downloaded: from_pretrained is stubbed where it is used
AUTO = ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


@pytest.fixture
def student(tiny_llama_dir, tmp_path) -> Path:
    """A copy of the conftest tiny Llama that records a teacher, as a conversion's output folder does."""
    path = tmp_path / "student"
    shutil.copytree(tiny_llama_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, M.TEACHER_KEY: str(tiny_llama_dir)}))
    return path


@pytest.fixture
def export_dir(tmp_path, tiny_linearize) -> Path:
    """A folder whose config.json is a real LinearizeConfig (model_type "linearize")."""
    path = tmp_path / "export"
    tiny_linearize(["linear_attention", "full_attention"]).config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def include(tmp_path_factory) -> Path:
    return build_tasks(tmp_path_factory.mktemp("tasks"), [TASK])


@pytest.fixture
def record_loads(monkeypatch, tiny_llama_dir):
    """Record the kwargs of every AutoModelForCausalLM / AutoTokenizer.from_pretrained call, by location.

    Anything without weights (HUB_TEACHER, a config-only export folder) is served from the tiny Llama
    folder, so a "hub" teacher loads without a network.
    """
    calls: list[tuple[str, str, dict]] = []
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def fake(kind, real):
        def from_pretrained(location, *args, **kwargs):
            calls.append((kind, str(location), kwargs))
            target = location if (Path(location) / "model.safetensors").is_file() else tiny_llama_dir
            return real(target, *args, **{k: v for k, v in kwargs.items() if k != "trust_remote_code"})

        return from_pretrained

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake("model", real_model))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake("tokenizer", real_tok))
    return calls


def test_tasks_take_commas_spaces_and_mixtures(tmp_path):
    parse = eval_parser().parse_args
    assert resolve_task_names(parse(["d", "--tasks", "arc_easy,piqa"]).tasks) == ["arc_easy", "piqa"]
    assert resolve_task_names(parse(["d", "--tasks", "arc_easy", "piqa"]).tasks) == ["arc_easy", "piqa"]
    mixed = parse(["d", "--tasks", "arc_easy,piqa_local", "hellaswag", "winogrande,", "piqa"]).tasks
    assert resolve_task_names(mixed) == ["arc_easy", "piqa", "hellaswag", "winogrande"]
    assert resolve_task_names(["arc_easy, piqa"]) == ["arc_easy", "piqa"]
    with pytest.raises(ValueError, match=r"unknown task 'mmlu'.*hellaswag"):
        resolve_task_names(["arc_easy,mmlu"])
    with pytest.raises(ValueError, match="no task named"):
        resolve_task_names([","])


@pytest.mark.parametrize("make", [eval_parser, bench_parser, ppl_parser, recall_parser])
def test_device_dtype_and_remote_code_flags_on_every_verb(make):
    args = make().parse_args(["d"])
    assert (args.device, args.dtype, args.trust_remote_code) == ("auto", "auto", False)
    args = make().parse_args(["d", "--device", "cuda:1", "--dtype", "float16", "--trust-remote-code"])
    assert (args.device, args.dtype, args.trust_remote_code) == ("cuda:1", "float16", True)


def test_ppl_names_its_text_column_flag_like_convert(capsys):
    assert ppl_parser().parse_args(["m", "--text-field", "body"]).text_field == "body"
    with pytest.raises(SystemExit):
        ppl_parser().parse_args(["m", "--column", "body"])  # renamed, no alias
    capsys.readouterr()


def test_resolve_device_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert M.resolve_device_dtype() == ("cpu", torch.float32)
    assert M.resolve_device_dtype("cpu", "bfloat16") == ("cpu", torch.bfloat16)
    assert M.resolve_device_dtype("cpu", torch.float16) == ("cpu", torch.float16)
    with pytest.raises(ValueError, match="CUDA is not available here: use --device cpu"):
        M.resolve_device_dtype("cuda")
    with pytest.raises(ValueError, match="unsupported --device 'tpu'"):
        M.resolve_device_dtype("tpu")
    with pytest.raises(ValueError, match="unsupported --dtype 'int8': use auto, float32, bfloat16, float16"):
        M.resolve_device_dtype("cpu", "int8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert M.resolve_device_dtype("auto", "auto") == ("cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="--device cuda:2 but this machine has 2 CUDA device"):
        M.resolve_device_dtype("cuda:2")
    assert M.resolve_device_dtype("cuda:1") == ("cuda:1", torch.bfloat16)
    assert M.resolve_device_dtype("cpu") == ("cpu", torch.float32)
    assert M.resolve_device_dtype("auto", "float32") == ("cuda", torch.float32)
    assert M.dtype_name(torch.bfloat16) == "bfloat16"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "unsupported --device 'tpu'"),
        (["--dtype", "int8"], "unsupported --dtype 'int8'"),
        (["--tasks", "arc_easy,mmlu"], "unknown task 'mmlu'"),
        (["--tasks", ","], "no task named"),
    ],
)
def test_bad_options_are_one_line_errors(student, argv, message, capsys):
    assert eval_main([str(student), "--skip-context", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linearize eval: error: ") and message in err and err.count("\n") == 1
    if "--tasks" not in argv:
        assert bench_main([str(student), "--skip-teacher", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("linearize bench: error: ") and message in err and err.count("\n") == 1


def test_verbs_run_with_auto_device_and_dtype(student, tmp_path, monkeypatch, one_torch_thread, capsys):
    auto = ["--device", "auto", "--dtype", "auto"]
    argv = [str(student), "--skip-teacher", "--contexts", "16", "--batch-sizes", "1", "--decode-tokens", "2", *auto]
    assert bench_main(argv) == 0
    report = json.loads((student / "bench.json").read_text())
    assert report["dtype"] == AUTO[1] and (AUTO[0] == "cuda" or report["device"].startswith("cpu"))

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"body": "the first answer is the right one. " * 8}) + "\n" for _ in range(4)))
    argv = [str(student), "--seq-len", "32", "--stride", "16", "--text-file", str(rows), "--text-field", "body"]
    assert ppl_main([*argv, *auto]) == 0
    assert "perplexity" in capsys.readouterr().out

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # eval builds its tasks in the user cache
    argv = [str(student), "--skip-teacher", "--skip-context", "--tasks", f"{TASK},", "--limit", "2", "--batch-size=2"]
    assert eval_main([*argv, *auto]) == 0
    report = json.loads((student / "eval.json").read_text())
    assert (report["device"], report["dtype"]) == AUTO and report["tasks"] == [TASK]
    assert f"{AUTO[1]} on {AUTO[0]}" in (student / "eval.md").read_text()


def _fake_results(*args, **kwargs) -> dict:
    return {"results": {f"{TASK}_local": {"acc,none": 0.5, "acc_stderr,none": 0.1}}}


@pytest.mark.parametrize("flag", [[], ["--trust-remote-code"]])
def test_eval_hub_teacher_runs_remote_code_only_when_asked(student, record_loads, monkeypatch, flag):
    seen = []
    monkeypatch.setattr(Q, "run_lm_eval", lambda model, **kw: seen.append(kw["trust_remote_code"]) or _fake_results())
    argv = [str(student), "--teacher", HUB_TEACHER, "--tasks", TASK, "--limit", "2", "--skip-context", "--device=cpu"]
    assert eval_main([*argv, *flag]) == 0
    hub = [(kind, kw) for kind, location, kw in record_loads if location == HUB_TEACHER]
    assert {kind for kind, _ in hub} == {"model", "tokenizer"}
    assert all(kw["trust_remote_code"] is bool(flag) for _, kw in hub)
    assert seen == [bool(flag), bool(flag)]  # the flag as given; run_lm_eval adds linearize exports itself
    assert json.loads((student / "eval.json").read_text())["teacher"] == HUB_TEACHER


def test_load_trusts_remote_code_for_linearize_exports_only(tiny_llama_dir, export_dir, record_loads):
    assert M.is_linearize_export(export_dir) and not M.is_linearize_export(tiny_llama_dir)
    assert not M.is_linearize_export(HUB_TEACHER)
    for spec, flag, expected in [
        (str(tiny_llama_dir), False, False),
        (str(tiny_llama_dir), True, True),
        (HUB_TEACHER, False, False),
        (HUB_TEACHER, True, True),
        (str(export_dir), False, True),
    ]:
        record_loads.clear()
        model, tokenizer, _ = M.load(spec, dtype=torch.bfloat16, trust_remote_code=flag)
        assert tokenizer is not None and next(model.parameters()).dtype == torch.bfloat16
        assert [kw["trust_remote_code"] for _, _, kw in record_loads] == [expected, expected], spec


@pytest.mark.parametrize("run", ["quality", "recall"])
def test_lm_eval_model_args_trust_only_linearize_exports(run, tiny_llama_dir, export_dir, include, monkeypatch):
    """The folder handed to lm-eval by path: remote code for our exports, or when asked; the dtype goes along."""
    import lm_eval

    args = []
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: args.append(kw["model_args"]) or _fake_results())

    def call(path, **kw):
        if run == "quality":
            return Q.run_lm_eval(str(path), tasks=[TASK], include_path=include, **kw)
        return R.evaluate_tasks(str(path), include, [], **kw)

    call(tiny_llama_dir)
    call(tiny_llama_dir, trust_remote_code=True, dtype=torch.bfloat16)
    call(export_dir)
    assert args == [
        f"pretrained={tiny_llama_dir},trust_remote_code=False,dtype=float32",
        f"pretrained={tiny_llama_dir},trust_remote_code=True,dtype=bfloat16",
        f"pretrained={export_dir},trust_remote_code=True,dtype=float32",
    ]
