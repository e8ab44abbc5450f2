"""Decoding: what a step of generation needs beyond the general forward, eager and compiled.

- `split_decode_attention`: one CPU query over a long softmax cache, each KV head's cache read once.
- `COMPILED_STEP_OPTIONS`, `STEP_SIZES`, `symbolic_step_sizes`: how `LinearizeForCausalLM.compile_decoding`
  compiles the step once for every length.
The linear layers' own step (`LinearAttention._gla_step`) stays with the layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SPLIT_DECODE_MIN_KEYS = 2048  # shorter softmax caches keep SDPA's own kernel, as fast there
SPLIT_DECODE_BLOCKS = 8  # key blocks per KV head in split_decode_attention: work for every thread
SPLIT_DECODE = "linearize_split_decode"  # the name softmax layers see for SDPA (SoftmaxAttentionConfig)
# Inductor settings for the compiled decoding step (`compile_decoding`), each measured on 2 CPU cores:
COMPILED_STEP_OPTIONS = {
    # Its locality pass moves the reads of a ring's leaving token after the new token's write, and a
    # slot written before its old value is read is a copy of the whole ring: 786 KB per layer and token.
    "reorder_for_locality": False,
    # Dynamo's guards already check each input's size and strides before the graph runs.
    "size_asserts": False,
    "alignment_asserts": False,
    # Lets the C++ compiler fuse each multiply-and-add into one FMA: the fused GEMVs' inner loop is one
    # instruction shorter: 33.2 against 34.7 ms per all-linear step (results move by rounding only).
    "cpp.enable_floating_point_contract_flag": "fast",
    # Element-wise chains of more than 8 ops are stored once instead of recomputed inside their reader's
    # loop (inductor's CPU default is 50). Otherwise a GEMV recomputes its input per weight row (the
    # window/state mix before o_proj, the RMSNorm before q/k/v and the head) and the window scores
    # recompute the rotary cos/sin per key: 32.9 against 34.7 ms per all-linear step with the settings
    # above (6 does as well as 8; 3, 10, 12 and 16 are slower).
    "realize_opcount_threshold": 8,
}
# The sizes a decoding step reads from the cache and that change as it decodes: a linear layer's token count,
# a softmax layer's filled length and its room's capacity. Dynamo specializes such a size the first time and
# makes it symbolic only when it changes, so the second step, and a room's first growth, compiled a graph of
# their own (each 1.5-2 minutes for the default's step on 2 cores from a cold cache). Listed as Dynamo's
# `dynamic_sources` (regexes over the inputs' sources, `:N` a tensor's dim), they are symbolic from the first.
STEP_SIZES = r".*\]\.seen$,.*\]\.filled$,.*\]\.room\[[01]\]:2"


def symbolic_step_sizes(step: Callable) -> Callable:
    """`step` (a compiled decoding step) run with STEP_SIZES among Dynamo's dynamic sources, so its first
    graph already takes the cache's changing sizes as symbols; a torch without that setting compiles as before."""
    config = torch.compiler.config
    if not hasattr(config, "dynamic_sources"):
        return step

    @functools.wraps(step)
    def run(*args, **kwargs):
        with config.patch(dynamic_sources=",".join(filter(None, (config.dynamic_sources, STEP_SIZES)))):
            return step(*args, **kwargs)

    return run


def split_decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except one unmasked CPU query over a long cache: key blocks apart, then merged.

    For a single query PyTorch's CPU SDPA works per query head, so each KV head's cache is read once
    per query head of its group (3 times for SmolLM2), and past the last-level cache (16K tokens:
    25 MB per layer) that costs. Here each KV head's group scores its cache once, in
    SPLIT_DECODE_BLOCKS blocks (views of the cache rows) that keep every thread busy, and the
    blocks' softmaxes merge by their maxima and sums, as flash-decoding does: the 3:1 student's
    step at 16K took 66 ms against 70 ms on 2 cores. Inside a compiled step (any length) the group's
    queries are one product with its cache instead, which inductor leaves to BLAS: 1.4 ms against
    SDPA's 2.1 ms at 16K. Anything else (masks, several queries, soft-capping, sinks, GPUs) is SDPA's.
    """
    B, H, Q, D = query.shape
    Hkv, T = key.shape[1], key.shape[2]
    compiling = torch.compiler.is_compiling()
    if (
        Q != 1
        or attention_mask is not None
        or dropout
        or (T < SPLIT_DECODE_MIN_KEYS and not compiling)
        or query.device.type != "cpu"
        or H % Hkv
        or any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sliding_window", "position_bias"))
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    group, Dv = H // Hkv, value.shape[-1]
    q = (query.reshape(B, Hkv, group, D) * (D**-0.5 if scaling is None else scaling)).to(key.dtype)
    if compiling:
        weights = torch.matmul(q, key.transpose(-1, -2)).float().softmax(-1)
        out = torch.matmul(weights.to(value.dtype), value)
        return out.reshape(B, H, 1, Dv).transpose(1, 2), None
    blocks = SPLIT_DECODE_BLOCKS
    even = T // blocks * blocks
    out = query.new_empty(B, Hkv, group, Dv)
    for b in range(B):  # per KV head: its cache rows are contiguous, so the blocks are views, not copies
        for h in range(Hkv):
            parts = [(blocks, key[b, h, :even], value[b, h, :even])] + ([(1, key[b, h, even:], value[b, h, even:])] if even < T else [])
            maxima, sums, outs = [], [], []
            for n, k, v in parts:
                scores = torch.bmm(q[b, h].expand(n, group, D), k.reshape(n, -1, D).transpose(1, 2)).float()
                top = scores.amax(-1, keepdim=True)
                weights = (scores - top).exp_()
                maxima.append(top)
                sums.append(weights.sum(-1, keepdim=True))
                outs.append(torch.bmm(weights.to(v.dtype), v.reshape(n, -1, Dv)).float())
            top, total, partial = (torch.cat(x) for x in (maxima, sums, outs))
            rescale = (top - top.amax(0)).exp()
            out[b, h] = (partial * rescale).sum(0) / (total * rescale).sum(0)
    return out.view(B, H, 1, Dv).transpose(1, 2), None


AttentionInterface.register(SPLIT_DECODE, split_decode_attention)
