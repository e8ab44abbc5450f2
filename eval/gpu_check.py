"""One prepared check of the Triton GLA kernels on a GPU: correctness, speed, and a few real conversion steps.

1. correctness: `chunk_gla_triton` (o, final state, dq, dk, dv, dg, dh0), `fused_recurrent_gla_triton`
   (one decoding step) and the delta rule's `chunk_delta_triton` (o, final state, dq, dk, dv, dbeta,
   dg, dh0) in fp32 and bf16 against an fp64 reference on the same device, as relative errors
   norm(diff) / norm(ref); the first call of each dtype also compiles (and, with --autotune, tunes);
2. speed: the chunked kernel's forward and forward + backward against causal SDPA (flash on CUDA) and
   fla's `chunk_gla` when importable, and the decoding step against SDPA over a KV cache of T tokens;
3. conversion: `linearize.convert.pipeline.convert` on the embedded model in bf16 with tiny budgets
   (stage 1 attention transfer, stage 2 LoRA), timed, its losses required finite;
4. goals: fwd + bwd <= 1.0x fla's at T >= 4K, >= 2x faster than SDPA at 16K, bf16 dg error <= 1e-2.

`--quick` is the same on CPU in seconds: Triton's interpreter, tiny shapes, one-repeat timings and a
random 4-layer Llama. The exit code is 1 when a correctness check or the conversion fails (the goals
are reported, not enforced), 2 without a CUDA device unless `--quick`. A lease is short, so a run can
be cut to it: `--skip` parts, `--check-budget` seconds for the checks, `--autotune` (LINEARIZE_AUTOTUNE=1,
every config compiled and timed); the report is rewritten after every part, so a run stopped at its limit keeps what it measured.

Kernel modules are imported inside the functions that call them: Triton picks its interpreter when a
kernel is decorated, so `--quick` must set TRITON_INTERPRET before the first import.

    python -m linearize.eval.gpu_check [--quick] [--out DIR] [--skip PART ...] [--check-budget S] [--autotune]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..kernels.delta_torch import delta_chunked, delta_recurrent
from ..kernels.gla_torch import MIN_LOG_DECAY, gla_chunked, gla_parallel, gla_recurrent

if TYPE_CHECKING:
    from .kernel_bench import DecodeRow, PrefillRow

logger = logging.getLogger(__name__)

NO_CUDA = "no CUDA device: run on a CUDA machine, or pass --quick"
CHECK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A correctness check passes below these relative errors: fp32 kernels run fp32-accurate matmuls (tf32x3); bf16
# ones round their matmul operands and outputs to bf16 (a wrong kernel is off by O(1) either way).
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
PARALLEL_MAX_T = 256  # the fp64 reference is the quadratic form up to here, the chunked form beyond
RECURRENT_MAX_T = 256  # the delta rule's fp64 reference: step by step up to here, the chunked form beyond
DG_GOAL = 1e-2
FLA_GOAL_MIN_T, FLA_GOAL_RATIO = 4096, 1.0
SDPA_GOAL_T, SDPA_GOAL_SPEEDUP = 16384, 2.0
OURS, SDPA, FLA = "gla-chunk/triton", "sdpa-causal", "fla-chunk_gla"
EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
PARTS = ("checks", "delta", "prefill", "decode", "convert")  # delta: the delta rule's checks


@dataclass(frozen=True)
class Plan:
    """What one mode runs: check shapes, timing shapes and repeats, conversion budgets."""

    seq_lens: tuple[int, ...]
    key_dims: tuple[int, ...]
    value_dims: tuple[int, ...]
    check_heads: tuple[int, int, int]  # B, query heads, key/value heads (GQA in the checks)
    time_heads: tuple[int, int, int]  # the same work for every method: fla has no GQA
    time_dtype: str
    warmup: int
    repeats: int
    decode_repeats: int
    convert: dict[str, Any] = field(default_factory=dict)  # recipe overrides


FULL = Plan(
    seq_lens=(2048, 4096, 8192, 16384),
    key_dims=(64, 128, 256),
    value_dims=(64, 128),
    check_heads=(1, 4, 2),
    time_heads=(2, 8, 8),
    time_dtype="bf16",
    warmup=2,
    repeats=10,
    decode_repeats=50,
    convert={"dtype": "bfloat16", "transfer.tokens": 8192, "finetune.tokens": 8192},
)
QUICK = Plan(
    seq_lens=(32, 80),
    key_dims=(16, 32),
    value_dims=(16,),
    check_heads=(1, 2, 1),
    time_heads=(1, 2, 2),
    time_dtype="fp32",
    warmup=0,
    repeats=1,
    decode_repeats=1,
    convert={
        "dtype": "float32",
        "transfer.tokens": 256,
        "transfer.seq_len": 64,
        "transfer.batch_size": 2,
        "finetune.tokens": 256,
        "finetune.seq_len": 64,
        "finetune.batch_size": 2,
    },
)


@dataclass
class CheckRow:
    kernel: str  # "chunk" | "recurrent" (GLA, also "/normalizer") | "delta-chunk"
    dtype: str
    seq_len: int
    key_dim: int
    value_dim: int
    gate: str  # "channel" ([B, H, T, K]) | "head" ([B, H, T, 1])
    errors: dict[str, float]  # relative error per tensor
    tolerance: float
    passed: bool
    seconds: float  # the kernel call(s) alone; a dtype's first row includes compiling
    error: str | None = None


def make_inputs(
    heads: tuple[int, int, int], T: int, K: int, V: int, gate: str, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """Realistic fp32 inputs holding bf16-representable values: every dtype sees the same numbers, so
    one fp64 reference serves them all. Also the output/state cotangents `do`, `dht`."""
    B, HQ, H = heads
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).bfloat16().float().to(device)

    g = F.logsigmoid(torch.randn(B, H, T, K if gate == "channel" else 1, generator=gen) + 4.0).clamp(min=MIN_LOG_DECAY)
    return {
        "q": randn(B, HQ, T, K, scale=K**-0.5),
        "k": randn(B, H, T, K, scale=K**-0.5),
        "v": randn(B, H, T, V),
        "g": g.bfloat16().float().to(device),
        "h0": randn(B, H, K, V, scale=0.5),
        "do": randn(B, HQ, T, V),
        "dht": randn(B, H, K, V),
    }


def make_delta_inputs(
    heads: tuple[int, int, int], T: int, K: int, V: int, gate: str, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """`make_inputs` for the delta rule: L2-normalized q and k and beta in (0, 1), all bf16-representable as there."""
    x = make_inputs(heads, T, K, V, gate, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B, _, H = heads
    x["q"], x["k"] = (F.normalize(x[n], dim=-1).bfloat16().float() for n in ("q", "k"))
    x["beta"] = torch.rand(B, H, T, generator=gen).bfloat16().float().to(device)
    return x


def _outputs_and_grads(
    fn: Callable,
    x: dict[str, torch.Tensor],
    dtype: torch.dtype,
    scale: float,
    inputs: tuple[str, ...] = ("q", "k", "v", "g"),
) -> dict[str, torch.Tensor]:
    """o, final state and the gradients of <o, do> + <ht, dht> for `inputs` (in `dtype`) and h0 (fp32 or fp64),
    from fn(*inputs, scale, h0)."""
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {n: x[n].to(dtype).requires_grad_() for n in inputs}
    leaves["h0"] = x["h0"].to(state_dtype).requires_grad_()
    o, ht = fn(*(leaves[n] for n in inputs), scale, leaves["h0"])
    grads = torch.autograd.grad((o, ht), list(leaves.values()), (x["do"].to(o.dtype), x["dht"].to(ht.dtype)))
    return {"o": o, "ht": ht, **{f"d{name}": grad for name, grad in zip(leaves, grads)}}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """norm(got - want) / norm(want), in fp64."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm()).item()


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn() and its wall time in seconds, the device synchronized around it."""
    from .kernel_bench import sync

    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - started


def _row(
    kernel: str, dtype: str, T: int, K: int, V: int, gate: str, run: Callable[[], tuple[dict[str, float], float]]
) -> CheckRow:
    """Run one check: run() -> (relative errors, kernel seconds). An exception (a kernel that does not
    compile, say) is a failed row, not a lost report."""
    started = time.perf_counter()
    try:
        errors, seconds = run()
    except Exception as err:  # recorded in the report and the exit code
        logger.exception("%s %s T=%d K=%d V=%d %s gate failed", kernel, dtype, T, K, V, gate)
        return CheckRow(kernel, dtype, T, K, V, gate, {}, TOLERANCE[dtype], False, time.perf_counter() - started, str(err))
    passed = all(math.isfinite(e) and e < TOLERANCE[dtype] for e in errors.values())
    if not passed:
        logger.warning("%s %s T=%d K=%d V=%d %s gate: errors %s above %g", kernel, dtype, T, K, V, gate, errors, TOLERANCE[dtype])
    return CheckRow(kernel, dtype, T, K, V, gate, errors, TOLERANCE[dtype], passed, seconds)


def _with_normalizer_column(fn: Callable) -> Callable:
    """fn on v's first V - 1 columns plus a column of ones: the normalizer as the PyTorch forms compute it."""
    from ..kernels.ops import with_normalizer  # imports the Triton kernels: only once --quick has chosen the interpreter

    def run(q, k, v, g, scale, h0):
        return fn(q, k, with_normalizer(v[..., :-1]), g, scale, h0)

    return run


