"""Interrupt and resume: Ctrl-C saves and exits 130, the same command resumes; NaN losses stop cleanly."""

import json
import math
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from linearize.convert.recipes import Stage
from linearize.convert.train import Checkpoint, NonFiniteLoss, run_loop

STEP_TOKENS = 2 * 32  # --batch-size 2 x --seq-len 32
STEPS = 60


def command(model, *extra):
    return [
        sys.executable, "-m", "linearize", "--model", str(model), "--ratio", "3:1", "--output", "out",
        "--work-dir", "work", "--transfer-tokens", str(STEPS * STEP_TOKENS), "--finetune-tokens", "0",
        "--checkpoint-every", "1", "--seq-len", "32", "--batch-size", "2", "--heldout-tokens", "256",
        "--max-new-tokens", "0", *extra,
    ]  # fmt: skip


def test_ctrl_c_saves_and_the_same_command_resumes(tiny_llama_dir, tmp_path, cli_env, linearize_main, monkeypatch):
    checkpoint = tmp_path / "work" / "transfer.safetensors"
    proc = subprocess.Popen(
        command(tiny_llama_dir, "--quiet"),
        cwd=tmp_path,
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell that starts this test in the background may ignore SIGINT, and Python then keeps ignoring it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 240
        while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert checkpoint.exists(), "no checkpoint appeared"
        assert proc.poll() is None, "the run finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    saved = re.search(r"progress saved at step (\d+); rerun the same command to resume", stderr)
    assert saved, stderr
    assert "Traceback" not in stderr
    step = int(saved.group(1))
    assert 0 < step < STEPS
    assert not (tmp_path / "out").exists()
    assert Checkpoint(tmp_path / "work", "transfer").meta()["step"] == step
    assert json.loads((tmp_path / "work" / "run.json").read_text())["perplexity"]["teacher"] > 1

    # A different run must not take over (and discard) this work folder.
    monkeypatch.chdir(tmp_path)
    code, _, err = linearize_main(*command(tiny_llama_dir, "--quiet", "--no-measure")[3:], "--placement", "top")
    assert code == 2
    assert "holds a different run" in err and "--overwrite" in err and err.count("\n") == 1
    assert checkpoint.exists() and Checkpoint(tmp_path / "work", "transfer").meta()["step"] == step

    # The same command again: resumes where it stopped, finishes, exports, cleans up.
    done = subprocess.run(command(tiny_llama_dir), cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = re.search(r"transfer: resuming at step (\d+) of (\d+)", done.stderr)
    assert resumed, done.stderr[-3000:]
    assert int(resumed.group(1)) == step and int(resumed.group(2)) == STEPS
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    stage = report["stages"]["transfer"]
    assert stage["resumed_from"] == step > 0
    assert stage["steps"] == STEPS and stage["tokens"] == STEPS * STEP_TOKENS
    assert report["perplexity"]["teacher"] > 1 and "student" in report["perplexity"]
    assert not (tmp_path / "work").exists()  # the work folder is removed once the export is in place
    assert (tmp_path / "out" / "loss.png").is_file()


def test_overwrite_discards_a_different_run(tiny_llama_dir, tmp_path, linearize_main, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.json").write_text(json.dumps({"fingerprint": "someone-else"}))
    (work / "transfer.safetensors").write_bytes(b"old progress")
    args = ["--model", tiny_llama_dir, "--output", "out", "--work-dir", "work", "--quiet", "--no-measure",
            "--transfer-tokens", "0", "--finetune-tokens", "0", "--max-new-tokens", "0"]  # fmt: skip
    code, _, err = linearize_main(*args)
    assert code == 2 and "holds a different run" in err
    assert (work / "transfer.safetensors").read_bytes() == b"old progress"
    code, _, err = linearize_main(*args, "--overwrite")
    assert code == 0, err
    assert (tmp_path / "out" / "config.json").is_file() and not work.exists()


# ---- NaN / inf losses ------------------------------------------------------------------------------


def test_nan_loss_stops_with_the_last_checkpoint_restored(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    params = dict(module.named_parameters())
    data = torch.arange(20 * 8).view(20, 8)
    stage = Stage(tokens=10 * 2 * 8, batch_size=2, lr=0.05, checkpoint_every=2)
    snapshots = []  # parameters as each call finds them (= after the previous optimizer step)

    def step_loss(model, batch):
        snapshots.append({k: v.detach().clone() for k, v in params.items()})
        x = batch.float().view(-1, 4) / 100
        if len(snapshots) == 4:  # step 3: the parameters blow up and the loss with them
            with torch.no_grad():
                for p in params.values():
                    p.fill_(float("nan"))
            return model(x).pow(2).mean() * float("nan")
        return (model(x) - 1).pow(2).mean()

    with pytest.raises(NonFiniteLoss, match=r"^stage: loss became nan at step 3: lower its lr; the last good state is kept"):
        run_loop("stage", module, params, data, stage, step_loss, Accelerator(cpu=True), tmp_path)

    saved = load_file(str(tmp_path / "stage.safetensors"))
    assert Checkpoint(tmp_path, "stage").meta()["step"] == 2
    for name, p in params.items():
        assert torch.isfinite(p).all(), name
        assert torch.equal(p.detach(), saved[f"param.{name}"]), name  # the last checkpoint, in place
        assert torch.equal(p.detach(), snapshots[2][name]), name  # = the state after step 2
        assert not torch.equal(p.detach(), snapshots[3][name]), name  # not the later (step 3) state

    # A rerun resumes from that checkpoint and, with a finite loss, completes.
    def good_loss(model, batch):
        return (model(batch.float().view(-1, 4) / 100) - 1).pow(2).mean()

    result = run_loop("stage", module, params, data, stage, good_loss, Accelerator(cpu=True), tmp_path)
    assert result.resumed_from == 2 and result.steps == 10
    assert all(math.isfinite(loss) for _, loss in result.curve)


def test_inf_loss_without_work_dir_keeps_finite_parameters():
    module = torch.nn.Linear(2, 2)
    params = dict(module.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    stage = Stage(tokens=64, batch_size=1, lr=0.1)

    def step_loss(model, batch):
        return model(batch.float()[:, :2]).pow(2).sum() + float("inf")

    with pytest.raises(NonFiniteLoss, match="loss became inf at step 0"):
        run_loop("x", module, params, torch.ones(4, 4, dtype=torch.long), stage, step_loss, Accelerator(cpu=True), None)
    for name, p in params.items():
        assert torch.equal(p.detach(), before[name]), name  # no step was taken on the bad loss
