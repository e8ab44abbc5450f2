"""`python -m linearize.kernels.compile_check`: every kernel launch compiled for real GPUs, here without one.

The suite compiles the `--quick` cases for one target, sm_86, whose 99 KB of shared memory per block
refuses some fp32 tiles at Triton's default 3 pipeline stages, so the library's retry at fewer stages
(`gla_triton._launch`) must carry every case. The other targets (sm_90, the GPU the speed goals are set
on, among them) compile with `python -m linearize.kernels.compile_check`; docs/gpu.md has that run. The narrower fallbacks (value tiles, the delta rule's chunk length) that the fp32 K = 256
cases need on sm_86 take minutes to compile; `test_kernels_triton.py` and `test_kernels_delta_triton.py` test
them with stand-ins, and docs/gpu.md reports the full run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = [sys.executable, "-m", "linearize.kernels.compile_check"]


def _start(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """Compiling needs the real kernels: without TRITON_INTERPRET (which the suite sets for the kernel tests)."""
    env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def test_every_launch_compiles_and_fits_sm_86(tmp_path: Path, cli_env: dict[str, str]) -> None:
    proc = _start([*CHECK, "--quick", "--targets", "sm_86", "--out", str(tmp_path)], tmp_path, cli_env)
    code, out = _finish(proc)
    assert code == 0, out[-4000:]
    assert "PASSED" in out
    report = json.loads((tmp_path / "compile_check.json").read_text())
    assert report["passed"] and not report["failures"]
    (row,) = report["targets"]
    assert row["target"] == "sm_86" and row["cases_passed"] == row["cases"] == 23
    kernels = report["kernels"]
    assert {c["target"] for c in kernels} == {"sm_86"}
    names = {c["kernel"] for c in kernels}
    for family in ("_fwd_state_kernel", "_bwd_inter_kernel", "_fused_recurrent_kernel", "_ut_bwd_kernel",
                   "_fused_recurrent_delta_kernel", "_hedgehog_bwd_kernel", "_performer_kernel"):  # fmt: skip
        assert family in names
    assert {c["constants"]["DT"] for c in kernels if c["kernel"] == "_fwd_output_kernel"} == {"fp32", "bf16"}
    assert all(c["registers"] > 0 and c["shared"] >= 0 for c in kernels)
    assert max(c["shared"] for c in kernels if c["fits"]) <= row["shared_limit"]
    refused = {(c["kernel"], c["case"]) for c in kernels if not c["fits"]}
    assert refused, "fp32 tiles at 3 stages exceed 99 KB: sm_86 must refuse some"
    assert all(c["stages"] == 3 and c["shared"] > 101376 for c in kernels if not c["fits"])
    retried = {(c["kernel"], c["case"]) for c in kernels if c["fits"] and c["stages"] < 3}
    assert refused <= retried, "each refused launch ran again fewer stages deep, and fit"


def test_autotune_compiles_every_config_the_tuner_would_time(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """`--autotune`: each tuned launch compiles all its pruned configs (both warp counts; the delta rule's state scans
    also 1 stage deep), and a case passes when one config of each launch fits."""
    case = "delta-chunk fp32 K=64 V=64 decay=head"
    command = [*CHECK, "--autotune", "--targets", "sm_86", "--only", case, "--out", str(tmp_path)]
    code, out = _finish(_start(command, tmp_path, cli_env))
    assert code == 0, out[-4000:]
    assert "every autotuned config" in out
    report = json.loads((tmp_path / "compile_check.json").read_text())
    assert report["autotune"] and report["passed"]
    configs: dict[str, set] = {}
    for c in report["kernels"]:
        configs.setdefault(c["kernel"], set()).add((c["warps"], c["stages"], c["constants"].get("BV")))
    for kernel in ("_ut_fwd_kernel", "_ut_bwd_kernel", "_dv_local_kernel"):
        assert {w for w, _, _ in configs[kernel]} == {4, 8}
        assert {bv for _, _, bv in configs[kernel]} == {32, 64}, "tiles up to the head dimension"
    for kernel in ("_delta_state_kernel", "_delta_dstate_kernel"):
        assert {s for _, s, _ in configs[kernel]} == {1, 2}


def test_bad_arguments_are_refused_in_one_line(tmp_path: Path, cli_env: dict[str, str]) -> None:
    code, out = _finish(_start([*CHECK, "--only", "no-such-kernel", "--out", str(tmp_path)], tmp_path, cli_env))
    assert code == 2 and "no case name contains 'no-such-kernel'" in out
    interpreted = dict(cli_env, TRITON_INTERPRET="1")
    proc = subprocess.run([*CHECK, "--quick"], cwd=tmp_path, env=interpreted, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "TRITON_INTERPRET is set" in proc.stderr