def check_chunk(
    plan: Plan, T: int, K: int, V: int, gate: str, device: torch.device, normalizer: bool = False
) -> list[CheckRow]:
    """The chunked kernel, forward and backward, in every check dtype against one fp64 reference.

    With `normalizer` the kernel carries its [K] normalizer for V - 1 value columns, against the
    reference run on a column of ones: outputs, states and cotangents keep V columns either way.
    """
    from ..kernels.gla_triton import chunk_gla_triton

    x = make_inputs(plan.check_heads, T, K, V, gate, device, seed=T * 1000 + K + V)
    scale = K**-0.5
    reference_fn = gla_parallel if T <= PARALLEL_MAX_T else gla_chunked
    kernel, kernel_fn = "chunk", chunk_gla_triton
    if normalizer:
        kernel, reference_fn = "chunk/normalizer", _with_normalizer_column(reference_fn)

        def kernel_fn(q, k, v, g, scale, h0):
            return chunk_gla_triton(q, k, v[..., :-1], g, scale, h0, normalizer=True)
    # Computed once, on the first row's call: a reference that fails (out of memory, say) fails its rows.
    reference = cache(partial(_outputs_and_grads, reference_fn, x, torch.float64, scale))

    def run(dtype: torch.dtype) -> tuple[dict[str, float], float]:
        want = reference()
        got, seconds = _timed(device, partial(_outputs_and_grads, kernel_fn, x, dtype, scale))
        return {n: relative_error(got[n], want[n]) for n in want}, seconds

    return [_row(kernel, name, T, K, V, gate, partial(run, dtype)) for name, dtype in CHECK_DTYPES.items()]


