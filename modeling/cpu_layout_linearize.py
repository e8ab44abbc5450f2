"""CPU weight layouts for decoding: a step is one GEMV per weight, and PyTorch's runs on one core.

`lay_out_for_cpu_decode` (called by `LinearizeForCausalLM` before eager CPU generation, undone before a
compiled step or a save) stores large weights column-major and swaps plain linears for
`SplitGemvLinear`, joins the weights that read one input (a linear layer's projections, a gated
MLP's gate and up) into one tensor, and leaves values, parameter objects and tying unchanged.
Everything else (GPUs, training, large batches) takes `nn.Linear`'s own path.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SPLIT_GEMV_MIN = 1 << 16  # weights with fewer elements than this stay as they are (SplitGemvLinear)
SPLIT_GEMV_ROWS = 64  # up to this many rows (decoding batches) the split product beat the library's GEMM here


def split_gemv(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ columns [in, out] (contiguous: a column-major weight's transpose) -> [rows, out], as one
    batched product over as many slices of the input dimension as there are threads, then summed (see
    `SplitGemvLinear`). One row, the usual decoding step, is sliced by a single view: every op counts there."""
    width, out = columns.shape
    parts = math.gcd(width, torch.get_num_threads())
    rows = x.numel() // width
    slices = x.reshape(parts, 1, -1) if rows == 1 else x.reshape(rows, parts, -1).transpose(0, 1)
    return torch.bmm(slices, columns.view(parts, -1, out)).sum(0)


class SplitGemvLinear(nn.Linear):
    """`nn.Linear` whose decoding-sized products without autograd on CPU take the layout's fastest path.

    A decoding step on CPU is one GEMV per weight, and PyTorch runs it on one core: over the usual
    row-major [out, in] weight it read ~10 GB/s on 2 cores here (SmolLM2's MLP, and 13 ms of a
    ~80 ms step for the 49K x 576 output head alone).
    - Eager: the same weight stored column-major (the parameter keeps its shape, only its strides
      change) and multiplied as `threads` batched slices of its input dimension, summed, reads
      20-35 GB/s, and stays ahead for batches up to SPLIT_GEMV_ROWS rows.
    - Compiled (`LinearizeForCausalLM.compile_decoding`, weights row-major): one row is a multiply and
      a sum over the input dimension, which inductor fuses into one reduction over all threads, at
      every size. The library's GEMV over the same row-major weight varies far more between CPUs:
      on SmolLM2's 49K x 576 head it read 26.2 GB/s on one machine (inductor's 23.7) and 11.2 GB/s
      on another (inductor's 31.2), where it cost 7 ms of a 31 ms all-linear step.
    Anything else (autograd, more rows, another device) takes `nn.Linear`'s own path.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        rows = x.numel() // self.in_features
        if x.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return super().forward(x)
        if torch.compiler.is_compiling():
            if rows != 1 or not weight.is_contiguous():
                return super().forward(x)
            y = (weight * x.reshape(1, -1)).sum(-1)
        else:
            columns = weight.t()
            if math.gcd(self.in_features, torch.get_num_threads()) == 1 or rows > SPLIT_GEMV_ROWS or not columns.is_contiguous():
                return super().forward(x)
            y = split_gemv(x, columns)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def fusable(linears: tuple[nn.Module, ...]) -> bool:
    """Whether these are plain linears with floating-point CPU weights of one dtype (`fuse_columns` can join them)."""
    dtype = linears[0].weight.dtype
    return all(
        type(m) in (nn.Linear, SplitGemvLinear) and m.weight.device.type == "cpu" and m.weight.is_floating_point() and m.weight.dtype == dtype
        for m in linears
    )


def fuse_columns(linears: tuple[nn.Module, ...]) -> torch.Tensor:
    """One column-major [in, sum of outs] tensor whose column slices become the weights of `linears` (`fusable`
    ones reading one input), so a decoding step's `split_gemv` over it replaces one product each. Values and
    parameter objects are unchanged (only `.data`); `lay_out_for_cpu_decode` gives each its own tensor back."""
    weights = [m.weight for m in linears]
    columns = torch.cat([w.detach() for w in weights], dim=0).t().contiguous()
    start = 0
    for weight in weights:
        weight.data = columns[:, start : start + weight.shape[0]].t()
        start += weight.shape[0]
    return columns


def columns_serve(columns: torch.Tensor, linears: tuple[nn.Module, ...], x: torch.Tensor) -> bool:
    """Whether a product over `columns` may stand in for `linears` on input x: an eager step of few rows in the
    columns' dtype, without autograd (inside a compiled graph the weights are row-major and fuse there)."""
    return not (
        torch.compiler.is_compiling()
        or x.numel() > SPLIT_GEMV_ROWS * columns.shape[0]
        or x.dtype != columns.dtype
        or (torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in linears)))
    )


