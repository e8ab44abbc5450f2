"""Modes a converted model runs in for a while: what conversion and evaluation switch on and off.

Each is a context manager over the model's linear layers (`linear_attentions`), so it works through
any wrapper (peft, accelerate, FSDP2) and always restores the layers, also when the body raises.
These are for the lab, not for the exported remote code: an export always runs its linear layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .modeling_linearize import LinearAttention, linear_attentions


@contextmanager
def transfer_mode(model: torch.nn.Module, late_weight: float = 0.0) -> Iterator[tuple[LinearAttention, ...]]:
    """Linear layers compute, record and pass on the teacher's softmax output while inside (stage 1).

    `late_weight` tilts each layer's MSE toward late positions (`LinearAttention.transfer_late_weight`).
    """
    layers = linear_attentions(model)
    for layer in layers:
        layer.transfer, layer.transfer_late_weight = True, late_weight
    try:
        yield layers
    finally:
        for layer in layers:
            layer.transfer, layer.transfer_loss, layer.transfer_late_weight = False, None, 0.0


@contextmanager
def teacher_attention(model: torch.nn.Module) -> Iterator[None]:
    """Linear layers run the teacher's softmax forward while inside: with LoRA disabled, the student is its teacher.

    One set of frozen weights thus serves both models (stage 2's KL target, the teacher's perplexity).
    """
    layers = linear_attentions(model)
    for layer in layers:
        layer.teacher_attention = True
    try:
        yield
    finally:
        for layer in layers:
            layer.teacher_attention = False


def check_state_off(linear: bool, mixless: list[str]) -> None:
    """Refuse the state-off control in one line: a model without linear layers (`linear` false), or one whose
    linear layers of the kinds in `mixless` do not mix their state with a softmax window."""
    if not linear:
        raise ValueError("--control state-off needs a converted model with linear layers: this one has none")
    if mixless:
        raise ValueError(
            f"--control state-off switches off the state of layers that mix it with a softmax window, and this model's "
            f"{', '.join(sorted(set(mixless)))} layers have no such mix: use it on a GLA or deltanet export with a window"
        )


def state_off_layers(model: torch.nn.Module) -> tuple[LinearAttention, ...]:
    """The linear layers `state_off` switches, or a one-line error when the control cannot apply."""
    layers = linear_attentions(model)
    check_state_off(bool(layers), [layer.kind for layer in layers if not hasattr(layer, "window_factor")])
    return layers


@contextmanager
def state_off(model: torch.nn.Module) -> Iterator[None]:
    """Every linear layer attends with its window and sinks only, while inside: what the linear state carries.

    A layer mixes the state's terms and the window's (sinks included) by sigmoid(window factor) per head;
    an infinite factor gives the window weight exactly 1 and the state 0 (the delta rule's added form
    weighs its state by sigmoid(-factor) = 0), on every path, decoding included.
    """
    layers = state_off_layers(model)
    saved = [layer.window_factor.detach().clone() for layer in layers]
    with torch.no_grad():
        for layer in layers:
            layer.window_factor.fill_(float("inf"))
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, factor in zip(layers, saved):
                layer.window_factor.copy_(factor)