def check_delta_chunk(plan: Plan, T: int, K: int, V: int, gate: str, device: torch.device) -> list[CheckRow]:
    """The delta rule's chunked kernel, forward and backward, in every check dtype against one fp64 reference
    (the step-by-step recurrence for short T, the PyTorch chunked form beyond)."""
    from ..kernels.delta_triton import chunk_delta_triton

    x = make_delta_inputs(plan.check_heads, T, K, V, gate, device, seed=T * 1000 + K + V + 7)
    scale = K**-0.5
    reference_fn = delta_recurrent if T <= RECURRENT_MAX_T else delta_chunked
    names = ("q", "k", "v", "beta", "g")
    reference = cache(partial(_outputs_and_grads, reference_fn, x, torch.float64, scale, names))

    def run(dtype: torch.dtype) -> tuple[dict[str, float], float]:
        want = reference()
        got, seconds = _timed(device, partial(_outputs_and_grads, chunk_delta_triton, x, dtype, scale, names))
        return {n: relative_error(got[n], want[n]) for n in want}, seconds

    return [_row("delta-chunk", name, T, K, V, gate, partial(run, dtype)) for name, dtype in CHECK_DTYPES.items()]


@torch.no_grad()
def check_decode(plan: Plan, K: int, V: int, device: torch.device, normalizer: bool = False) -> list[CheckRow]:
    """One fused decoding step from a state, in every check dtype, against the fp64 recurrence
    (with `normalizer`: the [K] normalizer for V - 1 value columns, as in `check_chunk`)."""
    from ..kernels.gla_triton import fused_recurrent_gla_triton

    x = make_inputs(plan.check_heads, 1, K, V, "channel", device, seed=K + V)
    scale = K**-0.5
    q, k, v, g = (x[n].double() for n in ("q", "k", "v", "g"))
    reference = _with_normalizer_column(gla_recurrent) if normalizer else gla_recurrent
    want = dict(zip(("o", "ht"), reference(q, k, v, g, scale, x["h0"].double())))
    kernel = "recurrent/normalizer" if normalizer else "recurrent"

    def run(dtype: torch.dtype) -> tuple[dict[str, float], float]:
        q, k, v, g = (x[n].to(dtype) for n in ("q", "k", "v", "g"))
        if normalizer:
            v = v[..., :-1]
        step = partial(fused_recurrent_gla_triton, q, k, v, g, scale, x["h0"].clone(), normalizer=normalizer)
        got, seconds = _timed(device, step)
        return {"o": relative_error(got[0], want["o"]), "ht": relative_error(got[1], want["ht"])}, seconds

    return [_row(kernel, name, 1, K, V, "channel", partial(run, dtype)) for name, dtype in CHECK_DTYPES.items()]


