"""Scale-out and the Python API: `accelerate launch` with 2 CPU processes (torchrun + gloo), and
`convert()` called on a model already in memory."""

import json
import math
import socket
import subprocess
import sys
import textwrap
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


def launch_conversion(model, cwd: Path, output: str, env: dict, *extra: str) -> subprocess.CompletedProcess:
    """`accelerate launch` of a 2-process conversion of the tiny model with an 8-token window (so the linear state works)."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", *ACCELERATE, "--main_process_port", str(free_port()),
        "-m", "linearize", "--model", str(model), "--output", output, "--overwrite", "--ratio", "3:1", "--placement", "spread",
        "--window", "8", "--sink", "2", "--transfer-tokens", "256", "--finetune-tokens", "256", "--seq-len", "32",
        "--batch-size", "2", "--heldout-tokens", "256", "--max-new-tokens", "3", "--quiet", *extra,
    ]  # fmt: skip
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def ddp_run(tiny_llama_dir, tmp_path_factory):
    """A 2-process DDP conversion, started over a stale, different run in its work folder."""
    from conftest import _linearize_env

    cwd = tmp_path_factory.mktemp("ddp")
    stale = cwd / ".ddp.work"
    stale.mkdir()
    (stale / "run.json").write_text(json.dumps({"fingerprint": "another run"}))
    for i in range(50):
        (stale / f"old{i}.safetensors").write_bytes(b"x")
    return cwd, launch_conversion(tiny_llama_dir, cwd, "ddp", _linearize_env())


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path; on GPUs --multi_gpu means NCCL")
def test_accelerate_launch_two_cpu_processes(ddp_run):
    cwd, proc = ddp_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = cwd / "ddp"
    assert proc.stdout.count("before / after") == 1  # only the main process reports
    assert proc.stdout.count("exported") == 1
    report = json.loads((out / "report.json").read_text())
    for name in ("transfer", "finetune"):
        stage = report["stages"][name]
        # 256 tokens / (2 rows x 32 tokens x 2 processes) = 2 steps; one process would take 4
        assert stage["steps"] == 2 and stage["tokens"] == 256, (name, stage)
        assert stage["final_loss"] is not None
    assert set(report["perplexity"]) == {"teacher", "zero_shot", "student"}
    # with --overwrite exactly one process discarded the stale run; the work folder went once the export was in place
    assert sorted(p.name for p in cwd.iterdir()) == ["ddp"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 7, 9]])).logits).all()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path; on GPUs --multi_gpu means NCCL")
def test_fsdp_on_two_cpu_processes_shards_the_weights_and_trains_as_ddp_does(ddp_run, tiny_llama_dir, cli_env):
    from safetensors.torch import load_file


    cwd, ddp = ddp_run
    assert ddp.returncode == 0, ddp.stderr[-4000:]
    proc = launch_conversion(tiny_llama_dir, cwd, "fsdp", cli_env, "--fsdp")
    assert proc.returncode == 0, proc.stderr[-4000:]
    sharded, replicated = (json.loads((cwd / name / "report.json").read_text()) for name in ("fsdp", "ddp"))
    weights = sharded["memory"]["weight_bytes"]
    for name in ("transfer", "finetune"):
        held, whole = sharded["stages"][name], replicated["stages"][name]
        assert held["steps"] == whole["steps"] == 2
        assert whole["weight_bytes_per_process"] > weights  # DDP: every process holds all of them (and the new ones)
        assert held["weight_bytes_per_process"] < 0.6 * whole["weight_bytes_per_process"]  # FSDP: half, plus what trains whole
        assert held["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-4)
    assert sharded["perplexity"] == pytest.approx(replicated["perplexity"], rel=1e-4)
    exported, reference = (load_file(cwd / name / "model.safetensors") for name in ("fsdp", "ddp"))
    assert exported.keys() == reference.keys()
    for key, value in exported.items():
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6)
    teacher = load_file(tiny_llama_dir / "model.safetensors")
    assert not torch.allclose(exported["model.layers.0.self_attn.q_proj.weight"], teacher["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.allclose(exported["model.layers.0.self_attn.window_factor"], torch.tensor(2.0))  # window_logit's default

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cwd / "fsdp", trust_remote_code=True)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 7, 9]])).logits).all()


SHARDED_RESUME = textwrap.dedent(
    """
    import sys
    import torch
    from accelerate import Accelerator
    from linearize.convert.recipes import Stage
    from linearize.convert.train import StageInterrupted, run_loop

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    data = torch.randint(0, 50, (40, 6), generator=torch.Generator().manual_seed(1))
    stage = Stage(tokens=10 * 2 * 6 * 2, batch_size=2, lr=0.05, checkpoint_every=3)

    def toy(seed):
        torch.manual_seed(seed)
        module = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3))
        return module, dict(module.named_parameters())

    def loss(model, batch):
        return (model(batch).sum(-1) - batch.float() / 50).pow(2).mean()

    module, params = toy(0)
    run_loop("stage", module, params, data, stage, loss, accelerator, None)
    replicated = {k: v.detach().clone() for k, v in params.items()}

    calls = []

    def interrupted(model, batch):
        calls.append(1)
        if len(calls) == 8:  # during step 7 on both processes: the checkpoint of step 6 is the last one
            raise KeyboardInterrupt
        return loss(model, batch)

    module, params = toy(0)
    try:
        run_loop("stage", module, params, data, stage, interrupted, accelerator, sys.argv[1], shard=True)
    except StageInterrupted as err:
        print(f"rank {rank}: {err}", flush=True)
    module, params = toy(5)  # a fresh start: parameters and optimizer moments come from the checkpoint
    result = run_loop("stage", module, params, data, stage, loss, accelerator, sys.argv[1], shard=True)
    assert result.resumed_from == 7 and result.steps == 10, result
    for name, value in params.items():
        torch.testing.assert_close(value.detach(), replicated[name], rtol=1e-6, atol=1e-7)
    print(f"rank {rank}: sharded and resumed equals replicated", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path")
def test_a_sharded_stage_checkpoints_whole_tensors_and_resumes(tmp_path, cli_env):
    script = tmp_path / "resume.py"
    script.write_text(SHARDED_RESUME)
    (tmp_path / "work").mkdir()
    command = [sys.executable, "-m", "accelerate.commands.launch", *ACCELERATE, "--main_process_port", str(free_port()), str(script), "work"]
    proc = subprocess.run(command, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: interrupted: stage progress saved at step 7" in proc.stdout
        assert f"rank {rank}: sharded and resumed equals replicated" in proc.stdout
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "work" / "stage.safetensors")
    assert saved["param.1.weight"].shape == (3, 8)  # whole tensors, not one process's shard


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
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"\n# {tiny_llama_dir.name}, linearized (GLA, 3 of 4 layers linear)\n" in card  # the teacher given, by name
    assert str(tiny_llama_dir) not in card  # and no local path
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


def _hand_perplexity(model, ids: list[int], length: int) -> float:
    """exp(mean NLL) from each non-overlapping window's full logits: every target once, no chunking."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, length):
            window = torch.tensor([ids[start : start + length]])
            targets = torch.tensor(ids[start + 1 : start + length + 1])
            logits = model(window, use_cache=False).logits[0, : len(targets)]
            nll += torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum").item()
            count += len(targets)
    return math.exp(nll / count)


def test_conversion_scores_perplexity_against_context(tiny_llama_dir, tmp_path):
    """report.json's and the card's perplexity against context: teacher and student columns recomputed by hand."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from linearize.convert.data import heldout_text

    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    recipe = tiny_recipe()
    recipe.eval.contexts = [16, 128, 1024]  # 1024: past the 256 held-out tokens, dropped
    student, report = convert(teacher, tokenizer, recipe=recipe, output=tmp_path / "out")
    rows = report.contexts
    assert [r["context"] for r in rows] == [16, 64, 128]  # eval.contexts and heldout_seq_len (64)
    ids = tokenizer(heldout_text())["input_ids"][:257]  # 256 = two 128-token windows: every length scores them
    student.eval()
    for row in rows:
        assert row["tokens"] == 256
        assert row["teacher"] == pytest.approx(_hand_perplexity(teacher, ids, row["context"]), rel=1e-4)
        assert row["student"] == pytest.approx(_hand_perplexity(student, ids, row["context"]), rel=1e-4)
        assert row["ratio"] == pytest.approx(row["student"] / row["teacher"])
    at_64 = rows[1]
    assert report.perplexity["teacher"] == at_64["teacher"] and report.perplexity["student"] == at_64["student"]
    assert report.heldout_seq_len == 64 and report.heldout_tokens == 256
    assert "student / teacher by context" in dict(report.rows())
    card = (tmp_path / "out" / "README.md").read_text()
    table = card[card.index("### Perplexity against context") :]
    for r in rows:
        assert f"| {r['context']} | 256 | {r['teacher']:.2f} | {r['student']:.2f} | {r['ratio']:.3f} |" in table
    assert json.loads((tmp_path / "out" / "report.json").read_text())["contexts"] == rows


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


@pytest.mark.parametrize(("dtype", "expected"), [("auto", torch.float16), ("bfloat16", torch.bfloat16)])
def test_an_in_memory_teacher_goes_where_a_loaded_one_would(tiny_llama_dir, dtype, expected):
    """On the accelerator's device (a GPU run once failed with the teacher left on the CPU), in the recipe's
    dtype, or its own under `auto`."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from linearize.convert.pipeline import load_teacher

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float16)
    accelerator = Accelerator(cpu=True)
    teacher, *_ = load_teacher(model, AutoTokenizer.from_pretrained(tiny_llama_dir), tiny_recipe(dtype=dtype), accelerator)
    assert {(p.device, p.dtype) for p in teacher.parameters()} == {(accelerator.device, expected)}
