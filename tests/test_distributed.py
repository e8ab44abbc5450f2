"""Scale-out and the Python API: `accelerate launch` with 2 CPU processes (torchrun + gloo), and
`convert()` called on a model already in memory."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linearize.convert import Recipe, convert, load_recipe
from linearize.convert.pipeline import ConversionReport
from linearize.modeling.modeling_linearize import LinearizeForCausalLM

# accelerate's `--cpu` always starts ONE process (its simple launcher); several CPU processes come from the
# torchrun launcher behind `--multi_gpu`, which on a machine without GPUs runs them on CPU over gloo.
ACCELERATE = [
    "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
    "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path; on GPUs --multi_gpu means NCCL")
def test_accelerate_launch_two_cpu_processes(tiny_llama_dir, tmp_path, cli_env):
    # A stale, different run in the work folder: with --overwrite exactly one process must discard it.
    stale = tmp_path / ".ddp.work"
    stale.mkdir()
    (stale / "run.json").write_text(json.dumps({"fingerprint": "another run"}))
    for i in range(50):
        (stale / f"old{i}.safetensors").write_bytes(b"x")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", *ACCELERATE, "--main_process_port", str(free_port()),
        "-m", "linearize", "--model", str(tiny_llama_dir), "--output", "ddp", "--overwrite", "--ratio", "3:1", "--placement", "spread",
        "--transfer-tokens", "256", "--finetune-tokens", "256", "--seq-len", "32", "--batch-size", "2",
        "--heldout-tokens", "256", "--max-new-tokens", "3", "--quiet",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "ddp"
    assert proc.stdout.count("before / after") == 1  # only the main process reports
    assert proc.stdout.count("exported") == 1
    report = json.loads((out / "report.json").read_text())
    for name in ("transfer", "finetune"):
        stage = report["stages"][name]
        # 256 tokens / (2 rows x 32 tokens x 2 processes) = 2 steps; one process would take 4
        assert stage["steps"] == 2 and stage["tokens"] == 256, (name, stage)
        assert stage["final_loss"] is not None
    assert set(report["perplexity"]) == {"teacher", "zero_shot", "student"}
    assert not stale.exists()  # work folder removed once the export is in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 7, 9]])).logits).all()


# ---- the Python API ---------------------------------------------------------------------------------


def tiny_recipe(**changes) -> Recipe:
    recipe = load_recipe("smollm2-gla")  # a shipped recipe, scaled down: its own plan, attention and losses
    recipe.layers.keep_softmax = [0]
    recipe.attention.window = 8
    for stage, tokens in ((recipe.transfer, 128), (recipe.finetune, 128)):
        stage.tokens, stage.seq_len, stage.batch_size = tokens, 32, 2
    recipe.eval.heldout_tokens, recipe.eval.heldout_seq_len = 256, 64
    for key, value in changes.items():
        setattr(recipe, key, value)
    return recipe


def test_convert_a_model_in_memory(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student, report = convert(teacher, tokenizer, recipe=tiny_recipe(), output=tmp_path / "out")

    assert isinstance(student, LinearizeForCausalLM) and isinstance(report, ConversionReport)
    # 4 layers, 3:1 with layer 0 kept softmax: one softmax layer in all, layer 0
    assert report.plan == "SLLL"
    assert student.config.layer_types == ["full_attention"] + ["linear_attention"] * 3
    assert set(report.stages) == {"transfer", "finetune"} and report.stages["transfer"]["steps"] == 2
    assert set(report.perplexity) == {"teacher", "zero_shot", "student"}
    assert report.resolved == str(tiny_llama_dir)
    assert report.model != "embedded:smollm2-135m-instruct"  # the teacher given, not the recipe's default model
    assert str(tiny_llama_dir) in (tmp_path / "out" / "README.md").read_text()
    # the teacher itself is left as it was
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, before[name]), name
    # the export is the returned student
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = torch.tensor([tokenizer("def main():")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student(ids).logits, rtol=1e-4, atol=1e-4)


def test_convert_without_output_writes_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    recipe = tiny_recipe()
    recipe.finetune.tokens = 0
    student, report = convert(teacher, tokenizer, recipe=recipe, measure=False)
    assert report.output is None and report.perplexity == {} and list(report.stages) == ["transfer"]
    assert list(Path(tmp_path).iterdir()) == []
    assert not any(p.requires_grad for p in student.parameters())


def test_convert_by_spec_string(tiny_llama_dir, tmp_path):
    recipe = tiny_recipe()
    recipe.transfer.tokens = recipe.finetune.tokens = 0
    student, report = convert(str(tiny_llama_dir), recipe=recipe, measure=False)
    assert report.model == str(tiny_llama_dir) and report.plan == "SLLL" and report.stages == {}


def test_convert_in_memory_needs_the_tokenizer(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="pass the teacher's tokenizer"):
        convert(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), None, recipe=tiny_recipe())
