"""A Llama-family causal LM whose attention layers are softmax or linear, per `config.layer_types`.

Read top to bottom: norms, RoPE and MLP as in the base models; `SoftmaxAttention` (the teacher's
attention, unchanged); the pieces of a linear layer (feature maps, decay gate, local window);
`LinearAttention`; then the decoder layer, the backbone and the causal LM.

Weight names equal the teacher's (`model.layers.N.self_attn.q_proj.weight`, ...), so a teacher
checkpoint plus the few new parameters of the linear layers is the whole model. Caching uses
transformers' `DynamicCache(config=...)`: `linear_attention` layers get a `LinearAttentionLayer`
(a fixed-size state), `hybrid_sliding` layers that state plus a sliding-window KV cache, and
`full_attention` layers an ordinary growing KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kernels.feature_maps import elu_plus_one, hedgehog, orthogonal_random_features, performer, performer_logits
from ..kernels.gla_torch import MIN_LOG_DECAY
from ..kernels.ops import gated_linear_attention
from .configuration_linearize import LinearizeConfig

RECURRENT_MAX_TOKENS = 16  # at most this many new tokens with a state: step the recurrence instead of chunking
# The window/linear mix starts at sigmoid(2) = 0.88 on the softmax side: a converted layer begins close
# to sliding-window-plus-sink attention, which alone keeps most of the teacher's quality, and learns the rest.
WINDOW_FACTOR_INIT = 2.0


class LinearizeRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class LinearizeRotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, config: LinearizeConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings  # read by dynamic_rope_update ("dynamic" RoPE)
        self.original_max_seq_len = config.max_position_embeddings  # read by "longrope"
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        init_fn = self.compute_default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: LinearizeConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base, dim = config.rope_parameters["rope_theta"], config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LinearizeMLP(nn.Module):
    def __init__(self, config: LinearizeConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, t, d = x.shape
    return x if n_rep == 1 else x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class AttentionProjections(nn.Module):
    """q/k/v/o projections, optional q/k norms and RoPE: what softmax and linear layers share with the teacher."""

    def __init__(self, config: LinearizeConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = LinearizeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LinearizeRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, ...]:
        """-> q [B, H, T, D], k and v [B, Hkv, T, D], with norms and RoPE applied as in the teacher."""
        q, k, v = self.project_unrotated(hidden_states)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def project_unrotated(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [B, H, T, D], k and v [B, Hkv, T, D] with the teacher's q/k norms but before RoPE."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v

    def softmax_attention(self, q, k, v, attention_mask, **kwargs) -> torch.Tensor:
        """The teacher's attention on already-projected q/k/v -> [B, T, H*D] (before o_proj)."""
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, _ = interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.config.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        return out.reshape(*out.shape[:2], -1).contiguous()


