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

from ..modeling.families import text_config


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
    base = text_config(config)
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
    from .parallel import linear_layers

    layers = linear_layers(student)
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
    from .parallel import linear_layers

    per_token = transfer_activation_bytes(student, 1) // max(1, len(linear_layers(student)))
    return tokens_per_pass(per_token, weights), per_token


def finetune_memory_plan(student: torch.nn.Module, stage, weights: int) -> tuple[bool, int, int]:
    """Stage 2's (recompute each decoder layer and linear path, tokens per pass, activation bytes per token)."""
    from .parallel import linear_layers

    dtype = next(student.parameters()).dtype
    recompute = stage.gradient_checkpointing
    if recompute is None:
        recompute = activation_bytes(student.config, stage.batch_size * stage.seq_lens[0], dtype) > weights
    linear = max(1, len(linear_layers(student)))
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


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of the model a config describes, counted on the meta device (nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _lora_parameters(student: torch.nn.Module, recipe) -> int:
    """Parameters stage 2's adapters add: rank x (in + out) for each targeted projection of each adapted layer."""
    from ..modeling.families import family_of
    from ..modeling.modeling_linearize import LinearAttention

    stage = recipe.finetune
    family = family_of(student.base_model.config)
    targets = set(stage.lora_targets or family.projections)
    layers = student.base_model.layers
    adapted = [layer for layer in layers if stage.lora_layers == "all" or isinstance(getattr(layer, family.attention), LinearAttention)]
    total = 0
    for layer in adapted:
        for name, module in getattr(layer, family.attention).named_children():
            if name in targets and isinstance(module, torch.nn.Linear):
                total += stage.lora_rank * (module.in_features + module.out_features)
    return total


def dry_run(recipe, device: torch.device) -> dict:
    """The plan built on the meta device, with parameter counts and estimated peak memory and time per stage.

    Memory: the frozen weights once (the student shares the teacher's), new and LoRA parameters with
    fp32 masters, gradients and AdamW moments, and each stage's activations. Time: the stages' FLOPs
    over this device's measured matmul throughput, so a lower bound; the measured figures come in
    `report.json`.
    """
    from transformers import AutoModelForCausalLM

    from ..modeling.configuration_linearize import LINEAR
    from .plan import SCORED, describe, plan_layers
    from .retrieval import probe_token_count
    from .sources import load_config
    from .swap import linearize_model, new_parameters
    from .train import LOSS_CHUNK_TOKENS

    config = load_config(recipe.model)
    base = text_config(config)
    dtype = recipe.torch_dtype(device)
    n_layers = base.num_hidden_layers
    layers = recipe.layers
    linear = layers.linear_layers or (layers.measured if layers.placement in SCORED else None)
    placement = "spread" if layers.placement in SCORED else layers.placement
    types = plan_layers(n_layers, layers.ratio, placement, linear, layers.keep_softmax)
    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(config, dtype=dtype)
    student = linearize_model(teacher, types, recipe.linear_attention())
    total = sum(p.numel() for p in teacher.parameters())
    embed = teacher.get_input_embeddings().weight.numel()
    head = teacher.get_output_embeddings().weight.numel()
    new = sum(p.numel() for p in new_parameters(student).values())
    lora = _lora_parameters(student, recipe) if recipe.finetune.tokens else 0
    weights = sum(p.numel() * p.element_size() for p in teacher.parameters())
    n_linear = types.count(LINEAR)
    h = base.hidden_size
    transfer_tokens = recipe.transfer.batch_size * recipe.transfer.seq_lens[0]
    finetune_tokens = recipe.finetune.batch_size * recipe.finetune.seq_lens[0]
    transfer_pass, transfer_per_token = transfer_memory_plan(student, recipe.transfer, weights)
    transfer_act = transfer_per_token * min(transfer_tokens, transfer_pass)
    checkpointed, finetune_pass, finetune_per_token = finetune_memory_plan(student, recipe.finetune, weights)
    finetune_act = finetune_per_token * min(finetune_tokens, finetune_pass) + 3 * LOSS_CHUNK_TOKENS * base.vocab_size * 4
    stage1 = weights + 16 * new + transfer_act if recipe.transfer.tokens else weights
    stage2 = weights + 16 * lora + finetune_act if recipe.finetune.tokens else weights
    peak = max(stage1, stage2)
    body = total - embed - head
    flops = matmul_flops(device, dtype)
    kl = recipe.finetune.loss == "kl"
    per_token = {
        "transfer": 2 * body * (1 + 0.25 * n_linear / n_layers) + 6 * new,
        "finetune": 2 * (body + head) * (2 + kl + checkpointed) + 6 * lora,
    }
    probed = probe_token_count(recipe.attention.window, getattr(base, "max_position_embeddings", None))
    seconds = {
        "measuring pass": per_token["transfer"] * min(8192, recipe.transfer.tokens or 8192) / flops
        if layers.placement == "measured" and not linear
        else 0.0,
        "retrieval probe": 2 * body * probed / flops if layers.placement == "retrieval" and not linear else 0.0,
        "transfer": per_token["transfer"] * recipe.transfer.tokens / flops,
        "finetune": per_token["finetune"] * recipe.finetune.tokens / flops,
        "perplexity": 3 * 2 * (body + head) * recipe.eval.heldout_tokens / flops,
    }
    plan = describe(types)
    if layers.placement in SCORED and not linear:
        plan += f" ({layers.placement} placement: the softmax layers are chosen when the run scores them; shown spread)"
    gib = 2**30
    rows = [
        ("model config", f"{base.model_type}, {n_layers} layers, hidden {h}, vocab {base.vocab_size}"),
        ("layer plan (L linear, S softmax)", plan),
        ("parameters", f"{total / 1e9:.3f} B ({weights / gib:.2f} GiB in {str(dtype).removeprefix('torch.')})"),
        ("new parameters (stage 1 trains)", f"{new / 1e6:.2f} M"),
        ("LoRA parameters (stage 2 trains)", f"{lora / 1e6:.2f} M (rank {recipe.finetune.lora_rank})"),
        ("activation checkpointing (finetune)", "on" if checkpointed else "off"),
        ("estimated peak memory, transfer", f"{stage1 / gib:.2f} GiB ({stage1 / weights:.2f}x the weights)"),
        ("estimated peak memory, finetune", f"{stage2 / gib:.2f} GiB ({stage2 / weights:.2f}x the weights)"),
        ("device throughput (measured matmul)", f"{flops / 1e12:.2f} TFLOP/s on {device}"),
    ]
    for name, value in seconds.items():
        if value:
            rows.append((f"estimated time, {name}", f">= {_duration(value)}"))
    return {
        "rows": rows,
        "layer_types": types,
        "parameters": total,
        "new_parameters": new,
        "lora_parameters": lora,
        "weight_bytes": weights,
        "peak_bytes": peak,
        "seconds": seconds,
        "gradient_checkpointing": checkpointed,
    }


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