def still_fused(columns: torch.Tensor, linears: tuple[nn.Module, ...]) -> bool:
    """Whether the weights of `linears` are still `columns`' slices, in order (a `.to()` or a load replaces them)."""
    start = columns.data_ptr()
    for m in linears:
        if m.weight.data_ptr() != start:
            return False
        start += m.weight.shape[0] * columns.element_size()
    return True


class GateUpMLP(nn.Module):
    """The family's gated MLP, down(act(gate(x)) * up(x)), whose eager CPU decoding step (few rows, no autograd)
    computes gate and up as one split GEMV over their weights side by side (`gate_up_columns`, laid out by
    `lay_out_for_cpu_decode`): one product a layer fewer, each costing tens of µs beyond its bytes on a
    CPU. Anything else, and every family whose MLP is not that formula, runs the family's forward."""

    gate_up_columns: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        columns = self.gate_up_columns
        parts = (self.gate_proj, self.up_proj)
        if columns is None or not columns_serve(columns, parts, x):
            return super().forward(x)
        if not still_fused(columns, parts):
            self.gate_up_columns = None
            return super().forward(x)
        gate, up = split_gemv(x, columns).view(*x.shape[:-1], -1).chunk(2, dim=-1)
        if self.gate_proj.bias is not None:
            gate, up = gate + self.gate_proj.bias, up + self.up_proj.bias
        return self.down_proj(self.act_fn(gate) * up)


_GATE_UP_CLASSES: dict[type, type | None] = {}