def run_checks(
    plan: Plan, device: torch.device, budget: float | None = None, delta: bool = True
) -> tuple[list[CheckRow], int]:
    """Every shape of the plan with per-channel gates, per-head gates at the shortest T, and the decoding step;
    with `delta`, the delta rule's chunked kernel at every K and V at the shortest T (per-channel and per-head
    decay) and per channel at the widest K, V at every other T.

    With a `budget` in seconds no case starts once it is spent: returns the rows run and how many cases were
    skipped. Every kernel runs at the shortest T before any longer T, so a short budget loses length, not kernels."""
    shortest = min(plan.seq_lens)
    cases = [(T, K, V, "channel", False) for T in plan.seq_lens for K in plan.key_dims for V in plan.value_dims]
    cases += [(shortest, K, V, gate, normalizer) for K in plan.key_dims for V in plan.value_dims for gate, normalizer in (("head", False), ("channel", True))]
    delta_cases = [(shortest, K, V, gate) for K in plan.key_dims for V in plan.value_dims for gate in ("channel", "head")]
    delta_cases += [(T, max(plan.key_dims), max(plan.value_dims), "channel") for T in plan.seq_lens if T != shortest]
    delta_cases = delta_cases if delta else []
    # (longer than the shortest T, job), sorted so that every kernel runs at the shortest T before any longer T
    jobs = [(False, partial(check_decode, plan, K, V, device, normalizer)) for K in plan.key_dims for V in plan.value_dims for normalizer in (False, True)]
    jobs += [(T != shortest, partial(check_chunk, plan, T, K, V, gate, device, normalizer)) for T, K, V, gate, normalizer in cases]
    jobs += [(T != shortest, partial(check_delta_chunk, plan, T, K, V, gate, device)) for T, K, V, gate in delta_cases]
    jobs.sort(key=lambda job: job[0])
    rows: list[CheckRow] = []
    started, skipped = time.perf_counter(), 0
    for _, job in tqdm(jobs, desc="checks", disable=bool(os.environ.get("LINEARIZE_NO_PROGRESS"))):
        if budget is not None and time.perf_counter() - started > budget:
            skipped += 1
            continue
        rows.extend(job())
    if skipped:
        logger.warning("checks: %d of %d cases skipped, the %.0f s budget spent", skipped, len(jobs), budget)
    return rows, skipped


def compile_times(rows: list[CheckRow]) -> dict[str, dict[str, float | bool]]:
    """Per dtype and kernel: seconds of the first call (compiling, and autotuning on CUDA) and whether every call ran."""
    out: dict[str, dict[str, float | bool]] = {}
    for row in rows:
        entry = out.setdefault(row.dtype, {})
        entry.setdefault(f"{row.kernel}_first_call_s", row.seconds)
        entry[f"{row.kernel}_ran"] = entry.get(f"{row.kernel}_ran", True) and row.error is None
    return out


def fallback_launches() -> dict[str, dict[str, int]]:
    """What this GPU's shared memory forced below the default launches (`gla_triton._launch`,
    `delta_triton._fitting_chunks`): per kernel the fewest pipeline stages and, where narrowed, the narrowest
    value tile it ran at; per delta-rule shape the chunk length. Those launches may run slower than the
    default's timings suggest."""
    from ..kernels import delta_triton, gla_triton

    out: dict[str, dict[str, int]] = {}
    for (kernel, *default), (depth, fit) in gla_triton._fallbacks.items():
        seen = out.setdefault(kernel.__name__, {"stages": depth or 3})
        seen["stages"] = min(seen["stages"], depth or 3)
        if fit.get("BV", 0) < dict(default).get("BV", 0):
            seen["BV"] = min(fit["BV"], seen.get("BV", fit["BV"]))
    for (K, V, dtype), BT in delta_triton._chunk_lens.items():
        out[f"chunk_delta_triton K={K} V={V} {str(dtype).removeprefix('torch.')}"] = {"BT": BT}
    return dict(sorted(out.items()))


