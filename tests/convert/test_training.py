"""Training works and stays lean: stage 1 learns, LoRA merges exactly, steps split into passes give the
same update, a resumed stage ends where an uninterrupted one does (after Ctrl-C or a full disk), a bf16
model trains fp32 masters, and a non-finite loss on one process stops every process."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from linearize.convert import train as train_module

from linearize.convert.pipeline import _stage_data
from linearize.convert.plan import plan_layers
from linearize.convert.recipes import Recipe, Stage
from linearize.convert.swap import linearize_model, new_parameters
from linearize.convert.train import Checkpoint, StageInterrupted, attention_transfer, lora_finetune, measure_layer_errors, run_loop

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = {**Recipe().linear_attention(), "window": 8, "sink": 2}


def tiny_student(tiny_llama_dir, dtype=torch.float32):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype)
    teacher.requires_grad_(False)
    return teacher, linearize_model(teacher, plan_layers(4, linear_layers=[0, 1, 2]), SETTINGS, "tiny")


def test_stage1_lowers_the_transfer_loss(tiny_llama_dir, tiny_tokenizer):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).requires_grad_(False)
    student = linearize_model(teacher, plan_layers(4, linear_layers=[0, 1, 2]), Recipe().linear_attention())
    stage = dataclasses.replace(Recipe().transfer, tokens=64 * 2 * 40, seq_len=64, batch_size=2, lr=5e-2)
    rows = _stage_data(stage, tiny_tokenizer, seed=0)
    before = sum(measure_layer_errors(student, rows[0][:4]).values())
    result = attention_transfer(student, rows, stage, Accelerator(cpu=True), None)
    assert result.steps == 40
    assert sum(measure_layer_errors(student, rows[0][:4]).values()) < 0.95 * before  # about 0.9x on this model


@pytest.mark.parametrize("per_pass", [None, 32])
def test_stage1_backpropagating_each_layer_in_its_forward_equals_one_backward(tiny_llama_dir, tiny_tokenizer, per_pass):
    """Stage 1's local losses (each layer's backward at the end of its forward, in passes of one row or not)
    give the same parameters as the sum of the losses backpropagated once."""
    from linearize.modeling.modeling_linearize import linear_attentions
    from linearize.modeling.modes import transfer_mode

    stage = dataclasses.replace(Recipe().transfer, tokens=32 * 2 * 3, seq_len=32, batch_size=2, lr=1e-2)
    rows = _stage_data(stage, tiny_tokenizer, seed=0)

    def step_loss(backbone, batch):
        backbone(input_ids=batch, use_cache=False)
        return torch.stack([layer.transfer_loss for layer in linear_attentions(backbone)]).sum()

    trained = []
    for local in (False, True):
        torch.manual_seed(0)  # the same init of the new parameters
        _, student = tiny_student(tiny_llama_dir)
        student.requires_grad_(False)
        params = new_parameters(student)
        for p in params.values():
            p.requires_grad_(True)
        with transfer_mode(student):
            result = run_loop(
                "transfer", student.base_model, params, rows, stage, step_loss, Accelerator(cpu=True), None, per_pass,
                local_losses=local,
            )  # fmt: skip
        trained.append(({k: v.detach().clone() for k, v in params.items()}, [loss for _, loss in result.curve]))
    (once, once_curve), (local, local_curve) = trained
    assert local_curve == pytest.approx(once_curve, rel=1e-5)
    for name, value in local.items():
        torch.testing.assert_close(value, once[name], rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    untrained = tiny_student(tiny_llama_dir)[1]
    assert any(not torch.allclose(value, untrained.get_parameter(name)) for name, value in local.items())


def test_merged_lora_equals_the_peft_model_and_leaves_the_teacher(tiny_llama_dir, tiny_tokenizer, monkeypatch):
    import peft

    teacher, student = tiny_student(tiny_llama_dir)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = {}
    real_merge = peft.LoraModel.merge_and_unload

    def merge(self, *args, **kwargs):
        self.eval()
        with torch.no_grad():
            seen["peft"] = self(input_ids=ids, use_cache=False).logits
        return real_merge(self, *args, **kwargs)

    monkeypatch.setattr(peft.LoraModel, "merge_and_unload", merge)
    stage = dataclasses.replace(Recipe().finetune, tokens=3 * 2 * 64, seq_len=64, batch_size=2, lr=1e-2, loss="kl")
    lora_finetune(student, _stage_data(stage, tiny_tokenizer, seed=0), stage, Accelerator(cpu=True), None)
    assert not any("lora" in name for name, _ in student.named_parameters())
    with torch.no_grad():
        merged = student.eval()(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(merged, seen["peft"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged, linearize_model(teacher, student.config.layer_types, SETTINGS)(ids).logits)
    for key, value in teacher.state_dict().items():  # shared frozen weights: the merge wrote new tensors
        assert torch.equal(value, before[key]), key


def toy(seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 1))
    return module, dict(module.named_parameters())


def toy_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (model(batch).squeeze(-1) - batch.float() / 50).pow(2).mean()


DATA = torch.randint(0, 50, (40, 6), generator=torch.Generator().manual_seed(1))


def test_passes_split_a_step_into_the_same_update():
    stage = Stage(tokens=5 * 4 * 6, batch_size=4, lr=0.05)
    results = []
    for per_pass in (None, 6, 12):  # 4 rows at once, one row per pass, two rows per pass
        module, params = toy()
        result = run_loop("stage", module, params, DATA, stage, toy_loss, Accelerator(cpu=True), None, per_pass)
        results.append(({k: v.detach().clone() for k, v in params.items()}, [loss for _, loss in result.curve]))
    for params, curve in results[1:]:
        for name, value in params.items():
            torch.testing.assert_close(value, results[0][0][name], rtol=1e-6, atol=1e-7)
        assert curve == pytest.approx(results[0][1], rel=1e-6)


def test_a_resumed_stage_ends_equal_to_an_uninterrupted_one(tmp_path):
    stage = Stage(tokens=10 * 2 * 6, batch_size=2, lr=0.05, checkpoint_every=3)
    module, params = toy()
    run_loop("stage", module, params, DATA, stage, toy_loss, Accelerator(cpu=True), None)
    uninterrupted = {k: v.detach().clone() for k, v in params.items()}

    module, params = toy()
    calls = []

    def interrupted(model, batch):
        calls.append(1)
        if len(calls) == 8:  # during step 7: the checkpoint of step 6 is the last one
            raise KeyboardInterrupt
        return toy_loss(model, batch)

    with pytest.raises(StageInterrupted, match="progress saved at step 7"):
        run_loop("stage", module, params, DATA, stage, interrupted, Accelerator(cpu=True), tmp_path)
    module, params = toy(seed=5)  # a fresh process: its parameters start elsewhere and come from the checkpoint
    result = run_loop("stage", module, params, DATA, stage, toy_loss, Accelerator(cpu=True), tmp_path)
    assert result.resumed_from == 7 and result.steps == 10
    for name, value in params.items():
        torch.testing.assert_close(value.detach(), uninterrupted[name], rtol=0, atol=0)


def test_a_checkpoint_the_disk_cannot_hold_keeps_the_last_one_and_the_run_resumes(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    stage = Stage(tokens=10 * 2 * 6, batch_size=2, lr=0.05, checkpoint_every=3)
    module, params = toy()
    run_loop("stage", module, params, DATA, stage, toy_loss, Accelerator(cpu=True), None)
    uninterrupted = {k: v.detach().clone() for k, v in params.items()}

    writes = []

    def full_disk(tensors, filename, metadata=None):
        writes.append(filename)
        if len(writes) == 2:  # the checkpoint of step 6: half written when the disk fills
            Path(filename).write_bytes(b"\0" * 100)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(train_module, "save_file", full_disk)
    module, params = toy()
    with pytest.raises(OSError, match=r"No space left on device .*: free some space, then rerun the same command to resume from the last checkpoint$"):
        run_loop("stage", module, params, DATA, stage, toy_loss, Accelerator(cpu=True), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage.safetensors"]  # no partial file left
    assert Checkpoint(tmp_path, "stage").meta()["step"] == 3
    monkeypatch.setattr(train_module, "save_file", save_file)
    module, params = toy(seed=5)
    result = run_loop("stage", module, params, DATA, stage, toy_loss, Accelerator(cpu=True), tmp_path)
    assert result.resumed_from == 3 and result.steps == 10
    for name, value in params.items():
        torch.testing.assert_close(value.detach(), uninterrupted[name], rtol=0, atol=0)


def test_a_bf16_model_trains_fp32_masters_and_keeps_its_dtype(tiny_llama_dir, tiny_tokenizer, monkeypatch):
    _, student = tiny_student(tiny_llama_dir, dtype=torch.bfloat16)
    params = new_parameters(student)
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    dtypes = set()
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        dtypes.update(p.dtype for group in self.param_groups for p in group["params"])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    stage = dataclasses.replace(Recipe().transfer, tokens=64 * 2 * 3, seq_len=64, batch_size=2, lr=1e-2)
    result = attention_transfer(student, _stage_data(stage, tiny_tokenizer, seed=0), stage, Accelerator(cpu=True), None)
    assert dtypes == {torch.float32}  # AdamW stepped fp32 masters, not bf16 weights
    assert {p.dtype for p in new_parameters(student).values()} == {torch.bfloat16}
    assert all(loss == loss for _, loss in result.curve)


NAN_ON_ONE_RANK = textwrap.dedent(
    """
    import torch
    from accelerate import Accelerator
    from linearize.convert.recipes import Stage
    from linearize.convert.train import NonFiniteLoss, run_loop

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    rank = accelerator.process_index
    calls = []

    def step_loss(model, batch):
        calls.append(1)
        loss = model(batch.float()).pow(2).mean()
        return loss * float("nan") if rank == 1 and len(calls) == 3 else loss

    try:
        run_loop("stage", module, dict(module.named_parameters()), torch.ones(64, 4, dtype=torch.long),
                 Stage(tokens=10 * 2 * 4 * 2, batch_size=2, lr=0.01), step_loss, accelerator, None)
    except NonFiniteLoss as err:
        print(f"rank {rank} stopped: {err}", flush=True)
        raise SystemExit(3)
    """
)


FULL_DISK_ON_THE_MAIN_PROCESS = textwrap.dedent(
    """
    from pathlib import Path

    import torch
    from accelerate import Accelerator
    from safetensors import SafetensorError
    from linearize.convert import train
    from linearize.convert.recipes import Stage

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    rank = accelerator.process_index
    Path("work").mkdir(exist_ok=True)

    def full_disk(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    train.save_file = full_disk  # only the main process writes
    try:
        train.run_loop("stage", module, dict(module.named_parameters()), torch.ones(64, 4, dtype=torch.long),
                       Stage(tokens=10 * 2 * 4 * 2, batch_size=2, lr=0.01, checkpoint_every=2),
                       lambda model, batch: model(batch.float()).pow(2).mean(), accelerator, Path("work"))
    except OSError as err:
        print(f"rank {rank} stopped: {err}", flush=True)
        raise SystemExit(3)
    """
)


def launch_two(script_text: str, tmp_path, cli_env) -> tuple[int, str]:
    """(exit code, output) of `script_text` run as 2 CPU processes by accelerate."""
    from test_distributed import ACCELERATE, free_port

    script = tmp_path / "job.py"
    script.write_text(script_text)
    command = [sys.executable, "-m", "accelerate.commands.launch", *ACCELERATE, "--main_process_port", str(free_port()), str(script)]
    proc = subprocess.run(command, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path")
def test_a_full_disk_on_the_main_process_stops_every_process(tmp_path, cli_env):
    code, out = launch_two(FULL_DISK_ON_THE_MAIN_PROCESS, tmp_path, cli_env)
    assert code != 0
    assert "rank 0 stopped: cannot save checkpoint work/stage.safetensors (Error while serializing" in out, out[-3000:]
    assert "rank 1 stopped: stage: the main process could not save its checkpoint (see its error)" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path")
def test_a_nan_on_one_process_stops_every_process(tmp_path, cli_env):
    code, out = launch_two(NAN_ON_ONE_RANK, tmp_path, cli_env)
    assert code != 0
    for rank in (0, 1):  # neither waits in an all-reduce for the other
        assert f"rank {rank} stopped: stage: loss became" in out, out[-3000:]
    assert "rank 1 stopped: stage: loss became nan at step 2" in out
    assert "rank 0 stopped: stage: loss became non-finite on another process at step 2" in out
