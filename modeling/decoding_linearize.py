"""Decoding: what a step of generation needs beyond the general forward, eager and compiled.

- `DecodingStep`: a linear layer's one-token steps (the mixin `LinearAttention` takes them from), written
  for op count, with the window's ring written in place: `_gla_step` for GLA with a window, `_ring_step`
  for the window of any other kind.
- `derived`: transforms of parameters an eager step would otherwise recompute every token.
- `split_decode_attention`: one CPU query over a long softmax cache, each KV head's cache read once.
- `DecodingRuntime`: how `LinearizeForCausalLM` (which mixes it in) runs a step: the compiled graph of
  `compile_decoding` (COMPILED_STEP_OPTIONS, with the cache's changing sizes symbolic: STEP_SIZES), or
  the eager step, in inference mode when it only writes the cache in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..kernels.feature_maps import hedgehog_step
from ..kernels.ops import gated_linear_attention
from ..kernels.window_torch import sink_leaving, sink_visibility, window_step_terms
from .cache_linearize import LinearizeCacheLayer, ReservedDynamicLayer, has_state, record_seen, tokens_seen
from .cpu_layout_linearize import lay_out_for_cpu_decode
from .configuration_linearize import STATES

Derived = TypeVar("Derived")

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


def derived(owner: nn.Module, name: str, sources: tuple[torch.Tensor, ...], make: Callable[[], Derived]) -> Derived:
    """`make()`, kept on `owner` as `name` until a source is replaced or changed in place: a fixed transform of
    parameters that an eager decoding step would otherwise recompute, one op per layer and token each.

    The cache keeps the sources' storage alive, so a replacement cannot reuse its address unnoticed. What is
    made with autograd on (it must carry gradients), inside a compiled graph (which must not write the module)
    or from inference tensors (weights loaded under `torch.inference_mode`, as accelerate's offload hooks do:
    they keep no version) is made each call.
    """
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(t.is_inference() for t in sources):
        return make()
    key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in sources)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, tuple(t.detach() for t in sources), make())
        owner.__dict__[name] = cached
    return cached[2]


def ring_slot(position: int, window: int, device: torch.device) -> slice | torch.Tensor:
    """Where a decoding step's token goes in a ring of `window` slots: eager, a slice; in a compiled graph, a
    one-element index, as a slice at a symbolic offset makes inductor guard on that offset being 0 (reinplace's
    overlap check), and the graph would compile again the first time the ring wraps to slot 0."""
    slot = position % window
    return torch.full((1,), slot, device=device) if torch.compiler.is_compiling() else slice(slot, slot + 1)


def padding_free(attention_mask: torch.Tensor, tokens: int) -> bool:
    """Whether the last `tokens` of a 2D mask are all real, where finding out costs no device sync (a CPU mask,
    no autograd): the eager step then reads and writes no validity (`DecodingStep._gla_step`). Elsewhere False."""
    return not torch.is_grad_enabled() and attention_mask.device.type == "cpu" and bool(attention_mask[:, -tokens:].all())


def sinks_settled(last_sink: int | None, start: int, window: int, step: bool) -> bool:
    """Whether every sink is full and older than the oldest token leaving a window of `window` at `start`: all
    visible, none entering the state, so a step needs no positions. A compiled step (`step`) applies the masks
    anyway (then all true): a test of the position would split its graph."""
    return not (step and torch.compiler.is_compiling()) and last_sink is not None and last_sink < start - window


class DecodingStep:
    """A linear layer's one-token steps, mixed into `LinearAttention`, whose settings (`kind`, `window`, `sink`, ...)
    and general helpers (`_state`, `_store`, `_decay`, `_query_features`, `_key_features`, `_share_normalizer`)
    they read: `_gla_step`, the whole step of a GLA layer with a window, nothing cloned; `_ring_step`, the
    window's part of any other kind's step, its ring written in place.
    """

    def _ring_step(self, ring, ring_extra, ring_valid, q, k, v, extra, valid, sinks, positions, start: int):
        """One token through the window's ring (`LinearAttention._through_window`, which hands over the cached ring,
        its extra payload and validity): the leaving token's key, value, extra payload and validity are read from its
        slot, the new token is written there, and the window's softmax terms are computed over the ring.
        `positions` is None once the sinks are settled (all visible). Returns (k_out, v_out, extra_out, valid_out,
        window terms)."""
        here, extra_out = ring_slot(start, self.window, q.device), None
        (k_out, v_out), valid_out = ring[:, :, :, here].clone().unbind(2), ring_valid[:, here].clone()
        ring[:, :, :, here], ring_valid[:, here] = torch.stack([k, v], dim=2), valid
        if extra is not None:
            extra_out = ring_extra[:, :, here].clone()
            ring_extra[:, :, here] = extra
        visible = None if sinks is None or positions is None else sink_visibility(sinks[2], positions, self.window)[:, 0, 0, 0]
        terms = window_step_terms(q, ring[:, :, 0], ring[:, :, 1], ring_valid, self.scaling, sinks and sinks[:2], visible)
        return k_out, v_out, extra_out, valid_out, terms

    def _step_features(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """phi(q) and phi(k) of one decoding step (`_gla_step`, no autograd). Eager, Hedgehog's two maps run as one:
        the query heads and key heads side by side through one product and one softmax, over their signed weights
        joined once (`derived`), where two maps take twice the ops (each op of a CPU step costs µs)."""
        maps = (self.feature_map_q, self.feature_map_k) if self.map_name == "hedgehog" else ()
        sources = tuple(t for m in maps for t in (m.weight, m.bias))
        # Offloaded maps (accelerate's hooks on each module) hold their weights only inside their own forward.
        if not maps or torch.compiler.is_compiling() or any(t.device != q.device or t.dtype != q.dtype for t in (k, *sources)):
            return self._query_features(q), self._key_features(k)
        weight, bias = derived(
            self, "_paired_maps_cache", sources, lambda: tuple(torch.cat(pair) for pair in zip(maps[0].signed(), maps[1].signed()))
        )
        return hedgehog_step(torch.cat([q, k], dim=1), weight, bias).split([q.shape[1], k.shape[1]], dim=1)

    def _has_gla_step(self) -> bool:
        """Whether this layer's kind and settings have `_gla_step` (GLA, a window, the shared normalizer)."""
        return (
            self.kind == "gla"
            and bool(self.window)
            and self.normalize
            and self.map_name != "performer"
            and not self.conv_size
            and self.form is None
        )

    def _steps_in_place(self, layer, cache, start: int) -> bool:
        """Whether a one-token step can take `_gla_step`: GLA with a window and the shared normalizer,
        no gradient, a running state and ring, and sinks (if any) full."""
        if not self._has_gla_step() or torch.is_grad_enabled():
            return False
        if self._state(cache, "memory") is None or self._state(cache, "window_kv") is None:
            return False
        return not self.sink or layer.last_sink is not None

    def _gla_step(self, hidden_states, q, k, v, q_feat, k_feat, padding, layer, cache, start, low_rank=None):
        """One decoding token of a GLA layer whose window runs: what `_attend` computes, with nothing cloned.

        On a CPU a decoding step's small ops cost ~10 µs each against ~1 µs of math (measured on 2
        cores, weights streaming between them), so the step is written for op count: the token that
        leaves the ring enters the state (updated in place) before the new token takes its slot, its
        value read where it lies (a padding token adds nothing: its key features are zeroed), and the
        sinks are read as cached. Eager, when the token and every token in the ring are real (no padding
        since `valid_since`, see `padding_free`), no validity is read or written. While sinks are still
        inside the window (a prompt shorter than sinks + window), the ring holds them too: their own copies
        stay hidden until they leave it, and a sink leaving the ring does not enter the state. A compiled
        step always applies these masks (all true later), so one graph serves both.
        """
        here = ring_slot(start, self.window, q.device)
        ring, ring_valid = self._state(cache, "window_kv"), self._state(cache, "window_valid")
        unrotated = self._state(cache, "window_payload") if k_feat is not k else None
        compiling = torch.compiler.is_compiling()
        all_valid = (  # not in a compiled graph: guards on the position would recompile it
            padding is None and not compiling and start - self.window >= layer.valid_since
        )
        keep = None if all_valid else ring_valid[:, None, here, None]  # the leaving token is real (not padding)
        visible = None  # [B, S]: which sinks the query sees (None: all)
        if self.sink and (compiling or layer.last_sink >= start - self.window):
            sink_positions, position = self._state(cache, "sink_positions"), torch.full((1,), start, device=q.device)
            visible = sink_visibility(sink_positions, position, self.window)[:, 0, 0, 0]
            not_sink = ~sink_leaving(sink_positions, position, self.window)[:, None, :, None]
            keep = not_sink if keep is None else keep & not_sink
        leaving = ring[:, :, 0, here] if unrotated is None else unrotated[:, :, here]
        g = self._decay(hidden_states, k, low_rank)
        memory = self._state(cache, "memory")
        fq, leaving = self._step_features(q_feat, leaving)
        o, state = gated_linear_attention(
            fq,
            leaving if keep is None else leaving * keep,
            ring[:, :, 1, here],
            g if g is None or keep is None else g * keep,
            scale=self.scaling if self.map_name == "identity" else 1.0,
            normalize=True,
            divide=False,
            initial_state=memory,
            mode="recurrent",
        )
        if state is not memory:
            self._store(cache, "memory", state)
        ring[:, :, :, here] = torch.stack([k, v], dim=2)
        if not all_valid:
            ring_valid[:, here] = True if padding is None else padding[:, -1:].bool()
        if unrotated is not None:
            unrotated[:, :, here] = k_feat
        sinks = self._state(cache, "sink_kv") if self.sink else None
        win, _ = window_step_terms(
            q,
            ring[:, :, 0],
            ring[:, :, 1],
            None if all_valid else ring_valid,
            self.scaling,
            None if sinks is None else sinks.unbind(2),
            visible,
        )
        record_seen(layer, start + 1)
        return self._share_normalizer(o, win)


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