def worst_errors(rows: list[CheckRow]) -> dict[str, dict[str, dict[str, float]]]:
    """kernel -> dtype -> tensor -> the largest relative error over the shapes (NaN counts as the largest)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        worst = out.setdefault(row.kernel, {}).setdefault(row.dtype, {})
        for tensor, error in row.errors.items():
            worst[tensor] = max(worst.get(tensor, error), error, key=lambda e: math.inf if math.isnan(e) else e)
    return out


def _triton_chunk(x: dict, D: int) -> torch.Tensor:
    from ..kernels.gla_triton import chunk_gla_triton

    return chunk_gla_triton(x["q"], x["k"], x["v"], x["g"], D**-0.5)[0]


def time_prefill(plan: Plan, device: torch.device) -> list[PrefillRow]:
    """Forward and forward + backward at K = V = D for each D of the plan's value dims, on every method."""
    from .kernel_bench import _add_fla_layout, _fla_runner, _sdpa, prefill_rows

    methods = {OURS: (_triton_chunk, ("q", "k", "v", "g")), SDPA: (_sdpa, ("q", "k", "v"))}
    fla = _fla_runner() if device.type == "cuda" else None
    if fla is not None:
        methods[FLA] = (fla, ("fla_q", "fla_k", "fla_v", "fla_g"))
    dtype = CHECK_DTYPES[plan.time_dtype]
    rows = []
    for D in plan.value_dims:
        for T in tqdm(plan.seq_lens, desc=f"prefill D={D}", disable=bool(os.environ.get("LINEARIZE_NO_PROGRESS"))):
            x = {n: t.to(dtype) for n, t in make_inputs(plan.time_heads, T, D, D, "channel", device, seed=T).items()}
            if fla is not None:
                _add_fla_layout(x)
            rows.extend(prefill_rows(methods, x, T, D, device, plan.warmup, plan.repeats))
            del x
    return rows


@torch.no_grad()
def time_decode(plan: Plan, device: torch.device) -> list[DecodeRow]:
    """One new token: the fused step on a [K, V] state per head against one query over a KV cache of T tokens."""
    from .kernel_bench import DecodeRow, time_calls
    from ..kernels.gla_triton import fused_recurrent_gla_triton

    D = max(plan.value_dims)
    B, _, H = plan.time_heads
    dtype = CHECK_DTYPES[plan.time_dtype]
    rows = []
    for T in plan.seq_lens:
        x = {n: t.to(dtype) for n, t in make_inputs(plan.time_heads, T + 1, D, D, "channel", device, seed=T).items()}
        new = {n: x[n][:, :, T:].contiguous() for n in ("q", "k", "v", "g")}
        state = x["h0"].float()  # updated in place by every step, as a decoding cache is
        steps = {
            "gla": partial(fused_recurrent_gla_triton, new["q"], new["k"], new["v"], new["g"], D**-0.5, state),
            "sdpa": partial(F.scaled_dot_product_attention, new["q"], x["k"], x["v"], enable_gqa=True),
        }
        ms = time_calls(steps, device, plan.warmup, plan.decode_repeats, interleave=False)
        rows.append(DecodeRow(T, "gla-recurrent/triton", ms["gla"], state.numel() * state.element_size()))
        rows.append(DecodeRow(T, "sdpa-kv-cache", ms["sdpa"], 2 * B * H * (T + 1) * D * dtype.itemsize))
    return rows


