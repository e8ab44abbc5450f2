"""Stages 1 and 2: attention transfer and LoRA fine-tuning, on one loop that checkpoints and resumes.

Stage 1 trains only the linear layers' new parameters: each linear layer, in transfer mode,
computes the teacher's softmax output on the same input, passes it on and records the MSE of its
own output against it, so one backbone pass trains every layer and no softmax output is computed
twice. Each layer's loss is local to it, so it is backpropagated at the end of the layer's
forward (`parallel.data_parallel(local_losses=True)`): one layer's activations exist at a time, with
no recompute. Stage 2 wraps the swapped layers' projections in peft LoRA adapters and trains them
on next-token CE or on KL to the teacher's logits (computed on the fly), then merges them.

The loop is data-parallel (each process takes its own rows of every step; the weights replicated,
or sharded with `--fsdp`, see `parallel.py`), checkpoints trainable parameters and optimizer state to
safetensors, resumes from the last checkpoint, saves and stops cleanly on Ctrl-C, and refuses to
continue past a NaN/inf loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from accelerate import Accelerator
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..modeling.families import family_of
from .budget import finetune_memory_plan, transfer_memory_plan, weight_bytes
from .parallel import data_parallel, full, like
from .measure import final_hidden_states, head_logits
from ..modeling.modeling_linearize import LinearizeForCausalLM, linear_attentions
from ..modeling.modes import teacher_attention, transfer_mode
from .recipes import Stage
from .swap import new_parameters

logger = logging.getLogger(__name__)

LOSS_CHUNK_TOKENS = 256  # positions whose logits exist at once in stage 2's loss


class StageInterrupted(RuntimeError):
    """Ctrl-C during a stage: progress was saved and the same command resumes."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/inf: the stage stopped and the last good state was kept."""


@dataclass
class StageResult:
    name: str
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    resumed_from: int = 0
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens seen, loss)
    layer_errors: dict[int, float] = field(default_factory=dict)  # stage 1: relative MSE per layer
    weight_bytes_per_process: int = 0  # weights one process held while training (a shard of them under FSDP)

    @property
    def final_loss(self) -> float | None:
        return self.curve[-1][1] if self.curve else None


class Checkpoint:
    """One safetensors file per stage: trainable tensors, optimizer moments, and progress as metadata."""

    def __init__(self, work_dir: Path | None, stage: str):
        self.path = None if work_dir is None else Path(work_dir) / f"{stage}.safetensors"

    def exists(self) -> bool:
        return self.path is not None and self.path.is_file()

    def meta(self) -> dict:
        if not self.exists():
            return {}
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), "pt") as f:
                return json.loads((f.metadata() or {}).get("progress", "{}"))
        except (SafetensorError, ValueError) as err:
            raise ValueError(f"checkpoint {self.path} is corrupt ({err}): delete it to restart this stage") from None

    def save(
        self, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None, progress: dict, write: bool = True
    ) -> None:
        """Write whole tensors (shards are gathered: then every process calls this, and one writes)."""
        if self.path is None:
            return
        tensors = {f"param.{name}": full(p).detach().to("cpu").contiguous() for name, p in params.items()}
        if optimizer is not None:
            for index, state in optimizer.state_dict()["state"].items():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        tensors[f"optim.{index}.{key}"] = full(value).detach().to("cpu").contiguous()
        if not write:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            save_file(tensors, str(tmp), metadata={"progress": json.dumps(progress)})
        except (OSError, SafetensorError) as err:  # a full disk, mostly: the last checkpoint is still whole
            tmp.unlink(missing_ok=True)
            raise OSError(
                f"cannot save checkpoint {self.path} ({err}): free some space, then rerun the same command to resume"
                + (" from the last checkpoint" if self.exists() else "")
            ) from None
        os.replace(tmp, self.path)

    def load(self, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None) -> dict:
        """Restore tensors in place; returns the saved progress ({} when there is no checkpoint)."""
        if not self.exists():
            return {}
        try:
            tensors = load_file(str(self.path))
        except Exception as err:
            raise ValueError(f"checkpoint {self.path} is corrupt ({err}): delete it to restart this stage") from None
        with torch.no_grad():
            for name, p in params.items():
                if f"param.{name}" not in tensors:
                    raise ValueError(f"checkpoint {self.path} does not match this run: delete it or change --work-dir")
                p.copy_(like(tensors[f"param.{name}"].to(p.dtype), p))
        if optimizer is not None:
            ordered = list(params.values())
            state: dict[int, dict] = {}
            for key, value in tensors.items():
                if key.startswith("optim."):
                    _, index, name = key.split(".", 2)
                    state.setdefault(int(index), {})[name] = like(value, ordered[int(index)])
            if state:
                optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
        return self.meta()


