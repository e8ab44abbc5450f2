"""Options shared by `linearize eval`, `bench`, `ppl` and `recall`: --tasks spellings, --device/--dtype
auto, --trust-remote-code (off for anything but a linearize export), and ppl's --text-field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from linearize.eval import models as M
from linearize.eval import quality as Q
from linearize.eval import recall as R
from linearize.eval.cli import bench_main, bench_parser, eval_main, eval_parser, ppl_main, ppl_parser, recall_parser
from linearize.eval.tasks import build_tasks, resolve_task_names
from linearize.options import split_list

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
    folder, so a "hub" teacher loads without a network; HUB_TEACHER's config (read by the checks
    before any work) too, unrecorded.
    """
    calls: list[tuple[str, str, dict]] = []
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    real_config = AutoConfig.from_pretrained
    monkeypatch.setattr(
        AutoConfig,
        "from_pretrained",
        lambda location, *a, **kw: real_config(tiny_llama_dir if str(location) == HUB_TEACHER else location, *a, **kw),
    )

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
    assert resolve_task_names(split_list(parse(["d", "--tasks", "arc_easy,piqa"]).tasks)) == ["arc_easy", "piqa"]
    assert resolve_task_names(split_list(parse(["d", "--tasks", "arc_easy", "piqa"]).tasks)) == ["arc_easy", "piqa"]
    mixed = parse(["d", "--tasks", "arc_easy,piqa_local", "hellaswag", "winogrande,", "piqa"]).tasks
    assert resolve_task_names(split_list(mixed)) == ["arc_easy", "piqa", "hellaswag", "winogrande"]
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
        (["--dtype", "int8"], "argument --dtype: 'int8' is not a dtype: use auto, float32, bfloat16 or float16 (bf16, fp16, fp32"),
        (["--tasks", "arc_easy,mmlu"], "unknown task 'mmlu'"),
        (["--tasks", ","], "no task named"),
    ],
)
def test_bad_options_are_one_line_errors(student, argv, message, capsys):
    def code(main, argv):
        """The exit code, whether the verb returns it or its parser exits (argparse's own refusals)."""
        try:
            return main(argv)
        except SystemExit as exc:
            return exc.code

    assert code(eval_main, [str(student), "--skip-context", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linearize eval: error: ") and message in err and err.count("\n") == 1
    if "--tasks" not in argv:
        assert code(bench_main, [str(student), "--skip-teacher", *argv]) == 2
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


# ---- one list syntax, one dtype vocabulary, in every verb -------------------------------------------


def _kernel_parser():
    from linearize.eval.kernel_bench import _parser

    return _parser()


def _convert_parser():
    from linearize.convert.cli import convert_parser

    return convert_parser()


LIST_FLAGS = [
    (eval_parser, ["d"], "--tasks"),
    (eval_parser, ["d"], "--contexts"),
    (eval_parser, ["d"], "--texts"),
    (bench_parser, ["d"], "--contexts"),
    (bench_parser, ["d"], "--batch-sizes"),
    (ppl_parser, ["m"], "--contexts"),
    (ppl_parser, ["m"], "--text-file"),
    (recall_parser, ["d"], "--lengths"),
    (recall_parser, ["d"], "--depths"),
    (recall_parser, ["d"], "--tasks"),
    (_kernel_parser, [], "--seq-lens"),
    (_kernel_parser, [], "--head-dims"),
    (_kernel_parser, [], "--decode-contexts"),
    (_convert_parser, [], "--linear-layers"),
    (_convert_parser, [], "--keep-softmax"),
    (_convert_parser, [], "--lora-targets"),
    (_convert_parser, [], "--seq-len"),
]


@pytest.mark.parametrize("make, positional, flag", LIST_FLAGS)
def test_every_list_flag_takes_commas_and_spaces(make, positional, flag):
    dest = flag[2:].replace("-", "_")
    for spelling in (["512,1024"], ["512, 1024"], ["512,", "1024"], ["512", "1024"], ["512 1024"]):
        assert getattr(make().parse_args([*positional, flag, *spelling]), dest) == "512,1024", spelling


@pytest.mark.parametrize("make, positional", [(eval_parser, ["d"]), (bench_parser, ["d"]), (ppl_parser, ["m"]),
                                              (recall_parser, ["d"]), (_kernel_parser, []), (_convert_parser, [])])  # fmt: skip
def test_every_verb_takes_torch_dtype_names_and_the_short_aliases(make, positional, capsys):
    for given, name in (("bf16", "bfloat16"), ("FP16", "float16"), ("fp32", "float32"), ("bfloat16", "bfloat16"), ("auto", "auto")):
        assert make().parse_args([*positional, "--dtype", given]).dtype == name
    with pytest.raises(SystemExit) as exc:
        make().parse_args([*positional, "--dtype", "int8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --dtype: 'int8' is not a dtype: use auto, float32, bfloat16 or float16 (bf16, fp16, fp32 also accepted)" in err


def test_a_recipe_takes_the_same_dtype_words():
    from linearize.convert.recipes import parse_recipe

    assert parse_recipe({"dtype": "bf16"}).dtype == "bfloat16"
    assert parse_recipe({"dtype": "float16"}).torch_dtype(torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match=r"recipe key 'dtype' must be auto, float32, bfloat16 or float16 \(bf16, fp16, fp32 also accepted\), got 'int8'"):
        parse_recipe({"dtype": "int8"})


def test_kernel_bench_lists_and_dtype_reach_the_run(monkeypatch, tmp_path):
    from linearize.eval import kernel_bench as K

    seen = {}

    def prefill(args, device, dtype):
        seen.update(seq_lens=args.seq_lens, head_dims=args.head_dims, contexts=args.decode_contexts, dtype=dtype)
        raise SystemExit(0)

    monkeypatch.setattr(K, "bench_prefill", prefill)
    with pytest.raises(SystemExit):
        K.kernel_bench_main(["--device", "cpu", "--seq-lens", "64, 128", "--head-dims", "16", "--decode-contexts", "",
                             "--dtype", "bf16", "--threads", "1", "--out", str(tmp_path)])  # fmt: skip
    assert seen == {"seq_lens": [64, 128], "head_dims": [16], "contexts": [], "dtype": torch.bfloat16}


# ---- every check before any model work ----------------------------------------------------------------


@pytest.fixture
def no_model_work(monkeypatch):
    """Any benchmark run or model load fails the test: the checks must refuse first."""
    from linearize.eval import bench as B
    from linearize.eval import perplexity as P

    def work(*args, **kwargs):
        raise AssertionError("model work started before the arguments were checked")

    for module, name in ((Q, "run_lm_eval"), (Q, "evaluate"), (R, "run_recall"), (B, "run_bench"), (M, "load"),
                         (P, "context_report"), (AutoModelForCausalLM, "from_pretrained")):  # fmt: skip
        monkeypatch.setattr(module, name, work)


@pytest.mark.parametrize("main", [eval_main, bench_main, "recall", ppl_main])
def test_a_missing_teacher_is_refused_before_any_work(main, student, no_model_work, capsys, tmp_path):
    from linearize.eval.cli import recall_main

    main = recall_main if main == "recall" else main
    code = main([str(student), "--teacher", str(tmp_path / "nonexistent"), "--device", "cpu"])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"model folder '{tmp_path / 'nonexistent'}' not found: check the path" in captured.err


def test_a_corrupt_recorded_teacher_is_refused_before_the_student_runs(student, tiny_llama_dir, tmp_path, no_model_work, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_llama_dir, teacher)
    (teacher / "model.safetensors").write_bytes(b"not safetensors" * 4)
    cfg = json.loads((student / "config.json").read_text())
    (student / "config.json").write_text(json.dumps({**cfg, M.TEACHER_KEY: str(teacher)}))
    assert eval_main([str(student), "--device", "cpu"]) == 2
    assert "model.safetensors' is corrupt" in capsys.readouterr().err


@pytest.mark.parametrize(
    "main, argv, message",
    [
        (eval_main, ["--tasks", "arc_easy,mmlu"], "unknown task 'mmlu'"),
        (eval_main, ["--contexts", "512,x"], "bad --contexts '512,x'"),
        (eval_main, ["--texts", "pydoc,nope"], "unknown held-out text 'nope'"),
        (bench_main, ["--batch-sizes", "0"], "bad --batch-sizes '0'"),
        (bench_main, ["--decode-tokens", "-1"], "bad --decode-tokens -1"),
        ("recall", ["--depths", "0,150"], "bad --depths '0,150'"),
        ("recall", ["--samples", "0"], "bad --samples 0"),
        ("recall", ["--tasks", "passkey,nope"], "unknown recall task 'nope'"),
        (ppl_main, ["--contexts", "a"], "bad --contexts 'a'"),
    ],
)
def test_bad_settings_are_refused_before_any_work(main, argv, message, student, no_model_work, capsys):
    from linearize.eval.cli import recall_main

    main = recall_main if main == "recall" else main
    assert main([str(student), "--device", "cpu", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


# ---- no stray lines --------------------------------------------------------------------------------------


def test_lm_eval_outside_a_git_checkout_prints_no_git_error(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_git_commit_hash

    from linearize.eval.cli import _quiet_lm_eval

    if shutil.which("git") is None:
        pytest.skip("git is not installed: nothing to print")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.setattr(lm_eval.evaluator, "get_git_commit_hash", get_git_commit_hash)  # lm-eval's own
    lm_eval.evaluator.get_git_commit_hash()
    assert "fatal: not a git repository" in capfd.readouterr().err  # what lm-eval's own lookup prints
    _quiet_lm_eval()
    assert lm_eval.evaluator.get_git_commit_hash() is None
    assert capfd.readouterr().err == ""