def _tiny_teacher() -> tuple[torch.nn.Module, Any]:
    """A random 4-layer Llama (hidden 64) and a byte-level tokenizer that needs no files: both stages run in seconds on CPU."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = ByT5Tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tokenizer


def run_conversion(plan: Plan, quick: bool, device: torch.device) -> dict[str, Any]:
    """The real conversion entry, `convert`, with tiny budgets into a temporary folder: timed, losses finite.

    The embedded SmolLM2-135M with its shipped recipe on CUDA (bf16, the Triton kernels in the model);
    with `quick`, a random tiny Llama on CPU (the model's PyTorch kernels).
    """
    from ..convert.pipeline import apply_overrides, convert, default_recipe
    from ..convert.recipes import Recipe
    from ..kernels.ops import kernel_backend

    if quick:
        teacher, tokenizer = _tiny_teacher()
        model = "random tiny Llama (hidden 64, 4 layers)"
        recipe = apply_overrides(Recipe(name="gpu-check-quick"), plan.convert)
    else:
        teacher, tokenizer, model = EMBEDDED_MODEL, None, EMBEDDED_MODEL
        recipe = apply_overrides(default_recipe(EMBEDDED_MODEL), plan.convert)
    result: dict[str, Any] = {"model": model, "recipe": recipe.name, "dtype": recipe.dtype, "kernels": kernel_backend(device)}
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            _, report = convert(teacher, tokenizer, recipe=recipe, output=Path(tmp) / "student", measure=False)
    except Exception as err:  # a failed conversion (NonFiniteLoss included) is a finding to report
        logger.exception("conversion failed")
        return result | {"seconds": time.perf_counter() - started, "finite": False, "passed": False, "error": str(err)}
    stages = {
        name: {k: stage[k] for k in ("tokens", "steps", "seconds", "final_loss")} for name, stage in report.stages.items()
    }
    finite = bool(stages) and all(s["final_loss"] is not None and math.isfinite(s["final_loss"]) for s in stages.values())
    tokens, train_seconds = (sum(s[k] for s in stages.values()) for k in ("tokens", "seconds"))
    return result | {
        "seconds": time.perf_counter() - started,
        "stages": stages,
        "train_tokens_per_s": tokens / max(train_seconds, 1e-9),
        "finite": finite,
        "passed": finite,
        "error": None,
    }


def _goal(name: str, target: str, status: str, value: float | None = None, detail: Any = None) -> dict[str, Any]:
    return {"goal": name, "target": target, "status": status, "value": value, "detail": detail}


def evaluate_goals(checks: list[CheckRow], prefill: list[PrefillRow], quick: bool, fla_available: bool) -> list[dict[str, Any]]:
    """The three targets; a timing goal is `not measured: why` where this run cannot say."""
    by_key = {(r.seq_len, r.head_dim, r.method): r for r in prefill}
    interpreter = "not measured: --quick times the Triton interpreter on CPU"
    goals = []

    target = f"forward + backward <= {FLA_GOAL_RATIO}x fla chunk_gla at T >= {FLA_GOAL_MIN_T}"
    ratios = {
        f"T={T},D={D}": by_key[T, D, OURS].forward_backward_ms / by_key[T, D, FLA].forward_backward_ms
        for T, D, method in by_key
        if method == FLA and T >= FLA_GOAL_MIN_T
    }
    if quick:
        goals.append(_goal("vs fla", target, interpreter))
    elif not fla_available:
        goals.append(_goal("vs fla", target, "not measured: fla not installed"))
    elif not ratios:
        goals.append(_goal("vs fla", target, f"not measured: no T >= {FLA_GOAL_MIN_T} timed"))
    else:
        worst = max(ratios.values())
        goals.append(_goal("vs fla", target, "pass" if worst <= FLA_GOAL_RATIO else "fail", worst, ratios))

    target = f">= {SDPA_GOAL_SPEEDUP}x faster than SDPA (forward and forward + backward) at T = {SDPA_GOAL_T}"
    speedups = {}
    for T, D, method in by_key:
        if method == SDPA and T == SDPA_GOAL_T:
            ours, sdpa = by_key[T, D, OURS], by_key[T, D, SDPA]
            speedups[f"forward,D={D}"] = sdpa.forward_ms / ours.forward_ms
            speedups[f"forward_backward,D={D}"] = sdpa.forward_backward_ms / ours.forward_backward_ms
    if quick:
        goals.append(_goal("vs sdpa", target, interpreter))
    elif not speedups:
        goals.append(_goal("vs sdpa", target, f"not measured: T = {SDPA_GOAL_T} not timed"))
    else:
        worst = min(speedups.values())
        goals.append(_goal("vs sdpa", target, "pass" if worst >= SDPA_GOAL_SPEEDUP else "fail", worst, speedups))

    target = f"bf16 relative error of dg <= {DG_GOAL:g} (chunked kernel, every shape)"
    dg = [r.errors["dg"] for r in checks if r.kernel == "chunk" and r.dtype == "bf16" and "dg" in r.errors]
    if not dg:
        goals.append(_goal("bf16 dg", target, "not measured: no bf16 chunk check ran"))
    else:
        worst = max(dg)
        detail = "interpreter: bf16 tiles multiply in fp32" if quick else None
        goals.append(_goal("bf16 dg", target, "pass" if worst <= DG_GOAL else "fail", worst, detail))
    return goals


def plot(
    worst: dict[str, dict[str, dict[str, float]]], prefill: list[PrefillRow], decode: list[DecodeRow], path: Path, title: str
) -> None:
    """Time against T per method (forward, forward + backward, decode) and the worst relative error per tensor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .kernel_bench import plot_timings

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    plot_timings(axes, prefill, decode)
    ax = axes[3]
    chunk = worst.get("chunk", {})
    tensors = list(dict.fromkeys(t for errors in chunk.values() for t in errors))
    width = 0.8 / len(CHECK_DTYPES)
    for i, name in enumerate(CHECK_DTYPES):
        heights = [max(chunk.get(name, {}).get(t, 0.0), 1e-12) for t in tensors]  # an exact 0 would vanish on a log axis
        ax.bar([j + i * width for j in range(len(tensors))], heights, width, label=f"{name} (max)")
        ax.axhline(TOLERANCE[name], linestyle=":", color=f"C{i}", linewidth=1, label=f"{name} tolerance")
    ax.axhline(DG_GOAL, linestyle="--", color="black", linewidth=1, label="bf16 dg goal")
    ax.set_xticks([j + width * (len(CHECK_DTYPES) - 1) / 2 for j in range(len(tensors))], tensors)
    ax.set(yscale="log", ylabel="norm(diff) / norm(fp64 ref)", title="chunked kernel: worst relative error")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _json_safe(value: Any) -> Any:
    """NaN / inf as strings, so the report stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_json(report: dict[str, Any], path: Path) -> None:
    """Atomically: a reader never sees half a report."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_json_safe(report), indent=2))
    tmp.replace(path)


def _summary(report: dict[str, Any], checks: list[CheckRow], prefill: list[PrefillRow], decode: list[DecodeRow]) -> None:
    from rich.console import Console
    from rich.table import Table

    from .kernel_bench import _render

    console = Console(width=max(Console().width, 140))
    if prefill:
        _render(prefill, decode, report["setup"]["header"])
    table = Table(title="Correctness: worst relative error against fp64, per kernel and dtype")
    worst = report["worst_errors"]
    tensors = list(dict.fromkeys(t for by_dtype in worst.values() for errors in by_dtype.values() for t in errors))
    for col in ("kernel", "dtype", "checks passed", *tensors, "tolerance"):
        table.add_column(col, justify="right")
    for kernel, by_dtype in worst.items():
        for name, errors in by_dtype.items():
            rows = [r for r in checks if r.kernel == kernel and r.dtype == name]
            cells = [f"{errors[t]:.2e}" if t in errors else "-" for t in tensors]
            table.add_row(kernel, name, f"{sum(r.passed for r in rows)}/{len(rows)}", *cells, f"{TOLERANCE[name]:g}")
    console.print(table)
    if report["skipped_checks"]:
        console.print(f"checks: {report['skipped_checks']} cases skipped, the --check-budget spent")
    conversion = report["conversion"]
    if "skipped" in conversion:
        console.print(f"conversion: skipped ({conversion['skipped']})")
    elif conversion["error"]:
        console.print(f"conversion: FAILED: {conversion['error']}")
    else:
        stages = conversion["stages"].items()
        losses = ", ".join(f"{n} {s['steps']} steps, final loss {s['final_loss']:.4g}" for n, s in stages)
        console.print(f"conversion: {conversion['model']}, {conversion['seconds']:.1f} s ({losses}); finite: {conversion['finite']}")
    for goal in report["goals"]:
        value = "" if goal["value"] is None else f" (value {goal['value']:.3g})"
        console.print(f"goal {goal['goal']}: {goal['status']}{value}: {goal['target']}")
    for name, error in report["failures"].items():
        console.print(f"{name}: raised {error}")
    console.print(f"{'PASSED' if report['passed'] else 'FAILED'}; wrote {report['files']['json']} and {report['files']['png']}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m linearize.eval.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny version on CPU under TRITON_INTERPRET=1 (seconds)")
    p.add_argument("--out", type=Path, default=Path("out/gpu_check"), help="folder for gpu_check.{json,png}")
    p.add_argument("--seq-lens", type=int, nargs="+", help="sequence lengths (default 2048..16384; quick 32 80)")
    p.add_argument("--key-dims", type=int, nargs="+", help="key dims of the checks (default 64 128 256; quick 16 32)")
    p.add_argument("--value-dims", type=int, nargs="+", help="value dims; timings run at K = V (default 64 128; quick 16)")
    p.add_argument("--skip", nargs="+", default=[], choices=PARTS, help="parts not to run")
    p.add_argument("--check-budget", type=float, metavar="S", help="start no correctness case after S seconds of checks")
    p.add_argument("--autotune", action="store_true", help="autotune the tiles and warps (LINEARIZE_AUTOTUNE=1)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.quick and not torch.cuda.is_available():
        print(f"gpu_check: error: {NO_CUDA}", file=sys.stderr)
        return 2
    if args.autotune:
        os.environ["LINEARIZE_AUTOTUNE"] = "1"
    if args.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)  # tiny tensors: one thread never waits on a busy sibling core
    try:
        import triton

        from ..kernels import gla_triton
    except ImportError as err:
        print(f"gpu_check: error: triton is not importable ({err}): pip install triton", file=sys.stderr)
        return 2
    if args.quick and not gla_triton._interpreting():
        print("gpu_check: error: --quick runs Triton's interpreter: unset TRITON_INTERPRET or set it to 1", file=sys.stderr)
        return 2
    from .kernel_bench import _fla_runner

    base = QUICK if args.quick else FULL
    plan = replace(
        base,
        seq_lens=tuple(args.seq_lens or base.seq_lens),
        key_dims=tuple(args.key_dims or base.key_dims),
        value_dims=tuple(args.value_dims or base.value_dims),
    )
    device = torch.device("cpu" if args.quick else "cuda")
    where = "CPU, Triton interpreter" if args.quick else torch.cuda.get_device_name(device)
    fla_available = not args.quick and _fla_runner() is not None
    header = (
        f"{where}; torch {torch.__version__}, triton {triton.__version__}; timings {plan.time_dtype}, "
        f"B/HQ/H {'/'.join(map(str, plan.time_heads))}, warmup {plan.warmup}, median of {plan.repeats}"
    )
    logger.info("gpu_check: %s", header)
    phases: dict[str, float] = {}  # seconds per part, to size a run to the device time it has
    failures: dict[str, str] = {}  # parts that raised: the rest still runs and the report is still written

    def timed_phase(name: str, fn: Callable[[], Any], default: Any) -> Any:
        logger.info("%s ...", name)
        started = time.perf_counter()
        try:
            result = fn()
        except Exception as err:  # recorded in the report and the exit code
            logger.exception("%s failed", name)
            failures[name], result = str(err), default
        phases[name] = time.perf_counter() - started
        logger.info("%s done in %.1f s", name, phases[name])
        return result

    args.out.mkdir(parents=True, exist_ok=True)
    paths = {"json": args.out / "gpu_check.json", "png": args.out / "gpu_check.png"}
    setup = {
        "header": header,
        "mode": "quick" if args.quick else "full",
        "device": where,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": fla_available,
        "autotune": not gla_triton._fixed_tiles(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "plan": asdict(plan),
        "skipped_parts": args.skip,
        "check_budget_s": args.check_budget,
        "reference": (
            f"fp64 on the same device: gla_parallel for T <= {PARALLEL_MAX_T}, else gla_chunked; delta rule: "
            f"delta_recurrent for T <= {RECURRENT_MAX_T}, else delta_chunked"
        ),
        "tolerance": TOLERANCE,
    }
    checks: list[CheckRow] = []
    skipped_checks = 0
    prefill: list[PrefillRow] = []
    decode: list[DecodeRow] = []
    conversion: dict[str, Any] = {"skipped": "--skip convert", "passed": True}

    def report_so_far() -> dict[str, Any]:
        """The report of the parts run so far, rewritten after each: a run stopped at its limit keeps them."""
        report = {
            "setup": setup,
            "passed": ("checks" in args.skip or bool(checks))
            and all(r.passed for r in checks)
            and conversion["passed"]
            and not failures,
            "failures": failures,
            "skipped_checks": skipped_checks,
            "compile": compile_times(checks),
            "fallback_launches": fallback_launches(),
            "worst_errors": worst_errors(checks),
            "correctness": [asdict(r) for r in checks],
            "prefill": [asdict(r) for r in prefill],
            "decode": [asdict(r) for r in decode],
            "conversion": conversion,
            "goals": evaluate_goals(checks, prefill, args.quick, fla_available),
            "seconds": phases,
            "files": {k: str(v) for k, v in paths.items()},
        }
        write_json(report, paths["json"])
        return report

    if "checks" not in args.skip:
        checks, skipped_checks = timed_phase("checks", partial(run_checks, plan, device, args.check_budget, "delta" not in args.skip), ([], 0))
        report_so_far()
    if "prefill" not in args.skip:
        prefill = timed_phase("prefill timing", partial(time_prefill, plan, device), [])
        report_so_far()
    if "decode" not in args.skip:
        decode = timed_phase("decode timing", partial(time_decode, plan, device), [])
        report_so_far()
    if "convert" not in args.skip:
        failed = {"passed": False, "error": "the conversion phase raised (see failures)"}
        conversion = timed_phase("conversion", partial(run_conversion, plan, args.quick, device), failed)
    report = report_so_far()
    plot(report["worst_errors"], prefill, decode, paths["png"], header)
    _summary(report, checks, prefill, decode)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
