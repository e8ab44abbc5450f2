"""What a conversion costs before it runs: weight, optimizer and activation bytes, and compute per token.

`linearize --dry-run` prints these for a plan built on the meta device; stage 2 uses the activation
estimate to decide whether recomputing activations pays (it does once they would outweigh the weights).
The figures are estimates from the shapes, not measurements: `report.json` holds the measured peak.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time

import torch
from transformers import PretrainedConfig

from ..modeling.modeling_linearize import linear_attentions


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the model's distinct parameters and buffers (tied and shared tensors counted once), with
    floating-point ones counted in `dtype` where given (the size after a cast)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        # By address and size, not storage: fused q/k/v weights are slices of one storage (`lay_out_projections`).
        key = (id(tensor), 0) if tensor.is_meta else (tensor.data_ptr(), tensor.numel())
        if key not in seen:
            seen.add(key)
            size = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
            total += tensor.numel() * size
    return total


def activation_bytes(config: PretrainedConfig, tokens: int, dtype: torch.dtype, checkpointed: bool = False) -> int:
    """Activations a full backward through the decoder keeps for `tokens` tokens per step.

    Per layer and token: the residual and norm inputs, q/k/v, the attention output and the MLP's
    inner tensors (about 8h + 2·kv + 4·intermediate values). With checkpointing, only each layer's
    input is kept, plus one layer's activations while it is recomputed.
    """
    base = config.get_text_config()
    h = base.hidden_size
    heads = base.num_attention_heads
    kv = (getattr(base, "num_key_value_heads", None) or heads) * (getattr(base, "head_dim", None) or h // heads)
    inner = getattr(base, "intermediate_size", None) or 4 * h
    size = torch.finfo(dtype).bits // 8
    per_layer = tokens * size * (8 * h + 2 * kv + 4 * inner)
    layers = base.num_hidden_layers
    if checkpointed:
        return layers * tokens * size * h + per_layer
    return layers * per_layer


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

# fp32 values stage 1 keeps per token, head and feature channel of a linear layer: features, their
# softmax, the chunked form's blocks and the gate (measured on a hidden-1024 Llama with Hedgehog maps).
TRANSFER_VALUES_PER_FEATURE = 30


PASS_SHARE = 0.25  # the share of the weight bytes one forward's activations may take (training splits steps to fit)


def tokens_per_pass(per_token_bytes: int, weights: int) -> int:
    """How many tokens one training forward may take so its activations stay within PASS_SHARE of the weights."""
    return max(1, int(weights * PASS_SHARE) // max(1, per_token_bytes))


def transfer_activation_bytes(student: torch.nn.Module, tokens: int) -> int:
    """Activations stage 1 keeps for backward at `tokens` tokens per step, when nothing is recomputed."""

    layers = linear_attentions(student)
    return sum(tokens * 4 * TRANSFER_VALUES_PER_FEATURE * m.n_heads * m.feature_channels for m in layers)


# A CPU conversion's peak RSS with glibc's default policy, as a multiple of the weights (measured: 4.6x on a
# random 218M Llama); above half the free RAM, freed memory goes back to the OS.
FAST_PEAK_OVER_WEIGHTS = 5


def needs_low_memory(weights: int) -> bool:
    """Whether a CPU conversion of `weights` bytes should trade speed for memory (see `return_freed_memory`)."""
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None
    return free is not None and FAST_PEAK_OVER_WEIGHTS * weights > free / 2


def return_freed_memory() -> None:
    """Make freed tensors go back to the OS (Linux glibc): peak RSS stays near the working set.

    glibc serves a large block from the heap once a block of its size was freed (its mmap threshold
    rises), and heap memory is rarely returned, so RSS climbs stage by stage (4.6x the weights on a
    random 218M Llama). A fixed 1 MiB threshold keeps every larger tensor in its own mapping, unmapped
    when freed (2.4x there), at the price of page faults on every such allocation (1.7x the time on
    2 cores). Process-wide: the CLI calls it for `--low-memory` runs.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # another C library: its own policy stays
        pass


def transfer_memory_plan(student: torch.nn.Module, stage, weights: int) -> tuple[int, int]:
    """Stage 1's (tokens per pass, activation bytes per token) for `weights` bytes.

    Each linear layer backpropagates its own loss at the end of its forward, so one layer's
    activations exist at a time.
    """

    per_token = transfer_activation_bytes(student, 1) // max(1, len(linear_attentions(student)))
    return tokens_per_pass(per_token, weights), per_token


def finetune_memory_plan(student: torch.nn.Module, stage, weights: int) -> tuple[bool, int, int]:
    """Stage 2's (recompute each decoder layer and linear path, tokens per pass, activation bytes per token)."""

    dtype = next(student.parameters()).dtype
    recompute = stage.gradient_checkpointing
    if recompute is None:
        recompute = activation_bytes(student.config, stage.batch_size * stage.seq_lens[0], dtype) > weights
    linear = max(1, len(linear_attentions(student)))
    per_token = activation_bytes(student.config, 1, dtype, recompute)
    per_token += transfer_activation_bytes(student, 1) // (linear if recompute else 1)
    return recompute, tokens_per_pass(per_token, weights), per_token


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """Measured dense matmul throughput of `device` in `dtype` (FLOP/s): what the time estimates divide by."""
    n = 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        runs += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * runs / (time.perf_counter() - started)


def parameter_count(config: PretrainedConfig, body_only: bool = False) -> int:
    """Parameters of the model a config describes, counted on the meta device (nothing is allocated).

    `body_only` leaves out the token embedding and the head: what conversion trains and what a token budget
    is sized by (a 262K vocabulary is most of Gemma-3-270M and none of its attention)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return body_parameter_count(model) if body_only else sum(p.numel() for p in model.parameters())


def body_parameter_count(model: torch.nn.Module) -> int:
    """Parameters outside the token embedding and the head (tied or not, each counted once)."""
    vocabulary = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in vocabulary)
