"""`linearize --dry-run`: the plan built on the meta device, with each stage's estimated peak memory and time.

Nothing loads or trains: the student is built from the config alone, and the costs come from
`budget.py`'s shapes-based estimates plus this device's matmul throughput, measured now.
`report.json` holds what a real run measured.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from ..modeling.configuration_linearize import LINEAR
from ..modeling.families import family_of
from ..modeling.modeling_linearize import LinearAttention
from .budget import activation_bytes, finetune_memory_plan, matmul_flops, needs_low_memory, transfer_memory_plan
from .plan import MEASURE_ROWS_TOKENS, MEASURE_TOKENS, SCORED, describe, plan_layers, sliding_plan
from .retrieval import probe_length, probe_token_count
from .sources import load_config, resolve
from .swap import linearize_model, new_parameters
from .train import LOSS_CHUNK_TOKENS

def lora_parameters(student: torch.nn.Module, recipe) -> int:
    """Parameters stage 2's adapters add: rank x (in + out) for each targeted projection of each adapted layer."""
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


GIB = 2**30
# CPU: what the process holds before the teacher loads (Python, torch, transformers, tokenizer, data):
# 0.43-0.55 GiB RSS measured on this project's runs.
RUNTIME_BYTES = GIB // 2
# CPU without --low-memory: glibc keeps freed blocks in its heap, so each stage's transients stay
# resident after it, fragmented: RSS grows with the sum of the stages' transients, times
# HEAP_RETENTION (fitted on the two measured runs: 1.5x on the memory benchmark's random Llama, 2.6x
# on the embedded SmolLM2, whose smaller tensors stay under glibc's 32 MiB mmap threshold). With
# --low-memory every large block is unmapped when freed and RSS follows the working set.
HEAP_RETAINED_STAGES = ("dequantize (first run)", "retrieval probe", "perplexity", "transfer", "finetune")
HEAP_RETENTION = 2.0
# A CPU stage's measured time over its FLOPs at the dry run's own matmul throughput, per stage, on an
# idle 2-core CPU (the embedded conversion and the memory benchmark agree within 25%): stage 2 runs at
# half the rate of a plain forward (activation recomputation, LoRA's extra products, the window's small
# blocks), the retrieval probe's attention read-out costs 60% more. On a busy machine the throughput
# measured at planning time is lower too, but not by as much as the run slows. GPUs are not
# calibrated: their figures stay lower bounds.
CPU_SLOWDOWN = {"placement pass": 1.0, "retrieval probe": 1.6, "perplexity": 1.0, "transfer": 1.0, "finetune": 2.0}
# With --low-memory on a CPU every large block is mapped afresh and unmapped when freed, page faults
# included: the embedded conversion's training stages ran 1.9x (finetune) and 2.3x (transfer) slower
# than on glibc's default heap; inference stages barely change.
LOW_MEMORY_SLOWDOWN = {"transfer": 2.0, "finetune": 2.0}


def _inference_bytes(base: PretrainedConfig, tokens: int, size: int) -> int:
    """Transient bytes of one no-grad forward over `tokens` tokens: one layer's tensors at a time (the
    residual, q/k/v, attention output, the MLP's inner tensors). The families' SDPA attention never
    materializes the tokens x tokens scores (measured: scoring 2K-token windows adds ~0.05 GiB on SmolLM2)."""
    h = base.hidden_size
    heads = base.num_attention_heads
    head_dim = getattr(base, "head_dim", None) or h // heads
    kv = (getattr(base, "num_key_value_heads", None) or heads) * head_dim
    inner = getattr(base, "intermediate_size", None) or 4 * h
    per_layer = tokens * size * (4 * h + 2 * heads * head_dim + 2 * kv + 3 * inner)
    return per_layer


def _attention_flops(base: PretrainedConfig, tokens: int, linear: int, window: int) -> float:
    """Forward FLOPs of the attention itself (scores and weighted sum) per token at `tokens` tokens of context:
    causal softmax layers see tokens/2 keys on average, linear layers their window plus a state update."""
    heads = base.num_attention_heads
    head_dim = getattr(base, "head_dim", None) or base.hidden_size // heads
    softmax = base.num_hidden_layers - linear
    seen = min(window, tokens) if window else 0
    return 4 * heads * head_dim * (softmax * tokens / 2 + linear * (seen + 4 * head_dim))


