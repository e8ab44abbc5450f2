"""Speed/memory bench on a tiny random model: report files, cache accounting, memory meter, CLI errors.
No timing assertions: this machine is shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from linearize.eval.bench import (
    MiB,
    PeakMemory,
    bench_model,
    bench_models,
    cache_nbytes,
    decode_rounds,
    paired_bandwidth,
    parse_int_list,
    plot,
    ratio_rows,
    read_bandwidth,
    weight_bytes_per_step,
)
from linearize.eval.cli import bench_main
from conftest import tiny_fields

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8


def tiny_config(**extra) -> LlamaConfig:
    return LlamaConfig(**tiny_fields(num_hidden_layers=LAYERS, num_key_value_heads=KV_HEADS, **extra))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(tiny_config()).save_pretrained(path)
    return path


def kv_bytes(batch: int, tokens: int) -> int:
    return LAYERS * 2 * batch * KV_HEADS * tokens * HEAD_DIM * 4  # keys + values, fp32


def test_cache_nbytes_counts_kv_and_linear_states():
    cache = DynamicCache(config=tiny_config(layer_types=["linear_attention", "full_attention"]))
    linear, full = cache.layers
    linear.update_recurrent_state(torch.zeros(3, KV_HEADS, HEAD_DIM, HEAD_DIM))
    linear.update_conv_state(torch.zeros(3, 16, 4))
    full.update(torch.zeros(3, KV_HEADS, 10, HEAD_DIM), torch.zeros(3, KV_HEADS, 10, HEAD_DIM))
    expected = (3 * KV_HEADS * HEAD_DIM * HEAD_DIM + 3 * 16 * 4 + 2 * 3 * KV_HEADS * 10 * HEAD_DIM) * 4
    assert cache_nbytes(cache) == expected
    assert cache_nbytes(DynamicCache()) == 0


def test_bench_model_points_and_cache_size(model_dir):
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    points = bench_model(model, contexts=[16, 48], batch_sizes=[1, 3], decode_tokens=3, progress=False)
    assert [(p["context"], p["batch"]) for p in points] == [(16, 1), (16, 3), (48, 1), (48, 3)]
    for p in points:
        assert p["status"] == "ok"
        assert p["cache_bytes"] == kv_bytes(p["batch"], p["context"] + 2 + 3)  # 2 untimed steps, then 3 timed
        assert p["prefill_s"] > 0 and p["decode_tok_s"] > 0 and p["peak_mem_bytes"] >= 0
        assert p["step_bytes"] == weight_bytes_per_step(model, p["batch"]) + p["cache_bytes"]
        assert len(p["bandwidth_samples_bytes_s"]) == len(decode_rounds(3))  # one sample after each round
        assert p["bandwidth_bytes_s"] == pytest.approx(paired_bandwidth(decode_rounds(3), p["bandwidth_samples_bytes_s"]))
        assert p["bound_tok_s"] == pytest.approx(p["batch"] * p["bandwidth_bytes_s"] / p["step_bytes"])
        assert p["bound_fraction"] == pytest.approx(p["decode_tok_s"] / p["bound_tok_s"])
    rows = ratio_rows(points, points)
    assert all(r["cache_ratio"] == 1.0 and r["prefill_speedup"] == 1.0 for r in rows)
    assert ratio_rows(points, None)[0]["decode_speedup"] is None


def test_a_bound_spends_each_rounds_steps_at_the_bandwidth_sampled_after_it():
    # 2 steps at 10 GB/s and 1 at 40 take as long as 3 steps at 13.3: not the run's best figure (40).
    assert paired_bandwidth([2, 1], [10e9, 40e9]) == pytest.approx(3 / (2 / 10e9 + 1 / 40e9))
    assert paired_bandwidth([4, 4], [20e9, 20e9]) == pytest.approx(20e9)
    with pytest.raises(ValueError):  # a sample per round, no more, no fewer
        paired_bandwidth([1, 1], [20e9])


def test_models_benched_together_take_turns_round_by_round(model_dir):
    assert decode_rounds(0) == [] and decode_rounds(3) == [1, 1, 1] and decode_rounds(64) == [8] * 8
    assert decode_rounds(10) == [2, 2, 1, 1, 1, 1, 1, 1]
    models = {name: LlamaForCausalLM.from_pretrained(model_dir).eval() for name in ("student", "teacher")}
    calls = []
    for name, model in models.items():
        model.register_forward_pre_hook(lambda m, args, kwargs, name=name: calls.append((name, args[0].shape[1])), with_kwargs=True)
    points = bench_models(models, contexts=[20], batch_sizes=[2], decode_tokens=4, progress=False)
    timed = calls[calls.index(("student", 20)) :]  # after the warm-up and cache sizing
    first = [(name, n) for name in models for n in (20, 1, 1, 1)]  # prefill, 2 untimed steps, the first timed round
    assert timed == first + [("student", 1), ("teacher", 1)] * 3
    for name in models:
        (point,) = points[name]
        assert point["model"] == name and point["status"] == "ok"
        assert point["decode_tok_s"] == pytest.approx(2 * 4 / point["decode_s"])
        assert point["cache_bytes"] == kv_bytes(2, 26)


def test_scoring_rows_time_full_forwards_taking_turns(model_dir):
    from linearize.eval.bench import bench_scoring, scoring_rows

    models = {name: LlamaForCausalLM.from_pretrained(model_dir).eval() for name in ("student", "teacher")}
    calls = []
    for name, model in models.items():
        model.register_forward_pre_hook(lambda m, args, kwargs, name=name: calls.append((name, tuple(args[0].shape))), with_kwargs=True)
    points = bench_scoring(models, lengths=[12, 24], batch_sizes=[1, 3], repeats=2)
    # each point: one untimed and two timed forwards per model, the models alternating
    expected = [(name, (b, n)) for n in (12, 24) for b in (1, 3) for _ in range(3) for name in models]
    assert calls == expected
    for name in models:
        assert [(p["length"], p["batch"]) for p in points[name]] == [(12, 1), (12, 3), (24, 1), (24, 3)]
        assert all(p["tok_s"] == pytest.approx(p["batch"] * p["length"] / p["seconds"]) for p in points[name])
    rows = scoring_rows(points)
    assert [r["speed_ratio"] for r in rows] == pytest.approx(
        [s["tok_s"] / t["tok_s"] for s, t in zip(points["student"], points["teacher"], strict=True)]
    )
    assert scoring_rows({"student": points["student"]})[0]["speed_ratio"] is None


def test_bench_loads_the_teacher_beside_the_student_only_where_it_fits(model_dir, monkeypatch):
    import linearize.eval.bench as bench

    report = bench.run_bench(model_dir, teacher=str(model_dir), contexts=[16], batch_sizes=[1], decode_tokens=2, progress=False)
    assert report["schedule"] == "interleaved" and report["student_decoding"] == "eager"
    with pytest.raises(ValueError, match="convert it again, or bench without --compile"):  # a model with no compiled path
        bench.run_bench(model_dir, teacher=str(model_dir), contexts=[16], batch_sizes=[1], compile_student=True, progress=False)
    weights = weight_bytes_per_step(LlamaForCausalLM.from_pretrained(model_dir), 1)
    monkeypatch.setattr(bench, "_free_bytes", lambda device: int(1.5 * weights))  # the caches fit, a second model not
    report = bench.run_bench(model_dir, teacher=str(model_dir), contexts=[16], batch_sizes=[1], decode_tokens=2, progress=False)
    assert report["schedule"] == "sequential"
    assert [r["status"] for r in report["rows"]] == ["ok"] and report["rows"][0]["decode_speedup"] > 0


def test_weight_bytes_per_step_reads_the_input_embedding_only_for_its_rows(model_dir):
    model = LlamaForCausalLM.from_pretrained(model_dir)
    every = sum(t.numel() * 4 for t in [*model.parameters(), *model.buffers()])
    table = model.get_input_embeddings().weight
    untied = model.get_output_embeddings().weight.data_ptr() != table.data_ptr()
    skipped = (table.numel() - 3 * table.shape[1]) * 4 if untied else 0
    assert weight_bytes_per_step(model, 3) == every - skipped
    assert read_bandwidth(torch.device("cpu"), repeats=1) > 1e8  # any machine streams more than 100 MB/s


def test_peak_memory_sees_a_large_allocation():
    with PeakMemory(torch.device("cpu")) as mem:
        block = torch.ones(16 * 1024 * 1024)  # 64 MiB, touched
        del block
    assert mem.peak_bytes >= 60 * 1024 * 1024, mem.method


def test_the_plot_draws_each_models_bound_dashed_beside_its_decode_rate(tmp_path, monkeypatch):
    """The decode panel holds, per model and batch, the measured rate and (dashed, same colour) its
    bandwidth bound, where the point has one."""
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))

    def point(context: int, rate: float, bound: float | None) -> dict:
        return {"context": context, "batch": 1, "status": "ok", "prefill_tok_s": 100.0, "decode_tok_s": rate,
                "bound_tok_s": bound, "cache_bytes": MiB, "peak_mem_bytes": 2 * MiB}

    points = {"student": [point(16, 10.0, 40.0), point(32, 9.0, 38.0)], "teacher": [point(16, 8.0, 30.0), point(32, 5.0, None)]}
    plot(points, tmp_path / "bench.png")
    decode = figures[0].axes[1]
    solid = [line for line in decode.lines if line.get_linestyle() == "-"]
    dashed = [line for line in decode.lines if line.get_linestyle() == "--"]
    assert [list(line.get_ydata()) for line in solid] == [[10.0, 9.0], [8.0, 5.0]]
    assert [list(line.get_ydata()) for line in dashed] == [[40.0, 38.0], [30.0]]
    assert [line.get_color() for line in dashed] == [line.get_color() for line in solid]


def test_bench_cli_writes_json_and_png(model_dir, capsys):
    argv = [
        str(model_dir),
        "--teacher",
        str(model_dir),
        "--contexts",
        "16,32",
        "--batch-sizes",
        "1,2",
        "--decode-tokens",
        "2",
    ]
    assert bench_main(argv) == 0
    assert "speedup" in capsys.readouterr().out
    report = json.loads((model_dir / "bench.json").read_text())
    low, high = report["read_bandwidth_range_gb_s"]
    assert 0 < low <= high
    assert (model_dir / "bench.png").stat().st_size > 10_000
    assert report["teacher"] == str(model_dir) and len(report["rows"]) == 4
    assert set(report["points"]) == {"student", "teacher"}
    assert all(r["cache_ratio"] == 1.0 for r in report["rows"])
    assert report["schedule"] == "interleaved"
    assert [(r["length"], r["batch"]) for r in report["scoring"]] == [(128, 1), (128, 2), (512, 1), (512, 2)]
    assert all(r["speed_ratio"] > 0 for r in report["scoring"])
    assert "Batched prefill as lm-eval scores" in (model_dir / "README.md").read_text()
    argv = [str(model_dir), "--skip-teacher", "--contexts", "16", "--batch-sizes", "1", "--decode-tokens", "2", "--scoring-lengths", "none"]
    assert bench_main(argv) == 0
    report = json.loads((model_dir / "bench.json").read_text())
    assert report["scoring"] == []
    assert report["schedule"] == "one model" and set(report["points"]) == {"student"}
    assert report["rows"][0]["decode_speedup"] is None and report["rows"][0]["student_decode_tok_s"] > 0


def test_bench_cli_input_errors(model_dir, tmp_path, capsys):
    cases = [
        ([str(model_dir), "--contexts", "1k,4k"], "bad --contexts"),
        ([str(model_dir), "--batch-sizes", "0"], "bad --batch-sizes"),
        ([str(model_dir), "--scoring-lengths", "512,x"], "bad --scoring-lengths"),
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(model_dir)], "pass --teacher"),
    ]
    for argv, message in cases:
        assert bench_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("linearize bench: error: ") and message in err and err.count("\n") == 1
    assert parse_int_list("1024, 4096", "contexts") == [1024, 4096]


def test_compile_is_refused_only_for_model_code_without_compiled_decoding(tmp_path):
    """The export's code is several flat files: compiled decoding may live in any of them."""
    from linearize.eval.bench import _check_compilable

    (tmp_path / "modeling_linearize.py").write_text("class LinearizeForCausalLM: ...\n")
    with pytest.raises(ValueError, match="model code predates compiled decoding"):
        _check_compilable(tmp_path)
    (tmp_path / "decoding_linearize.py").write_text("class DecodingRuntime:\n    def compile_decoding(self): ...\n")
    _check_compilable(tmp_path)


