"""The PyTorch chunked and recurrent GLA forms against the parallel reference (fp32, forward and backward)."""

from __future__ import annotations

import json

import pytest
import torch

from linearize.eval.kernel_bench import kernel_bench_main
from linearize.kernels.gla_torch import MIN_LOG_DECAY, STEP_BMM_ROWS, gla_chunked, gla_parallel, gla_recurrent, step_bmm
from linearize.kernels.ops import gated_linear_attention

TOL = {"rtol": 1e-5, "atol": 1e-5}


def make_inputs(
    B: int, HQ: int, H: int, T: int, K: int, V: int, *, decay: str | None = "channel", state: bool = False,
    seed: int = 0, dtype: torch.dtype = torch.float32,
) -> dict:
    """Unit-scale inputs: keys/queries of norm ~1 so outputs and gradients are O(1) and tolerances mean something."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()

    g = None
    if decay:
        logits = torch.randn(B, H, T, K if decay == "channel" else 1, generator=gen) * 2 + 2
        g = torch.nn.functional.logsigmoid(logits).clamp(min=MIN_LOG_DECAY).to(dtype).requires_grad_()
    return {
        "q": randn(B, HQ, T, K, scale=K**-0.5),
        "k": randn(B, H, T, K, scale=K**-0.5),
        "v": randn(B, H, T, V),
        "g": g,
        "initial_state": randn(B, H, K, V, scale=0.5) if state else None,
    }


def outputs_and_grads(fn, inputs: dict, **kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward, then gradients of a random projection of (o, final state) w.r.t. every tensor input."""
    o, state = fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], initial_state=inputs["initial_state"], **kwargs)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    leaves = [x for x in inputs.values() if x is not None]
    return [o, state], list(torch.autograd.grad(loss, leaves))


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], **tol) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **(tol or TOL))


SHAPES = [
    # B, HQ, H, T, K, V
    (1, 2, 2, 1, 16, 16),
    (1, 2, 2, 37, 16, 16),
    (2, 2, 2, 64, 16, 8),
    (2, 4, 2, 100, 16, 16),
    (1, 6, 2, 131, 32, 24),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-HQ{}-H{}-T{}-K{}-V{}".format(*s))
@pytest.mark.parametrize("decay", ["channel", "head", None], ids=["g-channel", "g-head", "no-g"])
@pytest.mark.parametrize("state", [False, True], ids=["no-h0", "h0"])
def test_chunked_equals_parallel(shape: tuple, decay: str | None, state: bool) -> None:
    inputs = make_inputs(*shape, decay=decay, state=state)
    want = outputs_and_grads(gla_parallel, inputs, scale=0.7)
    for chunk_size in (16, 32, 64):
        got = outputs_and_grads(gla_chunked, inputs, scale=0.7, chunk_size=chunk_size)
        assert_all_close(got[0] + got[1], want[0] + want[1])


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "B{}-HQ{}-H{}-T{}-K{}-V{}".format(*s))
@pytest.mark.parametrize("decay", ["channel", "head", None], ids=["g-channel", "g-head", "no-g"])
def test_recurrent_equals_parallel(shape: tuple, decay: str | None) -> None:
    inputs = make_inputs(*shape, decay=decay, state=True)
    want = outputs_and_grads(gla_parallel, inputs, scale=0.7)
    got = outputs_and_grads(gla_recurrent, inputs, scale=0.7)
    assert_all_close(got[0] + got[1], want[0] + want[1])


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_normalized_dispatch_equals_parallel(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LINEARIZE_KERNELS", "torch")
    inputs = make_inputs(2, 4, 2, 45, 16, 16, state=False)
    with torch.no_grad():
        for name in ("q", "k"):
            inputs[name].copy_(torch.nn.functional.elu(inputs[name]) + 1.0)

    def run(q, k, v, g, initial_state, mode):
        return gated_linear_attention(q, k, v, g, scale=0.5, normalize=True, initial_state=initial_state, mode=mode)

    want = outputs_and_grads(run, inputs, mode="parallel")
    got = outputs_and_grads(run, inputs, mode=mode)
    assert want[0][1].shape[-1] == 17
    assert_all_close(got[0] + got[1], want[0] + want[1])


def test_prefill_then_decode_continues_the_sequence() -> None:
    inputs = make_inputs(1, 4, 2, 50, 16, 16, state=True)
    q, k, v, g, h0 = (inputs[n].detach() for n in ("q", "k", "v", "g", "initial_state"))
    o_all, h_all = gla_parallel(q, k, v, g, 0.5, h0)
    o_pre, h = gla_chunked(q[:, :, :47], k[:, :, :47], v[:, :, :47], g[:, :, :47], 0.5, h0, 32)
    outs = [o_pre]
    for t in range(47, 50):
        o_t, h = gla_recurrent(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], g[:, :, t : t + 1], 0.5, h)
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, dim=2), o_all, **TOL)
    torch.testing.assert_close(h, h_all, **TOL)