def dry_run(recipe, device: torch.device, low_memory: bool | None = None) -> dict:
    """The plan built on the meta device, with parameter counts and the estimated peak memory and time of each stage.

    Memory, per stage: the weights (the student shares the teacher's), the trained parameters with fp32
    masters, gradients and AdamW moments, the activations a pass keeps at the stage's longest row, and
    its transients (a GGUF's dequantization, the KL teacher's forward, the loss's logit chunks, the
    export's serialized copy). On a CPU the figure is the process's RSS: the runtime's own memory on
    top, and without `low_memory` the transients glibc keeps after each stage (`HEAP_RETAINED_STAGES`);
    `None` decides as the CLI does. On a GPU it is the allocated bytes, as `report.json` measures them.
    Time: each stage's FLOPs over this device's matmul throughput, measured now (so a busy machine
    gets longer estimates), times the stage's `CPU_SLOWDOWN` on a CPU (and `LOW_MEMORY_SLOWDOWN` with `low_memory`); the measured figures come in `report.json`.
    """
    config = load_config(recipe.model)
    base = config.get_text_config()
    dtype = recipe.torch_dtype(device)
    size = dtype.itemsize
    n_layers = base.num_hidden_layers
    layers = recipe.layers
    linear = layers.linear_layers or (layers.measured if layers.placement in SCORED else None)
    types = plan_layers(
        n_layers, layers.ratio, layers.placement_before_scoring, linear, layers.keep_softmax, layers.scores, *sliding_plan(config, layers)
    )
    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(config, dtype=dtype)
    student = linearize_model(teacher, types, recipe.linear_attention())
    # Distinct tensors: a tied head is the embedding, counted (and subtracted from the body) once.
    params = {id(p): p for p in teacher.parameters()}
    total = sum(p.numel() for p in params.values())
    embed_weight = teacher.get_input_embeddings().weight
    head_weight = teacher.get_output_embeddings().weight
    head = head_weight.numel()
    body = total - embed_weight.numel() - (0 if head_weight is embed_weight else head)
    new = sum(p.numel() for p in new_parameters(student).values())
    lora = lora_parameters(student, recipe) if recipe.finetune.tokens else 0
    weights = total * size
    n_linear = types.count(LINEAR)
    h = base.hidden_size
    window = recipe.attention.window
    cpu = device.type != "cuda"
    if low_memory is None:
        low_memory = cpu and needs_low_memory(weights)
    transfer, finetune = recipe.transfer, recipe.finetune
    transfers = bool(transfer.tokens and new)  # stage 1 is skipped when the layers have nothing to train

    # Memory: what each stage holds above the weights (transients), then the peak.
    transfer_pass, transfer_per_token = transfer_memory_plan(student, transfer, weights)
    transfer_rows = max(min(transfer.batch_size * transfer.seq_lens[0], transfer_pass), max(transfer.seq_lens))
    checkpointed, finetune_pass, finetune_per_token = finetune_memory_plan(student, finetune, weights)
    finetune_longest = max(finetune.seq_lens)
    finetune_rows = max(min(finetune.batch_size * finetune.seq_lens[0], finetune_pass), finetune_longest)
    loss_chunks = 3 * LOSS_CHUNK_TOKENS * base.vocab_size * 4
    probe_tokens = probe_length(window, getattr(base, "max_position_embeddings", None))
    scored = layers.placement == "retrieval" and not linear and layers.scores is None
    limit = getattr(base, "max_position_embeddings", None) or recipe.eval.heldout_seq_len
    heldout_lengths = sorted({n for n in (*recipe.eval.contexts, recipe.eval.heldout_seq_len) if n <= limit})
    extra = {
        # a GGUF teacher is dequantized into the cache on its first run: the model in fp32 and its serialized copy
        "dequantize (first run)": weights if cpu and resolve(recipe.model).kind in ("embedded", "gguf") else 0,
        "retrieval probe": _inference_bytes(base, probe_tokens, size) if scored else 0,
        "perplexity": _inference_bytes(base, heldout_lengths[-1], size) + loss_chunks
        if recipe.eval.heldout_tokens
        else 0,
        "transfer": 16 * new + transfer_per_token * transfer_rows if transfers else 0,
        # recomputed, each layer's linear path exists only while that layer runs backward (measured
        # on the memory benchmark: well below the transfer's per-feature values)
        "finetune": 16 * lora
        + (activation_bytes(config, finetune_rows, dtype, True) if checkpointed else finetune_per_token * finetune_rows)
        + _inference_bytes(base, finetune_longest, size)
        + loss_chunks
        if finetune.tokens
        else 0,
        # safetensors serializes each tensor to bytes before writing: in host memory, also from a GPU
        "export": weights if cpu else 0,
    }
    runtime = RUNTIME_BYTES if cpu else 0
    heap = cpu and not low_memory
    memory, retained = {}, 0
    for name, value in extra.items():
        if value:
            retained += value if heap and name in HEAP_RETAINED_STAGES else 0
            held = HEAP_RETENTION * retained if heap and name in HEAP_RETAINED_STAGES else value
            memory[name] = runtime + weights + int(held)
    if heap:  # the serialized copy reuses the heap's free blocks where they hold it
        memory["export"] = runtime + weights + int(max(HEAP_RETENTION * retained, extra["export"]))
    peak = max(memory.values(), default=runtime + weights)

    # Time: FLOPs of each stage over the measured matmul throughput.
    flops = matmul_flops(device, dtype)
    kl = finetune.loss == "kl"
    transfer_len = sum(transfer.seq_lens) / len(transfer.seq_lens)
    finetune_len = sum(finetune.seq_lens) / len(finetune.seq_lens)
    forward = {  # forward FLOPs per token
        "probe": 2 * body + _attention_flops(base, probe_tokens, 0, 0),
        "transfer": 2 * body
        + _attention_flops(base, transfer_len, 0, 0)  # the teacher's softmax output each linear layer matches
        + _attention_flops(base, transfer_len, n_linear, window),
        "student": 2 * body + _attention_flops(base, finetune_len, n_linear, window),
        "teacher": 2 * body + _attention_flops(base, finetune_len, 0, 0),
    }
    heldout = recipe.eval.heldout_tokens
    # measured and kl placement: a short transfer of every layer as linear (all new parameters trained),
    # then kl's forward with each layer restored in turn (and both ends), its KL over the head's logits.
    ranked = layers.placement in ("measured", "kl") and not linear and layers.scores is None
    every_linear = 2 * body + _attention_flops(base, transfer_len, 0, 0) + _attention_flops(base, transfer_len, n_layers, window)
    rank_tokens = min(MEASURE_TOKENS, transfer.tokens or MEASURE_TOKENS)
    rank_flops = (2 * every_linear + 6 * new * n_layers / max(n_linear, 1)) * rank_tokens
    if layers.placement == "kl":
        rank_flops += (n_layers + 2) * (every_linear + 2 * 2 * head) * min(MEASURE_ROWS_TOKENS, rank_tokens)
    seconds = {
        "placement pass": rank_flops if ranked else 0.0,
        "retrieval probe": forward["probe"] * probe_token_count(window, getattr(base, "max_position_embeddings", None))
        if scored
        else 0.0,
        # teacher and trained student at each context length, the untrained student at heldout_seq_len
        "perplexity": heldout * sum(
            (3 if n == recipe.eval.heldout_seq_len else 2)
            * (2 * (body + head) + _attention_flops(base, n, 0, 0))
            for n in heldout_lengths
        ),
        # stage 1's backward reaches only the new parameters' inputs: about one more forward
        "transfer": (2 * forward["transfer"] + 6 * new) * transfer.tokens * transfers,
        # forward, backward (twice a forward) and a recomputed forward when checkpointed, plus the KL teacher's forward
        "finetune": ((3 + checkpointed) * forward["student"] + kl * forward["teacher"] + 6 * lora
        + (2 + kl) * 2 * head) * finetune.tokens,
    }
    def slowdown(name: str) -> float:
        if not cpu:
            return 1.0
        return CPU_SLOWDOWN.get(name, 1.0) * (LOW_MEMORY_SLOWDOWN.get(name, 1.0) if low_memory else 1.0)

    seconds = {name: value / flops * slowdown(name) for name, value in seconds.items()}
    plan = describe(types)
    if layers.placement in SCORED and not linear:
        plan += (
            f" ({layers.placement} placement by the given scores)"
            if layers.scores is not None
            else f" ({layers.placement} placement: the softmax layers are chosen when the run scores them; shown spread)"
        )
    where = "RSS" if cpu else "allocated"
    mode = (", --low-memory" if low_memory else ", glibc's default heap") if cpu else ""
    rows = [
        ("model config", f"{base.model_type}, {n_layers} layers, hidden {h}, vocab {base.vocab_size}"),
        ("layer plan (L linear, S softmax, W sliding window)", plan),
        ("parameters", f"{total / 1e9:.3f} B ({weights / GIB:.2f} GiB in {str(dtype).removeprefix('torch.')})"),
        ("new parameters (stage 1 trains)", f"{new / 1e6:.2f} M"),
        ("LoRA parameters (stage 2 trains)", f"{lora / 1e6:.2f} M (rank {finetune.lora_rank})"),
        ("activation checkpointing (finetune)", "on" if checkpointed else "off"),
    ]
    for name, value in memory.items():
        rows.append((f"estimated memory, {name}", f"{value / GIB:.2f} GiB {where}"))
    rows.append((f"estimated peak memory ({where}{mode})", f"{peak / GIB:.2f} GiB ({peak / weights:.1f}x the weights)"))
    rows.append(("device throughput (measured matmul)", f"{flops / 1e12:.2f} TFLOP/s on {device}"))
    for name, value in seconds.items():
        if value:
            rows.append((f"estimated time, {name}", ("~ " if cpu else ">= ") + _duration(value)))
    return {
        "rows": rows,
        "layer_types": types,
        "parameters": total,
        "new_parameters": new,
        "lora_parameters": lora,
        "weight_bytes": weights,
        "memory": memory,
        "peak_bytes": peak,
        "low_memory": low_memory,
        "seconds": seconds,
        "gradient_checkpointing": checkpointed,
    }


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