def test_compile_decodes_a_teacher_that_is_a_linearize_export_compiled_too(tmp_path, monkeypatch, tiny_linearize):
    """Two exports benched against each other (before and after a code change) decode alike; a plain teacher as loaded."""
    import linearize.eval.bench as bench
    import linearize.eval.models as models

    compiled: list[str] = []

    def load(spec: str, **kwargs):
        if spec == "plain":
            return LlamaForCausalLM(tiny_config()).eval(), None, spec
        model = tiny_linearize(["linear_attention", "full_attention"])
        model.compile_decoding = lambda: compiled.append(spec)
        return model, None, spec

    monkeypatch.setattr(models, "load", load)
    student = tmp_path / "new"
    student.mkdir()
    (student / "config.json").write_text("{}")
    (student / "decoding_linearize.py").write_text("class DecodingRuntime:\n    def compile_decoding(self): ...\n")
    common = dict(contexts=[16], batch_sizes=[1], decode_tokens=2, progress=False, compile_student=True, scoring_lengths=[])
    report = bench.run_bench(student, teacher="old", **common)
    assert compiled == [str(student), "old"]
    assert (report["student_decoding"], report["teacher_decoding"]) == ("compiled", "compiled")
    compiled.clear()
    report = bench.run_bench(student, teacher="plain", **common)
    assert compiled == [str(student)]
    assert (report["student_decoding"], report["teacher_decoding"]) == ("compiled", "eager")
    report = bench.run_bench(student, teacher="plain", **{**common, "compile_student": False})
    assert (report["student_decoding"], report["teacher_decoding"]) == ("eager", "eager")