@pytest.mark.parametrize("log_decay", ["strong", "mixed"])
def test_long_sequence_is_stable(log_decay: str) -> None:
    """T=4096 with decays down to MIN_LOG_DECAY: no overflow in the chunked form, and it matches the recurrence."""
    B, H, T, K, V = 1, 2, 4096, 16, 16
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(B, H, T, K, generator=gen) * K**-0.5 for _ in range(2))
    v = torch.randn(B, H, T, V, generator=gen)
    if log_decay == "strong":
        g = torch.full((B, H, T, K), MIN_LOG_DECAY)
    else:
        g = torch.rand(B, H, T, K, generator=gen) * MIN_LOG_DECAY
        g[..., : K // 2] = torch.rand(B, H, T, K // 2, generator=gen) * -1e-3
    o_chunk, h_chunk = gla_chunked(q, k, v, g, 1.0, None, 64)
    o_rec, h_rec = gla_recurrent(q, k, v, g, 1.0, None)
    assert torch.isfinite(o_chunk).all() and torch.isfinite(h_chunk).all()
    torch.testing.assert_close(o_chunk, o_rec, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h_chunk, h_rec, rtol=1e-4, atol=1e-4)


def test_half_precision_accumulates_in_fp32() -> None:
    inputs = make_inputs(1, 2, 1, 40, 16, 16, state=True, dtype=torch.bfloat16)
    args = [inputs[n].detach() for n in ("q", "k", "v", "g")]
    h0 = inputs["initial_state"].detach().float()
    o, h = gla_chunked(*args, 1.0, h0, 16)
    o_ref, h_ref = gla_parallel(*(x.double() for x in args), 1.0, h0.double())
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.double(), h_ref, rtol=1e-4, atol=1e-4)


def test_invalid_backend_name_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LINEARIZE_KERNELS", "cuda")
    inputs = make_inputs(1, 1, 1, 4, 16, 16)
    with pytest.raises(ValueError, match="LINEARIZE_KERNELS"):
        gated_linear_attention(inputs["q"], inputs["k"], inputs["v"], inputs["g"])


def test_kernel_bench_writes_its_report(tmp_path) -> None:
    argv = ["--device", "cpu", "--seq-lens", "64", "128", "--decode-contexts", "64", "--repeats", "1", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert kernel_bench_main([*argv, "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert {r["method"] for r in report["prefill"]} == {"gla-chunk/torch", "sdpa-causal"}
    assert all(r["forward_backward_ms"] > 0 for r in report["prefill"]) and len(report["decode"]) == 2
    assert (tmp_path / "kernel_bench.png").stat().st_size > 0


@pytest.mark.parametrize("rows", [3, STEP_BMM_ROWS + 1], ids=["fused", "library"])
def test_step_bmm_equals_the_library_product_eager_and_compiled(rows):
    """Compiled on CPU with few rows it is a multiply-and-sum; with more, and eagerly, torch's own product."""
    torch.manual_seed(0)
    a, b, add = torch.randn(4, rows, 8), torch.randn(4, 8, 5).transpose(1, 2).contiguous().transpose(1, 2), torch.randn(4, 1, 5)
    want = (torch.bmm(a, b), torch.baddbmm(add, a, b))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, add: (step_bmm(a, b), step_bmm(a, b, add=add)), fullgraph=True)
    for got in ((step_bmm(a, b), step_bmm(a, b, add=add)), compiled(a, b, add)):
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