class SoftmaxAttention(AttentionProjections):
    """Multi-head softmax attention, exactly the teacher's."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache: Cache | None = None, **kwargs):
        q, k, v = self.project(hidden_states, position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.o_proj(self.softmax_attention(q, k, v, attention_mask, **kwargs))


class HedgehogFeatureMap(nn.Module):
    """Learnable per-head map; identity-initialized so phi(q).phi(k) starts as a softmax-like kernel of q.k."""

    def __init__(self, heads: int, head_dim: int, feature_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, head_dim, feature_dim))
        self.bias = nn.Parameter(torch.empty(heads, feature_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.copy_(self.weight, torch.eye(self.weight.shape[1], self.weight.shape[2]).expand_as(self.weight))
        init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hedgehog(x, self.weight, self.bias)


class LowRankGate(nn.Module):
    """Data-dependent decay a_t = exp(logsigmoid(up(down(x)))/16) per KV head and key channel.

    `up` starts at zero and its bias spreads the decays over `decay_init` (0.995..0.9998 by default,
    memory spans of about 200 to 5000 tokens): the layer begins as a slowly-forgetting linear
    attention and learns where to forget.
    """

    normalizer = 16.0

    def __init__(
        self, hidden_size: int, heads: int, channels: int, rank: int, decay_init: tuple[float, float] = (0.995, 0.9998)
    ):
        super().__init__()
        self.heads, self.channels, self.decay_init = heads, channels, tuple(decay_init)
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, heads * channels, bias=True)
        # The base init must leave these two alone: it runs on children first and marks what it set as
        # initialized, after which `reset_parameters` (transformers' init functions) could not set the decays.
        self.down.gate_owned = self.up.gate_owned = True
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.normal_(self.down.weight, std=self.down.in_features**-0.5)
        init.zeros_(self.up.weight)
        decay = torch.linspace(*self.decay_init, self.channels, dtype=torch.float64).repeat(self.heads)
        # logsigmoid(b) / 16 = log(decay)  =>  b = logit(decay ** 16)
        init.copy_(self.up.bias, torch.logit(decay.pow(self.normalizer)).to(self.up.bias.dtype))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.up(self.down(hidden_states))
        g = F.logsigmoid(logits.float()) / self.normalizer
        g = g.clamp_min(MIN_LOG_DECAY).view(*hidden_states.shape[:2], self.heads, self.channels)
        return g.transpose(1, 2)


def key_gate(k: torch.Tensor) -> torch.Tensor:
    """Parameter-free decay from the keys: strong (large-norm) keys make a head forget a little faster.

    -> [B, Hkv, T, 1]; logsigmoid(12 - |k|/sqrt(D)) / 16 keeps the decay near 0.999 for typical keys.
    """
    norm = k.float().norm(dim=-1, keepdim=True) / math.sqrt(k.shape[-1])
    return F.logsigmoid(12.0 - norm) / 16.0


def shift_into_state(new: torch.Tensor, past: torch.Tensor, window: int) -> torch.Tensor:
    """What enters the linear state at each new step: step t admits token t - window (dim 2 is time).

    `past` holds the (at most `window`) tokens before the new ones, oldest first; steps that admit
    nothing get zeros.
    """
    front = new.new_zeros(*new.shape[:2], window - past.shape[2], *new.shape[3:])
    return torch.cat([front, past, new], dim=2)[:, :, : new.shape[2]]


def window_softmax_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor, window: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalized softmax over the last `window` keys of each query, in blocks: O(T * window).

    q [B, H, T, D] are the last T of the L keys k, v [B, Hkv, L, D]; key_valid [B, L]. Returns the
    numerator sum exp(s - c) v [B, H, T, D], the denominator sum exp(s - c) and the row max c.
    """
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    groups = H // Hkv
    if T <= RECURRENT_MAX_TOKENS:  # decoding: a few queries against at most window + T keys, no blocks
        query_pos = torch.arange(L - T, L, device=q.device)[:, None]
        key_pos = torch.arange(L, device=q.device)[None, :]
        allowed = (key_pos <= query_pos) & (key_pos > query_pos - window) & key_valid[:, None, None, None, :]
        scores = (q.view(B, Hkv, groups, T, D) @ k.unsqueeze(2).transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        c = scores.amax(-1, keepdim=True).clamp_min(-1e4)
        weights = (scores - c).exp()
        num, den = weights @ v.unsqueeze(2), weights.sum(-1, keepdim=True)
        return num.view(B, H, T, D), den.view(B, H, T, 1), c.view(B, H, T, 1)
    front = (-L) % window + window  # an empty block in front, so every block has a predecessor
    n = (L + front) // window
    q = F.pad(q, (0, 0, front + L - T, 0)).view(B, Hkv, groups, n, window, D)
    k = F.pad(k, (0, 0, front, 0)).view(B, Hkv, n, window, D)
    v = F.pad(v, (0, 0, front, 0)).view(B, Hkv, n, window, D)
    valid = F.pad(key_valid, (front, 0), value=False).view(B, 1, n, window)

    def with_previous_block(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :, :-1], x[:, :, 1:]], dim=3)

    k2, v2, valid2 = with_previous_block(k), with_previous_block(v), with_previous_block(valid)
    i = torch.arange(window, device=q.device)[:, None]
    j = torch.arange(2 * window, device=q.device)[None, :]
    allowed = ((j > i) & (j <= i + window)) & valid2.unsqueeze(2).unsqueeze(-2)
    scores = (q[:, :, :, 1:] @ k2.unsqueeze(2).transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    c = scores.amax(-1, keepdim=True).clamp_min(-1e4)
    weights = (scores - c).exp()
    num, den = weights @ v2.unsqueeze(2), weights.sum(-1, keepdim=True)

    def unblock(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B, H, (n - 1) * window, -1)[:, :, -T:]

    return unblock(num), unblock(den), unblock(c)


def update_sinks(
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    count: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the first `count` real tokens of each row (attention sinks): their keys, values and positions.

    `sinks` is (keys [B, Hkv, S, D], values, positions [B, S] with -1 for an empty slot) or None;
    k, v [B, Hkv, T, D] are new tokens at absolute `positions` [T], `valid` [B, T] marks real ones.
    """
    B, Hkv, T, D = k.shape
    if sinks is None:
        sinks = (k.new_zeros(B, Hkv, count, D), v.new_zeros(B, Hkv, count, D), k.new_full((B, count), -1.0))
    sink_k, sink_v, sink_pos = sinks
    filled = (sink_pos >= 0).sum(-1, keepdim=True)
    if bool((filled == count).all()):  # every row has its sinks already (all of decoding)
        return sinks
    slot = filled + valid.long().cumsum(-1) - 1  # the sink slot each new real token would take
    slot = torch.where(valid & (slot < count), slot, torch.full_like(slot, count))  # slot `count` discards
    index = slot[:, None, :, None].expand(B, Hkv, T, D)
    sink_k = torch.cat([sink_k, k.new_zeros(B, Hkv, 1, D)], 2).scatter(2, index, k)[:, :, :count]
    sink_v = torch.cat([sink_v, v.new_zeros(B, Hkv, 1, D)], 2).scatter(2, index, v)[:, :, :count]
    new_pos = positions.to(sink_pos.dtype)[None].expand(B, T)
    sink_pos = torch.cat([sink_pos, sink_pos.new_full((B, 1), -1.0)], 1).scatter(1, slot, new_pos)[:, :count]
    return sink_k, sink_v, sink_pos


def add_sink_terms(
    window_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q_positions: torch.Tensor,
    window: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold the sink tokens that lie before a query's window into its softmax terms (one shared max)."""
    num, den, c = window_terms
    sink_k, sink_v, sink_pos = sinks
    groups = q.shape[1] // sink_k.shape[1]
    scores = (q @ sink_k.repeat_interleave(groups, 1).transpose(-1, -2)) * scaling  # [B, H, T, S]
    visible = (sink_pos[:, None, None, :] >= 0) & (sink_pos[:, None, None, :] <= q_positions[None, None, :, None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    c_new = torch.maximum(c, scores.amax(-1, keepdim=True))
    weights = (scores - c_new).exp()
    rescale = (c - c_new).exp()
    num = num * rescale + weights @ sink_v.repeat_interleave(groups, 1)
    den = den * rescale + weights.sum(-1, keepdim=True)
    return num, den, c_new


class LinearAttention(AttentionProjections):
    """Linear attention on the teacher's projections: GLA or Performer, optionally with a softmax window.

    o_t = phi(q_t)^T S_t (/ phi(q_t)^T z_t), S_t = diag(a_t) S_{t-1} + phi(k_t) v_t^T. With a window
    of W tokens, the last W keys are attended by softmax and a key enters S when it leaves the
    window; both parts share one normalizer. The state lives per KV head (GQA).

    `form` pins one of the three equal computations ("parallel", "chunk", "recurrent"); by default
    prefill chunks and short decoding steps use the recurrence. With `transfer` on (stage 1 of a
    conversion) the layer also computes the teacher's softmax output, records the MSE between the
    two in `transfer_loss` and passes the teacher's output on, so every layer sees teacher inputs.
    """

    def __init__(self, config: LinearizeConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        settings = config.linear_attention
        self.kind = settings["kind"]
        self.map_name = settings["feature_map"]
        self.normalize = settings["normalize"]
        self.chunk_size = settings["chunk_size"]
        self.rope_features = settings["rope_features"]
        self.window = settings["window"] if config.layer_types[layer_idx] == "hybrid_sliding" else 0
        self.sink = settings["sink"] if self.window else 0
        self.form: str | None = None
        self.transfer = False
        self.transfer_loss: torch.Tensor | None = None
        D = self.head_dim
        if self.map_name == "hedgehog":
            width = settings["feature_dim"] or D
            self.feature_map_q = HedgehogFeatureMap(self.num_heads, D, width)
            self.feature_map_k = HedgehogFeatureMap(self.num_kv_heads, D, width)
            channels = 2 * width
        elif self.map_name == "performer":
            channels = settings["feature_dim"] or 4 * D
            generator = torch.Generator().manual_seed(settings["seed"] * 1000 + layer_idx)
            projection = orthogonal_random_features(self.num_kv_heads, channels, D, generator)
            self.register_buffer("performer_projection", projection, persistent=True)
        else:
            channels = D
        self.gate = None
        if self.kind == "gla" and settings["gate"] == "lowrank":
            self.gate = LowRankGate(
                config.hidden_size, self.num_kv_heads, channels, settings["gate_rank"], settings["decay_init"]
            )
        if self.window and self.map_name != "performer":
            self.window_factor = nn.Parameter(torch.full((self.num_heads,), WINDOW_FACTOR_INIT))

    def _query_features(self, q: torch.Tensor) -> torch.Tensor:
        """phi(q) [B, H, T, F]; Performer returns its logits (the stabilizer is applied later)."""
        if self.map_name == "hedgehog":
            return self.feature_map_q(q)
        if self.map_name == "elu":
            return elu_plus_one(q)
        if self.map_name == "performer":
            projection = self.performer_projection.repeat_interleave(self.num_key_value_groups, dim=0)
            return performer_logits(q, projection)
        return q

    def _key_features(self, k: torch.Tensor) -> torch.Tensor:
        """phi(k) [B, Hkv, T, F]; Performer returns its logits."""
        if self.map_name == "hedgehog":
            return self.feature_map_k(k)
        if self.map_name == "elu":
            return elu_plus_one(k)
        if self.map_name == "performer":
            return performer_logits(k, self.performer_projection)
        return k

    def _decay(self, hidden_states: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        """Log-decay per step: [B, Hkv, T, F] from the low-rank gate, [B, Hkv, T, 1] from the keys, or None."""
        if self.kind != "gla" or self.config.linear_attention["gate"] == "none":
            return None
        return self.gate(hidden_states) if self.gate is not None else key_gate(k)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache: Cache | None = None, **kwargs):
        q_raw, k_raw, v = self.project_unrotated(hidden_states)
        q, k = apply_rotary_pos_emb(q_raw, k_raw, *position_embeddings)
        B, T = hidden_states.shape[:2]
        if self.rope_features:
            q_raw, k_raw = q, k
        out = self._attend(hidden_states, q, k, v, q_raw, k_raw, attention_mask, cache)
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, -1).to(hidden_states.dtype))
        if not self.transfer:
            return out
        with torch.no_grad():
            valid = torch.ones(B, T, dtype=torch.bool, device=q.device)
            if attention_mask is not None:
                valid = attention_mask[:, -T:].to(torch.bool)
            teacher = self.o_proj(self.softmax_attention(q, k, v, _padding_to_4d(valid, q.dtype)))
        self.transfer_loss = F.mse_loss(out.float(), teacher.float())
        return teacher

    def _attend(self, hidden_states, q, k, v, q_feat, k_feat, mask2d, cache):
        """The linear (+ window) attention output [B, H, T, D].

        q, k are RoPE'd (the softmax window and sinks use them); q_feat, k_feat are what the feature
        maps see: the same tensors, or q/k before RoPE when `rope_features` is off. Then keys waiting
        in the window cache carry their unrotated copy beside the value, to enter the state later.
        """
        B, T = q.shape[0], q.shape[2]
        g = self._decay(hidden_states, k)
        valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if mask2d is None else mask2d[:, -T:].bool()
        if self.window:
            n_past = seen = 0
            sinks = None
            if cache is not None:
                layer = cache.layers[self.layer_idx]
                n_past = 0 if layer.keys is None else layer.keys.shape[2]
                seen = layer.cumulative_length
                sinks = self._load_sinks(layer)
                k_new, v_new = k, v
                if self.rope_features:
                    k, v = cache.update(k, v, self.layer_idx)
                    k_feat = k
                else:
                    k, values = cache.update(k, torch.cat([v, k_feat], dim=-1), self.layer_idx)
                    v, k_feat = values[..., : self.head_dim], values[..., self.head_dim :]
            else:
                k_new, v_new = k, v
            key_valid = mask2d[:, -k.shape[2] :].bool() if mask2d is not None else valid.new_ones(B, k.shape[2])
            window_terms = window_softmax_terms(q, k, v, key_valid, self.window, self.scaling)
            positions = torch.arange(seen, seen + T, device=q.device)
            if self.sink:
                sinks = update_sinks(sinks, k_new, v_new, positions, valid, self.sink)
                window_terms = add_sink_terms(window_terms, q, sinks, positions, self.window, self.scaling)
                self._save_sinks(cache, sinks)
            k_feat, v = (shift_into_state(x[:, :, n_past:], x[:, :, :n_past], self.window) for x in (k_feat, v))
            valid_all = key_valid[:, None, :, None]
            valid = shift_into_state(valid_all[:, :, n_past:], valid_all[:, :, :n_past], self.window)[:, 0, :, 0]
            if self.sink:
                # Sinks stay in the softmax part for good: they never enter the linear state.
                entering = (positions - self.window).to(sinks[2].dtype)
                valid = valid & ~(entering[None, :, None] == sinks[2][:, None, :]).any(-1)
        keep = valid[:, None, :, None]
        v = v * keep
        if g is not None:
            g = g * keep
        fq, fk = self._query_features(q_feat), self._key_features(k_feat)
        state, stabilizer = self._load_state(cache)
        q_stab = key_stab = None
        if self.map_name == "performer":
            q_stab = fq.amax(-1, keepdim=True).detach()
            fq = performer(fq, q_stab)
            fk, g, stabilizer, key_stab = self._performer_keys(fk, stabilizer, valid)
        else:
            fk = fk * keep

        mode = self.form or ("recurrent" if state is not None and T <= RECURRENT_MAX_TOKENS else "chunk")
        scale = self.scaling if self.map_name == "identity" else 1.0
        if self.normalize:
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        o, state = gated_linear_attention(
            fq, fk, v, g, scale=scale, initial_state=state, mode=mode, chunk_size=self.chunk_size
        )
        self._save_state(cache, state, stabilizer)
        if not self.normalize:
            return o
        num, den = o[..., :-1], o[..., -1:]
        if self.window:
            win_num, win_den, win_max = window_terms
            if self.map_name == "performer":
                # Put the FAVOR+ estimate on the window's scale: both parts then estimate exp(q.k/sqrt(D) - c).
                key_stab = key_stab.repeat_interleave(self.num_key_value_groups, dim=1)
                rescale = (q_stab + key_stab - win_max).clamp(max=60.0).exp()
                num, den = num * rescale, den * rescale
            else:
                w = torch.sigmoid(self.window_factor)[None, :, None, None]
                win_num, win_den, num, den = w * win_num, w * win_den, (1 - w) * num, (1 - w) * den
            num, den = num + win_num, den + win_den
        return num / den.clamp_min(1e-6)

    def _performer_keys(self, key_logits: torch.Tensor, stabilizer: torch.Tensor | None, valid: torch.Tensor):
        """Key features with a running-max stabilizer, expressed as a scalar decay of the state.

        m_t = max(m_{t-1}, max_f logit_t); the state is kept relative to exp(m_t), so raising the max
        by d multiplies the old state by exp(-d): exactly a per-head decay g_t = m_{t-1} - m_t.
        Returns (features, g [B, Hkv, T, 1], final m, m per step).
        """
        keep = valid[:, None, :, None]
        step_max = key_logits.amax(-1, keepdim=True).detach().masked_fill(~keep, float("-inf"))
        start = torch.full_like(step_max[:, :, :1], float("-inf")) if stabilizer is None else stabilizer
        running = torch.cummax(torch.cat([start, step_max], dim=2), dim=2).values
        previous, current = running[:, :, :-1], running[:, :, 1:]
        g = torch.where(torch.isfinite(previous), previous - current, torch.zeros_like(current))
        per_step = torch.where(torch.isfinite(current), current, torch.zeros_like(current))
        features = performer(key_logits, per_step) * keep
        return features, g, running[:, :, -1:], per_step

    def _load_sinks(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not self.sink or not layer.is_recurrent_states_initialized[2]:
            return None
        kv, positions = layer.recurrent_states[2], layer.recurrent_states[3]
        return kv[..., : self.head_dim], kv[..., self.head_dim :], positions

    def _save_sinks(self, cache: Cache | None, sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        if cache is not None:
            cache.update_recurrent_state(torch.cat(sinks[:2], dim=-1), self.layer_idx, state_idx=2)
            cache.update_recurrent_state(sinks[2], self.layer_idx, state_idx=3)

    def _load_state(self, cache: Cache | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if cache is None:
            return None, None
        layer = cache.layers[self.layer_idx]
        state = layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None
        stabilizer = layer.recurrent_states[1] if layer.is_recurrent_states_initialized[1] else None
        return state, stabilizer

    def _save_state(self, cache: Cache | None, state: torch.Tensor, stabilizer: torch.Tensor | None) -> None:
        if cache is None:
            return
        cache.update_recurrent_state(state, self.layer_idx, state_idx=0)
        if stabilizer is not None:
            cache.update_recurrent_state(stabilizer, self.layer_idx, state_idx=1)


def _padding_to_4d(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T] key validity -> additive causal mask [B, 1, T, T]."""
    T = valid.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril() & valid[:, None, None, :]
    allowed = allowed | torch.eye(T, dtype=torch.bool, device=valid.device)
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(~allowed, torch.finfo(dtype).min)


class LinearizeDecoderLayer(nn.Module):
    def __init__(self, config: LinearizeConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        attention = SoftmaxAttention if self.layer_type == "full_attention" else LinearAttention
        self.self_attn = attention(config, layer_idx)
        self.mlp = LinearizeMLP(config)
        self.input_layernorm = LinearizeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LinearizeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, **kwargs
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LinearizePreTrainedModel(PreTrainedModel):
    config_class = LinearizeConfig
    config: LinearizeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LinearizeDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Base init for the teacher's module kinds; the linear layers' own init for the new parameters."""
        if not getattr(module, "gate_owned", False):
            super()._init_weights(module)
        if isinstance(module, (HedgehogFeatureMap, LowRankGate)):
            module.reset_parameters()
        elif isinstance(module, LinearAttention) and hasattr(module, "window_factor"):
            init.constant_(module.window_factor, WINDOW_FACTOR_INIT)


class LinearizeModel(LinearizePreTrainedModel):
    """The backbone: embeddings, decoder layers, final norm."""

    def __init__(self, config: LinearizeConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(LinearizeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LinearizeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LinearizeRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        T = inputs_embeds.shape[1]
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError("linearize models take a 2D [batch, tokens] attention_mask")
        if position_ids is None:
            position_ids = self._position_ids(attention_mask, cache, T, inputs_embeds.device)

        full_mask = None
        if "full_attention" in self.config.layer_types:
            full_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            mask = full_mask if layer.layer_type == "full_attention" else attention_mask
            if self.gradient_checkpointing and self.training:
                hidden_states = self._gradient_checkpointing_func(
                    layer.__call__, hidden_states, position_embeddings, mask, cache
                )
            else:
                hidden_states = layer(hidden_states, position_embeddings, mask, cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)

    def _position_ids(self, attention_mask, cache, T: int, device) -> torch.Tensor:
        """Positions from the padding mask when there is one (left padding), else from what the cache has seen."""
        if attention_mask is not None:
            return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
        past = 0
        if cache is not None and any(t != "linear_attention" for t in self.config.layer_types):
            past = cache.get_seq_length()
        elif cache is not None and any(layer.is_recurrent_states_initialized[0] for layer in cache.layers):
            raise ValueError("an all-linear model continuing from a cache needs attention_mask or position_ids")
        return torch.arange(past, past + T, device=device)[None]


class LinearizeForCausalLM(LinearizePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LinearizeConfig):
        super().__init__(config)
        self.model = LinearizeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)


__all__ = ["LinearizeConfig", "LinearizeForCausalLM", "LinearizeModel", "LinearizePreTrainedModel"]
