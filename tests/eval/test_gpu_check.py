"""`python -m linearize.eval.gpu_check`: its `--quick` version (Triton's interpreter, CPU) runs end to end and passes.

The full check needs a CUDA device; here only its refusal without one is tested.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SECTIONS = {
    "setup", "passed", "failures", "compile", "fallback_launches", "correctness", "prefill", "decode", "conversion",
    "goals", "seconds", "files",
}  # fmt: skip
CHUNK_TENSORS = {"o", "ht", "dq", "dk", "dv", "dg", "dh0"}
DELTA_TENSORS = CHUNK_TENSORS | {"dbeta"}


def run_gpu_check(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "linearize.eval.gpu_check", *args],
        check=False,
        cwd=cwd,
        env={k: v for k, v in env.items() if k != "TRITON_INTERPRET"},  # --quick sets it itself
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_quick_check_passes_and_writes_its_report(tmp_path: Path, cli_env: dict[str, str]) -> None:
    out = tmp_path / "gpu_check"
    proc = run_gpu_check(["--quick", "--out", str(out)], tmp_path, cli_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASSED" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert SECTIONS <= set(report)
    assert report["passed"] and not report["failures"]
    assert report["setup"]["mode"] == "quick"
    assert report["fallback_launches"] == {}, "the interpreter refuses no launch for its shared memory"

    checks = report["correctness"]
    kernels = ("chunk", "chunk/normalizer", "recurrent", "recurrent/normalizer", "delta-chunk")
    assert {(c["kernel"], c["dtype"]) for c in checks} == {(k, d) for k in kernels for d in ("fp32", "bf16")}
    assert {c["gate"] for c in checks if c["kernel"] == "chunk"} == {"channel", "head"}
    assert all(c["passed"] and c["error"] is None for c in checks)
    assert all(set(c["errors"]) == CHUNK_TENSORS for c in checks if c["kernel"].startswith("chunk"))
    assert all(set(c["errors"]) == DELTA_TENSORS for c in checks if c["kernel"] == "delta-chunk")
    delta = {(c["seq_len"], c["key_dim"], c["gate"]) for c in checks if c["kernel"] == "delta-chunk"}
    assert delta == {(32, 16, "channel"), (32, 32, "channel"), (80, 32, "channel"), (32, 16, "head"), (32, 32, "head")}
    assert all(e < 1e-4 for c in checks if c["dtype"] == "fp32" for e in c["errors"].values())
    assert set(report["compile"]) == {"fp32", "bf16"}

    assert {r["method"] for r in report["prefill"]} == {"gla-chunk/triton", "sdpa-causal"}
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 for r in report["prefill"])
    assert {r["method"] for r in report["decode"]} == {"gla-recurrent/triton", "sdpa-kv-cache"}

    conversion = report["conversion"]
    assert conversion["finite"] and conversion["error"] is None
    assert set(conversion["stages"]) == {"transfer", "finetune"}
    assert all(stage["steps"] >= 1 for stage in conversion["stages"].values())

    goals = {g["goal"]: g for g in report["goals"]}
    assert set(goals) == {"vs fla", "vs sdpa", "bf16 dg"}
    assert goals["vs fla"]["status"].startswith("not measured") and goals["vs sdpa"]["status"].startswith("not measured")
    assert goals["bf16 dg"]["status"] in ("pass", "fail") and goals["bf16 dg"]["value"] is not None
    assert (out / "gpu_check.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_full_check_without_cuda_names_the_fix(tmp_path: Path, cli_env: dict[str, str]) -> None:
    proc = run_gpu_check(["--out", str(tmp_path)], tmp_path, cli_env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_check: error: no CUDA device: run on a CUDA machine, or pass --quick"
    assert not list(tmp_path.iterdir())


def test_a_run_cut_to_its_lease_reports_what_it_skipped(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """--skip leaves parts out and --check-budget stops starting cases: the report says so, and a run that
    checked nothing does not pass."""
    out = tmp_path / "gpu_check"
    proc = run_gpu_check(["--quick", "--skip", "prefill", "decode", "convert", "--check-budget", "0", "--out", str(out)], tmp_path, cli_env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["correctness"] == [] and report["skipped_checks"] > 0 and not report["passed"]
    assert report["prefill"] == [] and report["decode"] == [] and report["conversion"]["skipped"] == "--skip convert"
    assert report["setup"]["skipped_parts"] == ["prefill", "decode", "convert"] and not report["setup"]["autotune"]
    assert "cases skipped, the --check-budget spent" in proc.stdout


def test_skipping_delta_leaves_out_the_delta_rule_checks_only(tmp_path: Path, cli_env: dict[str, str]) -> None:
    out = tmp_path / "gpu_check"
    args = ["--quick", "--skip", "delta", "prefill", "decode", "convert", "--seq-lens", "32", "--key-dims", "16", "--out", str(out)]
    proc = run_gpu_check(args, tmp_path, cli_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kernels = {c["kernel"] for c in json.loads((out / "gpu_check.json").read_text())["correctness"]}
    assert kernels == {"chunk", "chunk/normalizer", "recurrent", "recurrent/normalizer"}


def test_fallback_launches_name_each_kernel_at_its_fewest_stages_and_narrowest_tile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from linearize.eval import gpu_check
    from linearize.kernels import delta_triton, gla_triton

    state, dv, scan = gla_triton._fwd_state_kernel, gla_triton._bwd_dv_kernel, delta_triton._delta_dstate_kernel
    refused = {
        (state, ("BV", 64), ("K", 64)): (2, {"BV": 64}),
        (state, ("BV", 64), ("K", 256)): (1, {"BV": 64}),
        (dv, ("BV", 128), ("V", 128)): (2, {"BV": 128}),
        (scan, ("BV", 64), ("K", 256)): (None, {"BV": 32}),
        (scan, ("BV", 128), ("K", 256)): (1, {"BV": 16}),
    }
    monkeypatch.setattr(gla_triton, "_fallbacks", refused)
    monkeypatch.setattr(delta_triton, "_chunk_lens", {(256, 64, torch.float32): 32})
    assert gpu_check.fallback_launches() == {
        "_bwd_dv_kernel": {"stages": 2},
        "_delta_dstate_kernel": {"stages": 1, "BV": 16},
        "_fwd_state_kernel": {"stages": 1},
        "chunk_delta_triton K=256 V=64 float32": {"BT": 32},
    }