class DecodingRuntime:
    """How `LinearizeForCausalLM` runs a decoding step (one token, a cache, no gradient): mixed into it.

    `_decoding_path` picks the step's forward: the graph of `compile_decoding` once it is asked for and
    the linear layers have settled, else the eager forward, on a CPU over weights laid out for one-row
    products (`cpu_layout_linearize`). A step that only writes the cache in place runs in inference mode
    (`_run_step`). Weights return to row-major before training and saving.
    """

    def _decoding_path(self, cache: Cache | None, embeds: torch.Tensor | None) -> tuple[Callable, bool]:
        """(the forward to run, whether it writes the cache only in place) for these new tokens."""
        step = embeds is not None and embeds.shape[1] == 1 and not self.training and not torch.is_grad_enabled()
        forward, in_place = self._forward, False
        if step and self.compiled_step is not None and cache is not None and self._settled(cache):
            forward = self.compiled_step
            # Eagerly, a full room grows: the graph only writes in place.
            for layer in cache.layers:
                if isinstance(layer, ReservedDynamicLayer) and layer.is_initialized:
                    layer.reserve_before_graph()
            in_place = self._step_writes_in_place(cache)
        elif step:
            if not self.cpu_decode_layout and self.compiled_step is None and self.device.type == "cpu":
                lay_out_for_cpu_decode(self, column_major=True)
                self.cpu_decode_layout = True
            in_place = cache is not None and self._step_writes_in_place(cache)
            if in_place:
                for layer in cache.layers:  # the token's room, made outside inference mode
                    if isinstance(layer, ReservedDynamicLayer):
                        layer.reserve(1)
        return forward, in_place

    @staticmethod
    def _run_step(forward: Callable, args: tuple, kwargs: dict):
        """A step that writes the cache only in place, in inference mode, its outputs copied out.

        Inference mode spares each of the step's ~5,000 small ops its autograd bookkeeping (45.1 against
        49.4 ms an eager 3:1 step at 1K on 2 cores; 30.0 against 30.6 ms a compiled all-linear one). Nothing it
        makes may outlive it: the cache is only written in place, and the outputs leave as copies.
        """
        with torch.inference_mode():
            out = forward(*args, **kwargs)
        for key, value in out.items():
            if isinstance(value, torch.Tensor):
                out[key] = value.clone()
            elif isinstance(value, tuple):
                out[key] = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in value)
        return out

    def _step_writes_in_place(self, cache: Cache) -> bool:
        """Whether this decoding step can make no cache tensor: every linear layer takes `LinearAttention._gla_step`
        (state, ring and sinks settled, all written in place; other kinds store new states) and every softmax
        layer is a started `ReservedDynamicLayer`, whose room for the token the caller makes first."""
        for attention in self.linear_attentions:
            layer = cache.layers[attention.layer_idx]
            if not attention._steps_in_place(layer, cache, tokens_seen(layer)):
                return False
        return all(
            isinstance(layer, LinearizeCacheLayer) or (isinstance(layer, ReservedDynamicLayer) and layer.is_initialized)
            for layer in cache.layers
        )

    def compile_decoding(self, **options):
        """Run every later decoding step (one token, a cache, no gradient) through one `torch.compile` graph.

        Decoding is bound by reading the weights, and an eager step on CPU spends much of its time
        between small ops; compiled, the step's element-wise work fuses into the products and the
        one-row products become parallel reductions over row-major weights (`SplitGemvLinear`).
        `options` go to `torch.compile`; with inductor (the default backend) its `options` start from
        COMPILED_STEP_OPTIONS. The first step compiles (about 2 minutes on 2 CPU cores, seconds once
        inductor's cache holds the graph), with the cache's changing sizes symbolic (STEP_SIZES), so one
        graph serves the rest. Steps while sinks still fill, prefill, training and scoring stay eager.
        Returns the model.
        """
        self._row_major()
        if self.device.type == "cpu":
            # Every size: the small layers' products (the gates') fuse too, instead of extern BLAS calls.
            lay_out_for_cpu_decode(self, column_major=False, smallest=0)
        if options.get("backend", "inductor") == "inductor":
            options["options"] = COMPILED_STEP_OPTIONS | (options.get("options") or {})
        self.compiled_step = symbolic_step_sizes(torch.compile(self._forward, **options))
        return self

    def train(self, mode: bool = True):
        """Row-major weights again before training: DDP buckets, offloading and safetensors expect contiguous ones."""
        if mode:
            self._row_major()
        return super().train(mode)

    def save_pretrained(self, *args, **kwargs):
        """Row-major weights first, as safetensors saves contiguous tensors (the next CPU decoding step lays them out again)."""
        self._row_major()
        return super().save_pretrained(*args, **kwargs)

    def _row_major(self) -> None:
        if getattr(self, "cpu_decode_layout", False):
            lay_out_for_cpu_decode(self, column_major=False)
            self.cpu_decode_layout = False

    def _settled(self, cache: Cache) -> bool:
        """Whether every linear layer's next step is free of host syncs: each holds a state, and its sinks,
        if it keeps any, are full (`last_sink` is known). Until then steps stay eager, as a sync
        inside the compiled step would break its graph (and recompile it per layer)."""
        return all(
            has_state(layer)
            and not (
                layer.is_recurrent_states_initialized[STATES["sink_kv"]]
                and layer.last_sink is None
            )
            for layer in cache.layers
            if isinstance(layer, LinearizeCacheLayer)
        )


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


class SoftmaxAttentionConfig:
    """The base config as a softmax layer's attention module sees it: SDPA reads as `split_decode_attention`.

    A live view, not a copy: `set_attn_implementation` and any later change to the model's config
    reach the layer, and every other attribute is the base config's own.
    """

    def __init__(self, config) -> None:
        self.__dict__["base"] = config

    def __getattr__(self, name: str):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.base, name, value)

    @property
    def _attn_implementation(self) -> str | None:
        implementation = self.base._attn_implementation
        return SPLIT_DECODE if implementation == "sdpa" else implementation
