"""Data parallelism for the training stages: DDP, or FSDP2 sharding, whichever the launch asked for.

`linearize --fsdp` under a multi-process launch (`accelerate launch --multi_gpu --num_processes N`),
or `accelerate launch --use_fsdp` on GPUs, shards the weights over the N processes while each stage
trains, on GPUs (NCCL) and CPUs (gloo) alike; any other multi-process launch replicates them (DDP).
accelerate wraps models in FSDP only on accelerators (its FSDP plugin refuses a CPU) and by its own
wrapping rules, so linearize shards with torch's `fully_shard` itself: every decoder layer is one
unit, the root holds the rest (embeddings, final norm, head).

Stage 1's losses are local to each linear layer and reach no layer's output (so neither DDP's nor
FSDP's backward hooks would see them). There (`local_losses`) each linear layer backpropagates its
own loss at the end of its forward, while its layer's weights are gathered; the new parameters it
trains stay whole on every process, and their gradients are averaged once per step. One layer's
activations (and, sharded, one layer's weights) exist at a time, and nothing is recomputed.

A sharded stage trains a twin of the module. The module gives its tensors to the twin and keeps
empty ones, so a tensor nobody else holds (the pipeline drops its teacher) exists only as each
process's shard; when the stage ends, the trained full tensors go back into the module, so what
comes after (merging LoRA, perplexity, export) sees an ordinary model.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import parse_flag_from_env
from torch.distributed.tensor import DTensor, distribute_tensor

from ..modeling.modeling_linearize import LinearizeForCausalLM, linear_attentions


def sharding_requested(asked: bool | None) -> bool:
    """`asked` (the `--fsdp` flag), or by default whether the launch was for FSDP (`accelerate launch --use_fsdp`)."""
    return parse_flag_from_env("ACCELERATE_USE_FSDP") if asked is None else asked


@dataclass
class Parallel:
    """What a stage steps: the model to call, its trainable tensors as the optimizer sees them."""

    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    sharded: bool
    accelerator: Accelerator
    local_losses: bool = False  # each linear layer backpropagates its own loss inside its forward
    scale: float = 1.0  # this pass's share of the step: what a local loss is backpropagated with

    def backward(self, loss: torch.Tensor) -> None:
        if not self.local_losses:
            self.accelerator.backward(loss)

    def reduce_gradients(self) -> None:
        """Average the gradients of whole (unsharded) trainable tensors over the processes, once per step."""
        if not self.local_losses or self.accelerator.num_processes == 1:
            return
        for p in self.params.values():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(self.accelerator.num_processes)

    def backward_here(self, layer: torch.nn.Module, args, output) -> None:
        """Forward hook of a linear layer: its transfer loss is backpropagated now, while its weights are gathered."""
        loss = layer.transfer_loss
        if loss is not None and loss.requires_grad:
            (loss * self.scale).backward()
            layer.transfer_loss = loss.detach()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradients of this pass stay local; the last pass of a step reduces them all."""
        if self.sharded:
            return _gradient_sync_off(self.model)
        return self.accelerator.no_sync(self.model)

    def weight_bytes_per_process(self) -> int:
        return sum(local(p).numel() * p.element_size() for p in self.model.parameters())


@contextmanager
def _gradient_sync_off(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (all of it, unless it is a shard)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor; for a shard this gathers it, so every process must call it."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A full tensor laid out as `reference` is: this process's shard of it when `reference` is sharded."""
    if isinstance(reference, DTensor) and value.shape == reference.shape:
        return distribute_tensor(value.to(reference.device), reference.device_mesh, reference.placements)
    return value


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers inside a student, its decoder, or a peft model around it (none for other modules)."""
    for inner in module.modules():
        if isinstance(inner, LinearizeForCausalLM):
            return list(inner.base_model.layers)
    layers = getattr(module, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


@contextmanager
def data_parallel(
    module: torch.nn.Module,
    params: dict[str, torch.nn.Parameter],
    accelerator: Accelerator,
    shard: bool = False,
    local_losses: bool = False,
) -> Iterator[Parallel]:
    """The module ready for this launch's data parallelism for the length of a stage; `shard`: FSDP2.

    `local_losses`: the stage's loss is the linear layers' `transfer_loss` (stage 1)."""
    sharded = shard and accelerator.num_processes > 1
    if sharded:
        model, params, restore = _shard(module, params, accelerator, local_losses)
    elif local_losses:  # replicated by hand: the gradients are averaged once per step, no DDP hooks
        model, restore = module, None
    else:
        model, restore = accelerator.prepare(module), None
    parallel = Parallel(model, params, sharded, accelerator, local_losses)
    hooks = [layer.register_forward_hook(parallel.backward_here) for layer in linear_attentions(model)] if local_losses else []
    yield parallel
    for hook in hooks:
        hook.remove()
    if restore is not None:
        restore()


def _shard(
    module: torch.nn.Module, params: dict[str, torch.nn.Parameter], accelerator: Accelerator, local_losses: bool
) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter], Callable[[], None]]:
    """(the sharded twin, its trainable tensors under `params`' names, what puts the trained whole tensors back)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    originals = dict(module.named_parameters(remove_duplicate=False))
    inside = {id(p): name for name, p in originals.items()}  # `params` may be named from an outer model
    tensors = {name: p.data for name, p in originals.items()}
    for p in originals.values():
        p.data = p.data.new_empty(0)
    twin = copy.deepcopy(module)
    for name, p in twin.named_parameters(remove_duplicate=False):
        p.data = tensors[name]
    del tensors
    twins = dict(twin.named_parameters(remove_duplicate=False))
    whole = {twins[inside[id(p)]] for p in params.values()} if local_losses else None
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for layer in decoder_layers(twin):
        fully_shard(layer, mesh=mesh, ignored_params=whole)
    fully_shard(twin, mesh=mesh, ignored_params=whole)
    shards = dict(twin.named_parameters(remove_duplicate=False))

    def restore() -> None:
        """Each tensor whole again in the module (gathered on every process), the twin's trained values."""
        gathered: dict[int, torch.Tensor] = {}
        for name, p in twin.named_parameters(remove_duplicate=False):
            if id(p) not in gathered:
                gathered[id(p)] = full(p).detach()
            originals[name].data = gathered[id(p)]

    return twin, {name: shards[inside[id(p)]] for name, p in params.items()}, restore