@torch.no_grad()
def gate_up_mlp_class(mlp: nn.Module) -> type | None:
    """`GateUpMLP` over this MLP's class where the class computes exactly down(act(gate(x)) * up(x)) (checked once
    per class, on this module and a random row), else None."""
    base = type(mlp)
    gate, up, down = (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    linears = all(isinstance(m, nn.Linear) for m in (gate, up, down))
    if not (linears and callable(getattr(mlp, "act_fn", None)) and fusable((gate, up)) and (gate.bias is None) == (up.bias is None)):
        return None  # not this layout, or not fusable as placed (offloaded, quantized): no verdict on the class
    if issubclass(base, GateUpMLP):
        return base
    if base not in _GATE_UP_CLASSES:
        x = torch.randn(1, 1, gate.in_features, generator=torch.Generator().manual_seed(0), device="cpu").to(gate.weight.dtype)
        exact = torch.equal(base.forward(mlp, x), down(mlp.act_fn(gate(x)) * up(x)))
        _GATE_UP_CLASSES[base] = type(f"GateUp{base.__name__}", (GateUpMLP, base), {}) if exact else None
    return _GATE_UP_CLASSES[base]


class FusedProjections:
    """q/k/v (and the low-rank gate's first projection) as one column-major tensor for eager CPU steps,
    mixed into `LinearAttention`, whose `_project` asks `_fused_project` first."""

    qkv_columns: torch.Tensor | None = None  # q/k/v_proj's weights as one tensor (`lay_out_projections`)
    fused_parts: tuple[nn.Module, ...] = ()  # the linears whose weights are its column slices, in order

    def lay_out_projections(self, fused: bool) -> None:
        """With `fused`, q/k/v_proj's weights become column slices of one column-major [in, q + k + v] tensor,
        `qkv_columns`, so an eager CPU decoding step projects with one split GEMV instead of three: 1.6 ms
        off a 46 ms 3:1 step at 1K on 2 cores (each GEMV also pays to wake the threads). The low-rank gate's
        first projection reads the same input, so it joins as further columns (`fused_parts` lists them all).
        The parameters keep their objects and values (only `.data` changes, as in `lay_out_for_cpu_decode`,
        which also gives each its own row-major tensor back). Only plain linears on the CPU fuse."""
        self.qkv_columns, self.fused_parts = None, ()
        if not fused or self.family.qkv != "separate":
            return
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if not fusable(parts) or len({proj.bias is None for proj in parts}) != 1:
            return
        down = getattr(getattr(self, "gate", None), "down", None)  # a low-rank gate's first projection
        if isinstance(down, nn.Linear) and down.bias is None and fusable((*parts, down)):
            parts = (*parts, down)
        self.qkv_columns, self.fused_parts = fuse_columns(parts), parts

    def _fused_project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """(q, k, v, the low-rank gate's first projection or None), each [B, T, width], from one split GEMV over
        `qkv_columns` where it serves (an eager step of few rows without autograd), else None. Once the parameters
        are no longer its slices (a `.to()` or a load replaced their tensors) it is stale, and dropped."""
        columns = self.qkv_columns
        if columns is None or not columns_serve(columns, self.fused_parts, hidden_states):
            return None
        if not still_fused(columns, self.fused_parts):
            self.qkv_columns, self.fused_parts = None, ()
            return None
        B, T = hidden_states.shape[:2]
        q, k, v, *rest = split_gemv(hidden_states, columns).view(B, T, -1).split([p.weight.shape[0] for p in self.fused_parts], -1)
        if self.q_proj.bias is not None:
            q, k, v = q + self.q_proj.bias, k + self.k_proj.bias, v + self.v_proj.bias
        return q, k, v, rest[0] if rest else None


def lay_out_for_cpu_decode(model: nn.Module, column_major: bool, smallest: int | None = None) -> None:
    """Make the CPU linear layers of `smallest` (default SPLIT_GEMV_MIN) elements or more `SplitGemvLinear`s,
    their weights column-major (eager decoding) or row-major. Column-major, the weights that read one input
    are also joined into one tensor: a linear layer's projections (`LinearAttention.lay_out_projections`)
    and a gated MLP's gate and up (`GateUpMLP`); row-major, each has its own tensor again.

    Values, parameter objects and tying are unchanged (only `.data` is replaced), so optimizers and
    tied heads keep working; saving wants row-major tensors, so `save_pretrained` puts them back.
    Only plain `nn.Linear` layers with floating-point weights change: subclasses (quantized layers)
    own their weights' layout.
    """
    smallest = SPLIT_GEMV_MIN if smallest is None else smallest
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) not in (nn.Linear, SplitGemvLinear) or not weight.is_floating_point() or weight.device.type != "cpu":
            continue
        if not column_major and not weight.is_contiguous():  # any size: fused q/k/v slices (`lay_out_projections`) too
            weight.data = weight.data.contiguous()
        if weight.numel() < smallest:
            continue
        if column_major and not weight.t().is_contiguous():
            weight.data = weight.data.t().contiguous().t()
        module.__class__ = SplitGemvLinear
    for module in model.modules():
        if hasattr(module, "lay_out_projections"):  # a LinearAttention: its q/k/v (and gate) read one input
            module.lay_out_projections(fused=column_major)
        elif isinstance(module, GateUpMLP) and not column_major:
            module.gate_up_columns = None
        elif column_major and (gated := gate_up_mlp_class(module)) is not None:
            module.__class__ = gated
            module.gate_up_columns = fuse_columns((module.gate_proj, module.up_proj))