@dataclass
class Phase:
    """One length of a stage's curriculum: packed rows, rows per process per step, and its steps."""

    rows: torch.Tensor  # [N, seq_len]
    batch_size: int
    steps: int

    def tokens_per_step(self, world: int) -> int:
        return self.batch_size * self.rows.shape[1] * world


def plan_phases(data: torch.Tensor | list[torch.Tensor], stage: Stage, world: int) -> list[Phase]:
    """Split the stage's token budget evenly over its lengths (shortest-first curriculum, as given).

    A length whose share of the budget would not fill one row is dropped (with the lengths after it),
    so a small budget is not overrun by rows far longer than it.

    Every phase keeps the first length's tokens per step (`batch_size` rows of it): longer rows come
    in proportionally smaller batches, so the step count, the learning-rate schedule and the memory
    per step stay comparable across lengths.
    """
    phases = [data] if isinstance(data, torch.Tensor) else list(data)
    kept = len(phases)
    while kept > 1 and stage.tokens / kept < max(rows.shape[1] for rows in phases[:kept]):
        kept -= 1
    if kept < len(phases):
        lengths = [rows.shape[1] for rows in phases]
        logger.warning(
            "a budget of %s tokens holds no full row of every length in %s: training on %s only (%s tokens would take all)",
            f"{stage.tokens:,}", lengths, lengths[:kept], f"{len(lengths) * max(lengths):,}",
        )
        phases = phases[:kept]
    tokens_per_row_step = stage.batch_size * phases[0].shape[1]
    share = stage.tokens / len(phases)
    planned = []
    for rows in phases:
        batch = max(1, tokens_per_row_step // rows.shape[1])
        planned.append(Phase(rows, batch, max(1, math.ceil(share / (batch * rows.shape[1] * world)))))
    return planned


def phase_of(phases: list[Phase], step: int) -> tuple[Phase, int]:
    """The phase a global step falls in, and the step's index inside it."""
    for phase in phases:
        if step < phase.steps:
            return phase, step
        step -= phase.steps
    raise IndexError("step past the end of the stage")


def tokens_after(phases: list[Phase], steps: int, world: int) -> int:
    """Tokens the whole stage has trained on after `steps` global steps."""
    total = 0
    for phase in phases:
        done = min(steps, phase.steps)
        total += done * phase.tokens_per_step(world)
        steps -= done
    return total


def rows_for_step(data: torch.Tensor, step: int, batch_size: int, rank: int, world: int) -> torch.Tensor:
    """This process's rows of a global step; data cycles when the budget exceeds one epoch."""
    start = (step * world + rank) * batch_size
    index = torch.arange(start, start + batch_size) % data.shape[0]
    return data[index]


def lr_lambda(total_steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to a tenth of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


@contextmanager
def fp32_masters(params: dict[str, torch.nn.Parameter]) -> Iterator[torch.dtype | None]:
    """Train `params` in fp32 while the frozen weights keep their dtype; yields the autocast dtype (or None).

    A bf16 model then never takes pure-bf16 AdamW steps (updates below bf16's resolution would be lost),
    and autocast runs the mixed forward. The parameters get their own dtype back afterwards.
    """
    stored = {name: p.dtype for name, p in params.items()}
    low = [d for d in stored.values() if d in (torch.bfloat16, torch.float16)]
    for p in params.values():
        p.data = p.data.float()
    try:
        yield low[0] if low else None
    finally:
        for name, p in params.items():
            p.data = p.data.to(stored[name])


@contextmanager
def stop_on_ctrl_c() -> Iterator[Callable[[], bool]]:
    """Ctrl-C asks the stage to stop after its current step; a second Ctrl-C stops at once.

    A KeyboardInterrupt that lands in a finalizer (a `__del__` run by the garbage collector) is
    printed and dropped by Python, so the signal is caught here and acted on at a step boundary.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    asked: list[int] = []
    previous = signal.getsignal(signal.SIGINT)

    def ask(signum, frame) -> None:
        asked.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, ask)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def on_every_process(ok: bool | torch.Tensor, accelerator: Accelerator) -> bool:
    """Whether `ok` holds on every process, told to all of them by one all-reduce: when one process fails,
    all stop together and none is left waiting in a collective."""
    bad = (~torch.as_tensor(ok, device=accelerator.device)).float().reshape(1)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="sum")
    return not bad.item()


def all_finite(loss: torch.Tensor, accelerator: Accelerator) -> bool:
    """Whether the loss is finite on every process."""
    return on_every_process(torch.isfinite(loss.detach()).all(), accelerator)


def run_loop(
    name: str,
    module: torch.nn.Module,
    params: dict[str, torch.nn.Parameter],
    data: torch.Tensor | list[torch.Tensor],
    stage: Stage,
    step_loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    accelerator: Accelerator,
    work_dir: Path | None,
    tokens_per_pass: int | None = None,
    shard: bool = False,
    local_losses: bool = False,
) -> StageResult:
    """Optimize `params` on `data` (one [N, L] tensor, or one per curriculum length) for the stage's
    token budget; checkpointed and resumable. The module runs as the launch asked: in one process,
    replicated (DDP) or sharded (FSDP2, `parallel.data_parallel`); `step_loss` gets what to call and must
    reach every module through it, since a sharded stage calls a twin of `module`.

    `tokens_per_pass` caps the rows one forward takes: a step's rows then run in several passes whose
    gradients add up (the same update as one pass, weighted by rows), so activation memory follows the
    cap, not the batch. `shard` shards the weights over the processes while the stage trains (FSDP2);
    `local_losses` says the loss is the linear layers' own transfer losses (stage 1, see `parallel.py`)."""
    world, rank = accelerator.num_processes, accelerator.process_index
    phases = plan_phases(data, stage, world)
    total = sum(p.steps for p in phases)
    checkpoint = Checkpoint(work_dir, name)
    progress = checkpoint.meta()
    result = StageResult(name, resumed_from=progress.get("step", 0))
    result.curve = [tuple(x) for x in progress.get("curve", [])]
    if progress.get("done"):
        checkpoint.load(params, None)
        result.steps, result.tokens = progress["step"], tokens_after(phases, progress["step"], world)
        result.seconds = progress.get("seconds", 0.0)
        logger.info("%s: already complete in the checkpoint (%d steps), skipping", name, result.steps)
        return result
    with (
        fp32_masters(params) as autocast_dtype,
        stop_on_ctrl_c() as asked_to_stop,
        data_parallel(module, params, accelerator, shard, local_losses) as parallel,
    ):
        prepared, params = parallel.model, parallel.params
        result.weight_bytes_per_process = parallel.weight_bytes_per_process()
        optimizer = torch.optim.AdamW(params.values(), lr=stage.lr, weight_decay=stage.weight_decay)
        checkpoint.load(params, optimizer)
        factor = lr_lambda(total, stage.warmup_steps)
        start = result.resumed_from
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(step + start))
        if start:
            logger.info("%s: resuming at step %d of %d", name, start, total)
        elapsed = progress.get("seconds", 0.0)
        started = time.perf_counter()

        def save(step: int, done: bool = False) -> None:
            failure = None
            if accelerator.is_main_process or parallel.sharded:
                seconds = elapsed + time.perf_counter() - started
                state = {"step": step, "done": done, "curve": result.curve, "seconds": seconds}
                try:
                    checkpoint.save(params, optimizer, state, write=accelerator.is_main_process)
                except OSError as err:
                    failure = err
            if not on_every_process(failure is None, accelerator):
                raise failure or OSError(f"{name}: the main process could not save its checkpoint (see its error)")

        bar = tqdm(
            total=total,
            initial=start,
            desc=name,
            unit="step",
            disable=not accelerator.is_main_process or bool(os.environ.get("LINEARIZE_NO_PROGRESS")),
        )
        completed = start
        prepared.train()
        try:
            for step in range(start, total):
                phase, local = phase_of(phases, step)
                batch = rows_for_step(phase.rows, local, phase.batch_size, rank, world).to(accelerator.device)
                rows = batch.shape[0] if tokens_per_pass is None else max(1, tokens_per_pass // batch.shape[1])
                pieces = batch.split(rows)
                loss = torch.zeros((), device=accelerator.device)
                for index, piece in enumerate(pieces):
                    last = index == len(pieces) - 1  # gradients are all-reduced once, after the last pass
                    parallel.scale = piece.shape[0] / batch.shape[0]
                    with (
                        contextlib.nullcontext() if last else parallel.no_sync(),
                        torch.autocast(accelerator.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
                    ):
                        part = step_loss(prepared, piece) * parallel.scale
                    if not all_finite(part, accelerator):
                        checkpoint.load(params, None)
                        value = part.detach().float() * batch.shape[0] / piece.shape[0]
                        shown = value.item() if not torch.isfinite(value).all() else "non-finite on another process"
                        raise NonFiniteLoss(
                            f"{name}: loss became {shown} at step {step}: lower its lr; the last good state is kept "
                            "and a rerun resumes from it"
                        )
                    with contextlib.nullcontext() if last else parallel.no_sync():
                        parallel.backward(part)
                    loss = loss + part.detach().float()
                parallel.reduce_gradients()
                torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                completed = step + 1
                value = accelerator.reduce(loss.detach().float(), reduction="mean").item()
                seen = tokens_after(phases, completed, world)
                result.curve.append((seen, value))
                seconds = time.perf_counter() - started
                rate = (seen - tokens_after(phases, start, world)) / max(seconds, 1e-9)
                bar.set_postfix(loss=f"{value:.4g}", tok_s=f"{rate:.0f}", len=phase.rows.shape[1])
                bar.update(1)
                if completed % stage.checkpoint_every == 0 and completed < total:
                    save(completed)
                if asked_to_stop() and completed < total:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            save(completed)
            raise StageInterrupted(
                f"interrupted: {name} progress saved at step {completed}; rerun the same command to resume"
            ) from None
        finally:
            bar.close()
        save(completed, done=True)
        result.steps, result.tokens = completed, tokens_after(phases, completed, world)
        result.seconds = elapsed + time.perf_counter() - started
    return result


def attention_transfer(
    student: LinearizeForCausalLM,
    data: torch.Tensor,
    stage: Stage,
    accelerator: Accelerator,
    work_dir: Path | None,
    shard: bool = False,
) -> StageResult:
    """Stage 1: fit the new parameters so each linear layer reproduces its softmax layer's output."""
    params = new_parameters(student)
    if not params:
        logger.info("transfer: the linear layers have no trainable parameters, skipping")
        return StageResult("transfer")
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    layer_sums: dict[int, list[float]] = {}
    per_pass, _ = transfer_memory_plan(student, stage, weight_bytes(student))

    with transfer_mode(student, stage.late_weight):

        def step_loss(backbone: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
            backbone(input_ids=batch, use_cache=False)
            layers = linear_attentions(backbone)
            losses = [layer.transfer_loss for layer in layers]
            for layer, loss in zip(layers, losses):
                layer_sums.setdefault(layer.layer_idx, []).append(loss.item())
            return torch.stack(losses).sum()

        result = run_loop(
            "transfer", student.base_model, params, data, stage, step_loss, accelerator, work_dir, per_pass, shard, True
        )
    for p in student.parameters():
        p.requires_grad_(False)
    result.layer_errors = {i: sum(v) / len(v) for i, v in layer_sums.items()}
    return result


@torch.no_grad()
def measure_layer_errors(student: LinearizeForCausalLM, data: torch.Tensor, batch_size: int = 2) -> dict[int, float]:
    """Relative transfer error of every linear layer on `data`: MSE / mean square of the teacher output."""
    errors: dict[int, list[float]] = {}
    scales: dict[int, float] = {}
    with transfer_mode(student) as layers:
        hooks = []
        for layer in layers:

            def keep_scale(module, args, output, index=layer.layer_idx):
                scales[index] = output[0].float().pow(2).mean().item()

            hooks.append(layer.register_forward_hook(keep_scale))
        try:
            for start in range(0, data.shape[0], batch_size):
                student.base_model(input_ids=data[start : start + batch_size], use_cache=False)
                for layer in layers:
                    rel = layer.transfer_loss.item() / max(scales[layer.layer_idx], 1e-12)
                    errors.setdefault(layer.layer_idx, []).append(rel)
        finally:
            for hook in hooks:
                hook.remove()
    return {i: sum(v) / len(v) for i, v in errors.items()}


@torch.no_grad()
def measure_kl_gains(student: LinearizeForCausalLM, data: torch.Tensor, batch_size: int = 1) -> dict[int, float]:
    """Per linear layer: how much the next-token KL to the teacher drops when that layer alone runs its
    teacher's softmax again (KL-guided selection: the layers whose restoring pays most keep softmax).

    The teacher is the same model with every layer restored, so one set of weights serves all 1 + N
    configurations; each row's KL is the mean over its positions, as stage 2 trains it.
    """
    layers = linear_attentions(student)
    gains = {layer.layer_idx: 0.0 for layer in layers}
    batches = range(0, data.shape[0], batch_size)
    was_training = student.training
    student.eval()
    try:
        for start in tqdm(batches, desc="KL placement", unit="batch", leave=False):
            rows = data[start : start + batch_size]
            with teacher_attention(student):
                target = student.base_model(input_ids=rows, use_cache=False).last_hidden_state
            every_linear = next_token_loss(student, student.base_model(input_ids=rows, use_cache=False).last_hidden_state, target=target)
            for layer in tqdm(layers, desc="restoring one layer", unit="layer", leave=False):
                layer.teacher_attention = True
                try:
                    hidden = student.base_model(input_ids=rows, use_cache=False).last_hidden_state
                finally:
                    layer.teacher_attention = False
                gains[layer.layer_idx] += (every_linear - next_token_loss(student, hidden, target=target)).item()
    finally:
        student.train(was_training)
    return {i: gain / len(batches) for i, gain in gains.items()}


def _chunk_loss(
    model: LinearizeForCausalLM, hidden: torch.Tensor, labels: torch.Tensor | None, target: torch.Tensor | None
) -> torch.Tensor:
    logits = head_logits(model, hidden)
    if labels is not None:
        return F.cross_entropy(logits, labels, reduction="sum")
    with torch.no_grad():
        reference = head_logits(model, target).log_softmax(-1)
    return F.kl_div(logits.log_softmax(-1), reference, log_target=True, reduction="sum")


def next_token_loss(
    model: LinearizeForCausalLM,
    hidden: torch.Tensor,
    labels: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    chunk: int = LOSS_CHUNK_TOKENS,
) -> torch.Tensor:
    """Mean next-token CE against `labels`, or KL to the logits of the teacher's hidden states `target`.

    hidden [B, T, H] predicts positions 1..T-1. Logits exist for `chunk` positions at a time and are
    recomputed in backward, so the [B, T, vocab] tensors of a full forward never exist.
    """
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = None if labels is None else labels[:, 1:].reshape(-1)
    target = None if target is None else target[:, :-1].reshape(-1, target.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(
            _chunk_loss,
            model,
            hidden[part],
            None if labels is None else labels[part],
            None if target is None else target[part],
            use_reentrant=False,
        )
    return total / hidden.shape[0]


def lora_finetune(
    student: LinearizeForCausalLM,
    data: torch.Tensor,
    stage: Stage,
    accelerator: Accelerator,
    work_dir: Path | None,
    shard: bool = False,
) -> StageResult:
    """Stage 2: LoRA on the swapped layers (CE, or KL to the teacher), merged into the weights after.

    The KL's teacher is the student itself with softmax attention restored and LoRA disabled.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    indices = [layer.layer_idx for layer in linear_attentions(student)]
    if stage.lora_layers == "all":  # the softmax layers too: they can take over what the linear ones lose at length
        indices = list(range(student.config.num_hidden_layers))
    family = family_of(student.base_model.config)
    targets = "|".join(stage.lora_targets or family.projections)
    prefix = rf"{student.base_model_prefix}\.layers\.({'|'.join(map(str, indices))})\.{family.attention}"
    pattern = rf"{prefix}\.({targets})"
    config = LoraConfig(r=stage.lora_rank, lora_alpha=stage.lora_alpha, lora_dropout=0.0, target_modules=pattern)
    for p in student.parameters():
        p.requires_grad_(False)
    peft_model = get_peft_model(student, config)
    params = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    linear = linear_attentions(student)
    checkpointing, per_pass, _ = finetune_memory_plan(student, stage, weight_bytes(student))
    if checkpointing:
        student.activation_checkpointing_enable({"use_reentrant": False})
        for layer in linear:  # and inside each recomputed layer, its linear path once more
            layer.checkpoint_linear = True
        logger.info("finetune: recomputing activations in backward (kept, they would outweigh the weights)")

    with final_hidden_states(student) as hidden:

        def step_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
            hidden.clear()
            model(input_ids=batch, use_cache=False, logits_to_keep=1)
            peft = accelerator.unwrap_model(model)  # the peft model itself, or its sharded twin
            if stage.loss == "ce":
                return next_token_loss(peft.get_base_model(), hidden[0], labels=batch)
            with torch.no_grad(), peft.disable_adapter(), teacher_attention(peft):
                model(input_ids=batch, use_cache=False, logits_to_keep=1)
            return next_token_loss(peft.get_base_model(), hidden[0], target=hidden[1])

        try:
            result = run_loop(
                "finetune", peft_model, params, data, stage, step_loss, accelerator, work_dir, per_pass, shard
            )
        finally:
            if checkpointing:
                student.activation_checkpointing_disable()
                for layer in linear:
                    layer.checkpoint_linear = False
    # The adapted projections get weights of their own before the merge, which writes into them in
    # place from peft 0.22 on: the frozen weights the teacher shares are never changed.
    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            base.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)
    merged = peft_model.merge_and_unload(safe_merge=True)
    for p in merged.parameters():
        p.requires_grad_(False)
    return result
