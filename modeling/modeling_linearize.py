"""A causal LM of any supported family whose chosen attention layers are linear, per `config.layer_types`.

The model is the base family's own transformers model (`LlamaForCausalLM`, `Gemma3ForCausalLM`,
`GPTNeoXForCausalLM`, ...): embeddings, decoder layers, norms, MLPs, rotary embeddings, masks and
the output head are the family's classes, built from the base config the teacher had. Only the
attention modules of linear layers change, in place (as peft injects adapters): each becomes a
`LinearAttention` that keeps the teacher's projections, q/k norms, scale and partial rotary under
their own names, so a teacher checkpoint plus the few new parameters is the whole model.

Masks and caches (the decision): the family model builds its masks from the base layer types, as
the teacher did; softmax layers use them unchanged. Linear layers do not read those masks. They
take the 2D padding mask, which `LinearizeForCausalLM.forward` passes down the family's `**kwargs`
as `linearize_padding_mask`, and they keep their whole cache, softmax window included, in their
own `LinearizeCacheLayer` (cache_linearize.py; `layer_types` says `linear_attention`). To the family's mask builders a
linear layer is therefore never an attention layer: sliding-window softmax layers (Gemma 3,
Mistral) keep their own window and mask sizes.

Read top to bottom: the pieces of a linear layer (feature maps, decay gate), `LinearAttention`, then
the models: `LinearizeModel` (the backbone, what `AutoModel` loads) and `LinearizeForCausalLM`, both
over the base family's own classes. Beside this file: `cache_linearize.py` (the cache-layer classes),
`decoding_linearize.py` (the one-token step and compiled decoding), `cpu_layout_linearize.py` (weight
layouts for CPU decoding); the math of the attention itself is in the kernels (`gla_torch.py`,
`delta_torch.py`, `window_torch.py` and their Triton versions, chosen by `ops.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch import nn
from torch.utils.checkpoint import checkpoint

MIN_TRANSFORMERS = "5.24"  # the first release we tested with LinearAttentionLayer and the `cache=` keyword
if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):  # before the imports that would fail unclearly
    raise ImportError(
        f"this model needs transformers >= {MIN_TRANSFORMERS} (found {transformers.__version__}) for its "
        f"linear-attention cache: pip install -U 'transformers>={MIN_TRANSFORMERS}'"
    )

from transformers import GenerationMixin, PreTrainedModel  # noqa: E402
from transformers import initialization as init  # noqa: E402
from transformers.cache_utils import Cache, DynamicCache  # noqa: E402
from transformers.utils.deprecation import deprecate_kwarg  # noqa: E402
from transformers.utils.import_utils import is_torch_greater_or_equal  # noqa: E402

from ..kernels.feature_maps import (  # noqa: E402
    elu_plus_one,
    hedgehog,
    hedgehog_step,
    orthogonal_random_features,
    performer,
    performer_keys,
    performer_logits,
    taylor,
)
from ..kernels.gla_torch import MIN_LOG_DECAY, as_dtype  # noqa: E402
from ..kernels.ops import NORMALIZER_EPS, gated_delta_rule, gated_linear_attention, normalize_output, with_normalizer  # noqa: E402
from ..kernels.window_torch import (  # noqa: E402
    shift_into_state,
    sink_leaving,
    update_sinks,
    window_band,
    window_softmax_terms,
)
from .configuration_linearize import LINEAR, STATES, LinearizeConfig, base_config_class  # noqa: E402
from .cache_linearize import LinearizeCacheLayer, adopt_layers, has_state, record_seen, tokens_seen  # noqa: E402
from .cpu_layout_linearize import FusedProjections  # noqa: E402
from .decoding_linearize import DecodingRuntime, DecodingStep, SoftmaxAttentionConfig, derived, padding_free, sinks_settled  # noqa: E402
from .families import Family, family_of  # noqa: E402

SDPA_GROUPS = is_torch_greater_or_equal("2.5")  # SDPA's enable_gqa: query groups share their KV head uncopied
RECURRENT_MAX_TOKENS = 16  # at most this many new tokens with a state: step the recurrence instead of chunking
# The normalized delta rule's erase strength b_t starts here: near 0 the layer is GLA; at 0.05 the
# untrained embedded student already scores 7.69 held-out against GLA's 8.00 (positive unit keys
# overlap, so each erase also fades much of the state). Where the write divides by b_t, ERASE_FLOOR
# keeps it finite: below the floor a write is scaled down by b_t / ERASE_FLOOR.
ERASE_INIT = 0.05
ERASE_FLOOR = 1e-6
PADDING_KWARG = "linearize_padding_mask"  # how the 2D padding mask reaches the linear layers


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
        if x.shape[2] == 1 and not torch.is_grad_enabled() and x.dtype == self.weight.dtype:
            signed = derived(self, "_signed_cache", (self.weight, self.bias), self.signed)
            return hedgehog_step(x, *signed)
        return hedgehog(x, self.weight, self.bias)

    def signed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[W, -W] and [b, -b] for `hedgehog_step`."""
        return torch.cat([self.weight, -self.weight], -1), torch.cat([self.bias, -self.bias], -1).unsqueeze(1)


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
        if self.channels > 1:  # per key channel (GLA): every head spans the range
            decay = torch.linspace(*self.decay_init, self.channels, dtype=torch.float64).repeat(self.heads)
        else:  # one decay per head: the heads span it
            decay = torch.linspace(*self.decay_init, self.heads, dtype=torch.float64)
        # logsigmoid(b) / 16 = log(decay)  =>  b = logit(decay ** 16)
        init.copy_(self.up.bias, torch.logit(decay.pow(self.normalizer)).to(self.up.bias.dtype))

    def forward(self, hidden_states: torch.Tensor, low_rank: torch.Tensor | None = None) -> torch.Tensor:
        """[B, heads, T, channels] log-decays; `low_rank` is down(hidden_states) where the caller made it already."""
        logits = self.up(self.down(hidden_states) if low_rank is None else low_rank)
        g = F.logsigmoid(as_dtype(logits, torch.float32)) / self.normalizer
        g = g.clamp_min(MIN_LOG_DECAY).view(*hidden_states.shape[:2], self.heads, self.channels)
        return g.transpose(1, 2)


class TaylorFeatureMap(nn.Module):
    """Based's second-order Taylor map on a learned d-dimensional projection of each head's q or k.

    The projection is L2-normalized and scaled to sqrt(2) d^(1/4), so the kernel's argument
    q'.k'/sqrt(d) stays in [-2, 2], where 1 + u + u^2/2 is a fair, positive stand-in for exp(u).
    Unbounded, SmolLM2's large q/k norms put it far out of that range (98x the teacher's held-out
    perplexity zero-shot). The projection starts at the first d coordinates.

    Each side's features are divided by sqrt(F), F = 1 + d + d^2, so a token adds 0.5/F to 5/F to the
    normalizer. A constant cancels wherever the state alone is normalized (and in the delta rule's L2
    norm), but the window's softmax shares one normalizer with the state: unscaled, each token past
    the window added 0.5-5, against Hedgehog's ~2/F, and the state took 49-95% of the joint
    normalizer of the untrained layers at 2K (Hedgehog's 1-11%), so the 0.88 weight on the window
    did not hold (20x the teacher's held-out perplexity zero-shot).
    """

    def __init__(self, heads: int, head_dim: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, head_dim, dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        D, d = self.weight.shape[1:]
        init.copy_(self.weight, torch.eye(D, d).expand_as(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.weight.shape[-1]
        return taylor(x, self.weight, radius=math.sqrt(2.0) * d**0.25, scale=(1 + d + d * d) ** -0.5)


class WriteStrength(nn.Module):
    """The delta rule's b_t = sigmoid(x w + c) per KV head; starts at `start` everywhere (w = 0)."""

    def __init__(self, hidden_size: int, heads: int, start: float = 0.5):
        super().__init__()
        self.start = start
        self.proj = nn.Linear(hidden_size, heads)
        self.proj.gate_owned = True  # see LowRankGate: the base init must not reset it
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.zeros_(self.proj.weight)
        init.constant_(self.proj.bias, math.log(self.start / (1.0 - self.start)))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """-> [B, Hkv, T, 1]."""
        return torch.sigmoid(self.proj(hidden_states).float()).transpose(1, 2).unsqueeze(-1)


class ShortConv(nn.Module):
    """Depthwise causal convolution over time (DeltaNet's short conv on q/k/v); identity at init."""

    def __init__(self, channels: int, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.copy_(self.weight, F.one_hot(torch.tensor(self.weight.shape[1] - 1), self.weight.shape[1]).float().expand_as(self.weight))

    def forward(self, x: torch.Tensor, history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C] after `history` [B, size - 1, C] (zeros at the start) -> (y [B, T, C], the new history)."""
        size = self.weight.shape[1]
        if history is None:
            history = x.new_zeros(x.shape[0], size - 1, x.shape[2])
        full = torch.cat([history.to(x.dtype), x], dim=1)
        y = F.conv1d(full.transpose(1, 2), self.weight.to(x.dtype).unsqueeze(1), groups=x.shape[2])
        return y.transpose(1, 2), full[:, full.shape[1] - (size - 1) :]


def retnet_decay(heads: int, device: torch.device) -> torch.Tensor:
    """RetNet's fixed multi-scale log-decays, log(1 - 2^(-5 - h)) for head h: memory spans of 32 to 2^(4+H) tokens."""
    return torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(heads, dtype=torch.float32, device=device)))


def key_gate(k: torch.Tensor) -> torch.Tensor:
    """Parameter-free decay from the keys: strong (large-norm) keys make a head forget a little faster.

    -> [B, Hkv, T, 1]; logsigmoid(12 - |k|/sqrt(D)) / 16 keeps the decay near 0.999 for typical keys.
    """
    norm = k.float().norm(dim=-1, keepdim=True) / math.sqrt(k.shape[-1])
    return F.logsigmoid(12.0 - norm) / 16.0


def transfer_mse(out: torch.Tensor, teacher: torch.Tensor, late_weight: float = 0.0) -> torch.Tensor:
    """Attention transfer's MSE over [B, T, hidden]; with `late_weight` w, position t of T weighs 1 + w * t / T.

    The weights are scaled to mean 1, so the loss stays on the uniform MSE's scale.
    """
    if not late_weight:
        return F.mse_loss(out.float(), teacher.float())
    T = out.shape[1]
    weight = 1 + late_weight * torch.arange(T, device=out.device, dtype=torch.float32) / T
    per_position = (out.float() - teacher.float()).pow(2).mean(dim=(0, 2))
    return (per_position * weight).sum() / weight.sum()


class LinearAttention(DecodingStep, FusedProjections, nn.Module):
    """Linear attention on the teacher's projections: GLA or Performer, optionally with a softmax window.

    o_t = phi(q_t)^T S_t (/ phi(q_t)^T z_t), S_t = diag(a_t) S_{t-1} + phi(k_t) v_t^T. With a window
    of W tokens, the last W keys are attended by softmax and a key enters S when it leaves the
    window; both parts share one normalizer. The state lives per KV head (GQA).

    A teacher's attention module becomes one in place (`convert`): its class becomes a subclass of
    both, so it keeps its weights, attributes and its own forward, which is the teacher's softmax.
    `form` pins one of the three equal computations ("parallel", "chunk", "recurrent"); by default
    prefill chunks and short decoding steps use the recurrence. With `transfer` on (stage 1 of a
    conversion) the layer also runs the teacher's forward, records the MSE between the two in
    `transfer_loss` and passes the teacher's output on, so every layer sees teacher inputs. With
    `teacher_attention` on it runs only the teacher's forward: the model is then its own teacher.
    """

    apply_rotary: Callable  # the family's own apply_rotary_pos_emb (partial rotary included), set per class

    @staticmethod
    def convert(attention: nn.Module, config: LinearizeConfig, layer_idx: int, family: Family) -> LinearAttention:
        """Turn the family's attention module `attention` into a linear layer, keeping its weights."""
        if getattr(attention, "attn_logit_softcapping", None):
            raise ValueError(
                f"layer {layer_idx} soft-caps its attention logits, which linear attention cannot reproduce: keep it softmax"
            )
        attention.__class__ = linear_attention_class(type(attention))
        attention.setup(config, layer_idx, family)
        return attention

    def setup(self, config: LinearizeConfig, layer_idx: int, family: Family) -> None:
        teacher_parts = set(self._modules) | set(self._parameters) | set(self._buffers)
        self._add_linear_parts(config, layer_idx, family)
        # What the teacher does not have: stage 1 trains exactly these.
        self.linear_parts = tuple(sorted((set(self._modules) | set(self._parameters) | set(self._buffers)) - teacher_parts))

    def _add_linear_parts(self, config: LinearizeConfig, layer_idx: int, family: Family) -> None:
        settings = dict(config.linear_attention)
        self.family = family
        self.settings = settings
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.kv_groups = self.n_heads // self.n_kv_heads
        self.head_dim = getattr(self, "head_dim", None) or self.head_size
        self.kind = settings["kind"]
        self.map_name = settings["feature_map"]
        self.normalize = settings["normalize"]
        self.chunk_size = settings["chunk_size"]
        self.rope_features = settings["rope_features"]
        self.window = settings["window"]
        self.sink = settings["sink"] if self.window else 0
        teacher_window = getattr(self, "sliding_window", None)  # set by the family when the teacher's layer slid
        if teacher_window and self.window:
            # The teacher attended to its last `teacher_window` tokens only, never to the first ones: the
            # softmax part covers exactly what it saw, without sinks, and the state adds what lies beyond.
            self.window, self.sink = min(self.window, teacher_window), 0
        self.form: str | None = None
        self.transfer = False
        self.transfer_loss: torch.Tensor | None = None
        self.transfer_late_weight = 0.0  # > 0: the transfer MSE weighs position t of T by 1 + w * t / T
        self.teacher_attention = False  # run the teacher's softmax instead (training's KL target, the teacher's scores)
        self.checkpoint_linear = False  # recompute the linear path in backward (inside a recomputed decoder layer)
        D = self.head_dim
        if self.map_name == "hedgehog":
            width = settings["feature_dim"] or D
            self.feature_map_q = HedgehogFeatureMap(self.n_heads, D, width)
            self.feature_map_k = HedgehogFeatureMap(self.n_kv_heads, D, width)
            channels = 2 * width
        elif self.map_name == "taylor":
            width = settings["feature_dim"] or 16
            self.feature_map_q = TaylorFeatureMap(self.n_heads, D, width)
            self.feature_map_k = TaylorFeatureMap(self.n_kv_heads, D, width)
            channels = 1 + width + width * width
        elif self.map_name == "performer":
            channels = settings["feature_dim"] or 4 * D
            generator = torch.Generator().manual_seed(settings["seed"] * 1000 + layer_idx)
            projection = orthogonal_random_features(self.n_kv_heads, channels, D, generator)
            self.register_buffer("performer_projection", projection, persistent=True)
        else:
            channels = D
        self.feature_channels = channels
        self.gate = None
        if self.kind != "performer" and settings["gate"] == "lowrank":
            # GLA and the delta rule in GLA's state (normalize) decay per key channel. The Taylor map takes
            # one decay per head: a per-channel decay of its features, some of them negative, can drive the
            # normalizer to zero. The delta rule's added L2 form keeps one per head too: per channel measured
            # no better there.
            per_channel = self.map_name != "taylor" and (self.kind == "gla" or self.normalize)
            self.gate = LowRankGate(
                config.hidden_size,
                self.n_kv_heads,
                channels if per_channel else 1,
                settings["gate_rank"],
                settings["decay_init"],
            )
        self.conv_size = settings["conv_size"]
        if self.kind == "deltanet":
            start = ERASE_INIT if self.normalize else 0.5
            self.write_strength = WriteStrength(config.hidden_size, self.n_kv_heads, start)
        if self.conv_size:
            self.conv = ShortConv((self.n_heads + 2 * self.n_kv_heads) * D, self.conv_size)
        if self.window and self.map_name != "performer":
            self.window_logit = float(settings["window_logit"])
            self.window_factor = nn.Parameter(torch.full((self.n_heads,), self.window_logit))

    @torch.no_grad()
    def materialize_linear_parts(self, device: torch.device, dtype: torch.dtype) -> None:
        """Give the new parameters memory and their init after a meta-device build (the teacher's tensors are shared)."""
        parts = [getattr(self, name) for name in self.linear_parts if isinstance(getattr(self, name), nn.Module)]
        for module in [self, *(child for part in parts for child in part.modules())]:
            for slot in ("_parameters", "_buffers"):
                for name, tensor in list(getattr(module, slot).items()):
                    if module is self and name not in self.linear_parts or tensor is None:
                        continue
                    real = torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.to(device)
                    real = real.to(dtype) if real.is_floating_point() else real
                    getattr(module, slot)[name] = nn.Parameter(real, tensor.requires_grad) if slot == "_parameters" else real
        for part in parts:
            part.reset_parameters()  # every new part resets its own children (the gates' linears included)
        if hasattr(self, "window_factor"):
            init.constant_(self.window_factor, self.window_logit)

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], k and v [B, Hkv, T, D] as the teacher computes them, q/k norms included, before RoPE."""
        return self._project(hidden_states)[:3]

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`project`, and the low-rank gate's first projection of the same input where the fused columns made it
        too (else None: the gate makes it itself)."""
        B, T = hidden_states.shape[:2]
        D, family = self.head_dim, self.family
        fused = self._fused_project(hidden_states) if family.qkv == "separate" else None
        low_rank = None
        if fused is not None:
            q, k, v, low_rank = fused
        elif family.qkv == "separate":
            q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        elif family.qkv == "fused":
            q, k, v = self.qkv_proj(hidden_states).split([self.n_heads * D, self.n_kv_heads * D, self.n_kv_heads * D], -1)
        else:
            q, k, v = self.query_key_value(hidden_states).view(B, T, -1, 3 * D).chunk(3, dim=-1)
        if family.qk_norm == "flat":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (x.reshape(B, T, -1, D) for x in (q, k, v))
        if family.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), low_rank

    def _query_features(self, q: torch.Tensor) -> torch.Tensor:
        """phi(q) [B, H, T, F]; Performer returns its logits (the stabilizer is applied later)."""
        if self.map_name in ("hedgehog", "taylor"):
            return self.feature_map_q(q)
        if self.map_name == "elu":
            return elu_plus_one(q)
        if self.map_name == "performer":
            projection = self.performer_projection.repeat_interleave(self.kv_groups, dim=0)
            return performer_logits(q, projection)
        return q

    def _key_features(self, k: torch.Tensor) -> torch.Tensor:
        """phi(k) [B, Hkv, T, F]; Performer returns its logits."""
        if self.map_name in ("hedgehog", "taylor"):
            return self.feature_map_k(k)
        if self.map_name == "elu":
            return elu_plus_one(k)
        if self.map_name == "performer":
            return performer_logits(k, self.performer_projection)
        return k

    def _decay(self, hidden_states: torch.Tensor, k: torch.Tensor, low_rank: torch.Tensor | None = None) -> torch.Tensor | None:
        """Log-decay per step: [B, Hkv, T, F or 1] from the low-rank gate (given its first projection, `low_rank`,
        where `_project` made it), [B, Hkv, T, 1] from the keys or RetNet, or None."""
        gate = self.settings["gate"]
        if self.kind == "performer" or gate == "none":
            return None
        if gate == "retnet":
            B, T = hidden_states.shape[:2]
            return retnet_decay(self.n_kv_heads, k.device)[None, :, None, None].expand(B, -1, T, 1)
        return self.gate(hidden_states, low_rank) if self.gate is not None else key_gate(k)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache: Cache | None = None, **kwargs):
        """Called as the family's decoder layer calls its attention; returns (output, None): no weights to show."""
        if self.family.cache_arg != "cache":
            cache = kwargs.pop(self.family.cache_arg, cache)
        if self.teacher_attention:
            return self._softmax(hidden_states, position_embeddings, attention_mask, kwargs)
        padding = kwargs.get(PADDING_KWARG)
        if self.checkpoint_linear and cache is None and torch.is_grad_enabled():
            out = checkpoint(self._linear, hidden_states, position_embeddings, padding, None, use_reentrant=False)
        else:
            out = self._linear(hidden_states, position_embeddings, padding, cache)
        if self.transfer:
            with torch.no_grad():
                teacher, _ = self._softmax(hidden_states, position_embeddings, attention_mask, kwargs)
            self.transfer_loss = transfer_mse(out, teacher, self.transfer_late_weight)
            out = teacher
        return out, None

    def _linear(self, hidden_states, position_embeddings, padding, cache):
        """The linear layer's own output [B, T, hidden], from projection to output projection."""
        B, T = hidden_states.shape[:2]
        q_raw, k_raw, v, low_rank = self._project(hidden_states)
        q, k = self.apply_rotary(q_raw, k_raw, *position_embeddings)
        if self.rope_features:
            q_raw, k_raw = q, k
        out = self._attend(hidden_states, q, k, v, q_raw, k_raw, padding, cache, low_rank)
        return getattr(self, self.family.output)(as_dtype(out.transpose(1, 2).reshape(B, T, -1), hidden_states.dtype))

    def _softmax(self, hidden_states, position_embeddings, attention_mask, kwargs):
        """The teacher's own attention forward on the same weights (uncached: it serves training and scoring)."""
        return super().forward(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **{self.family.cache_arg: None},
            **kwargs,
        )

    def _attend(self, hidden_states, q, k, v, q_feat, k_feat, padding, cache, low_rank=None):
        """The linear (+ window) attention output [B, H, T, D].

        q, k are RoPE'd (the softmax window and sinks use them); q_feat, k_feat are what the feature
        maps see: the same tensors, or q/k before RoPE when `rope_features` is off. Then keys waiting
        in the window carry their unrotated copy beside the value, to enter the state later.
        """
        B, T = q.shape[0], q.shape[2]
        layer = None if cache is None else cache.layers[self.layer_idx]
        start = tokens_seen(layer)
        if T == 1 and self._steps_in_place(layer, cache, start):
            return self._gla_step(hidden_states, q, k, v, q_feat, k_feat, padding, layer, cache, start, low_rank)
        valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if padding is None else padding[:, -T:].bool()
        if T > 1 and self._has_gla_step() and start + T <= self.window:
            return self._inside_window(q, k, v, k_feat, valid, padding is None, layer, cache, start)
        g = self._decay(hidden_states, k, low_rank)
        v_feat = v
        if self.conv_size:
            q_feat, k_feat, v_feat = self._convolve(q_feat, k_feat, v, valid, cache)
        # What a token writes into the state: key features, values (convolved), the delta rule's write strength.
        payload = [k_feat, v_feat] + ([self.write_strength(hidden_states)] if self.kind == "deltanet" else [])
        if self.window:
            payload, valid, window_terms = self._through_window(layer, cache, q, k, v, payload, valid, start)
        k_feat, v = payload[:2]
        if layer is not None:
            record_seen(layer, start + T)
            layer.has_previous_state[STATES["memory"]] = True
        keep = valid[:, None, :, None]
        v = v * keep
        if g is not None:
            g = g * keep
        fq, fk = self._query_features(q_feat), self._key_features(k_feat)
        mode = self.form or ("recurrent" if self._state(cache, "memory") is not None and T <= RECURRENT_MAX_TOKENS else "chunk")
        if self.kind == "deltanet":
            return self._delta(fq, fk, v, payload[2] * keep, g, keep, cache, mode, window_terms if self.window else None)
        state, stabilizer = self._state(cache, "memory"), self._state(cache, "stabilizer")
        q_stab = key_stab = None
        if self.map_name == "performer":
            q_stab = fq.amax(-1, keepdim=True).detach()
            fq = performer(fq, q_stab)
            fk, g, stabilizer, key_stab = performer_keys(fk, stabilizer, valid)
        else:
            fk = fk * keep

        scale = self.scaling if self.map_name == "identity" else 1.0
        mixed = self.normalize and self.window  # the window's softmax terms join before the division
        o, state = gated_linear_attention(
            fq,
            fk,
            v,
            g,
            scale=scale,
            normalize=self.normalize,
            divide=not mixed,
            initial_state=state,
            mode=mode,
            chunk_size=self.chunk_size,
        )
        self._store(cache, "memory", state)
        if stabilizer is not None:
            self._store(cache, "stabilizer", stabilizer)
        if not mixed:
            return o
        win, win_max = window_terms
        if self.map_name == "performer":
            # Put the FAVOR+ estimate on the window's scale: both parts then estimate exp(q.k/sqrt(D) - c).
            key_stab = key_stab.repeat_interleave(self.kv_groups, dim=1)
            mix = o * (q_stab + key_stab - win_max).clamp(max=60.0).exp() + win
            return normalize_output(mix[..., :-1], mix[..., -1:])
        return self._share_normalizer(o, win)

    def _inside_window(self, q, k, v, k_feat, valid, all_valid: bool, layer, cache, start: int) -> torch.Tensor:
        """The output [B, H, T, D] while every token so far fits the window (scoring, short prompts).

        Nothing has left the window, so the state is empty and the layer is exact causal softmax over the
        real tokens: one SDPA call, as the teacher makes, with no feature maps, gate or window blocks. A
        cache still gets what later steps read: the ring, the sinks and the (empty) state.
        """
        if cache is not None:
            self._through_window(layer, cache, q, k, v, [k_feat, v], valid, start, terms=False)
            if self._state(cache, "memory") is None:
                features = self._key_features(k_feat[:, :, :1]).shape  # [B, heads, 1, K]
                B, D = v.shape[0], v.shape[-1]
                self._store(cache, "memory", v.new_zeros(B, features[1], features[-1], D + 1, dtype=torch.float32))
            record_seen(layer, start + q.shape[2])
            layer.has_previous_state[STATES["memory"]] = True
        T, L = q.shape[2], start + q.shape[2]
        mask = None
        if start or not all_valid:
            if start:  # the earlier tokens from the ring, in time order (it has not wrapped yet)
                ring, ring_valid = self._state(cache, "window_kv"), self._state(cache, "window_valid")
                k, v, valid = ring[:, :, 0, :L], ring[:, :, 1, :L], ring_valid[:, :L]
            # A query with no real key so far (left padding) sees itself, so its (unused) output stays finite.
            mask = window_band(T, L, L, q.device) & (valid[:, None, None, :] | window_band(T, L, 1, q.device))
        groups = {}
        if self.kv_groups > 1 and SDPA_GROUPS:
            groups = {"enable_gqa": True}
        elif self.kv_groups > 1:
            k, v = k.repeat_interleave(self.kv_groups, dim=1), v.repeat_interleave(self.kv_groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scaling, **groups)

    def _share_normalizer(self, o: torch.Tensor, win: torch.Tensor) -> torch.Tensor:
        """GLA's undivided terms and the window's, mixed per head by sigmoid(window factor), then divided once."""
        w = derived(self, "_mix_weight_cache", (self.window_factor,), lambda: torch.sigmoid(self.window_factor).view(-1, 1, 1))
        mix = torch.lerp(as_dtype(o, w.dtype), as_dtype(win, w.dtype), w)
        return normalize_output(mix[..., :-1], mix[..., -1:])

    def _through_window(self, layer, cache, q, k, v, payload, valid, start, terms: bool = True):
        """The window's softmax terms, and what leaves the window into the state: (payload, valid, terms).
        With `terms` off, only the cache is updated (the caller attends itself) and the terms are None.

        The cache keeps the last W tokens' keys and values (and the rest of their payload) as a ring:
        position t sits in slot t % W. A decoding step (one token, no gradient) swaps its token in where
        the leaving one was (`_ring_step`); other steps put the ring in time order, run, and store it back.
        """
        B, T, W = q.shape[0], q.shape[2], self.window
        extras = [x for x in payload if x is not k and x is not v]  # kept beside k and v until they enter
        extra = torch.cat(extras, dim=-1) if extras else None
        ring, ring_extra, ring_valid = (self._state(cache, name) for name in ("window_kv", "window_payload", "window_valid"))
        step = ring is not None and T == 1 and not torch.is_grad_enabled()
        sinks_behind = sinks_settled(None if layer is None else layer.last_sink, start, W, step)
        # A decoding step past the sinks needs no positions: it neither fills nor masks them.
        positions = None if step and sinks_behind else torch.arange(start, start + T, device=q.device)
        sinks = self._update_sinks(cache, k, v, positions, valid) if self.sink else None
        if step:
            k_out, v_out, extra_out, valid, window_terms = self._ring_step(
                ring, ring_extra, ring_valid, q, k, v, extra, valid, sinks, positions, start
            )
        else:
            parts, key_valid = [k, v] + ([extra] if extra is not None else []), valid
            if cache is not None:  # in time order, the window's last W tokens (zeros, marked invalid, before any)
                if ring is None:
                    rings = [x.new_zeros(B, self.n_kv_heads, W, x.shape[-1]) for x in parts]
                    ring_valid = valid.new_zeros(B, W)
                else:
                    rings = [ring[:, :, 0], ring[:, :, 1], ring_extra][: len(parts)]
                back, forth = -(start % W), (start + T) % W
                parts = [torch.cat([r.roll(back, dims=2), x], dim=2) for r, x in zip(rings, parts)]
                key_valid = torch.cat([ring_valid.roll(back, dims=1), valid], dim=1)
                self._store(cache, "window_kv", torch.stack([x[:, :, -W:].roll(forth, dims=2) for x in parts[:2]], dim=2))
                if extra is not None:
                    self._store(cache, "window_payload", parts[2][:, :, -W:].roll(forth, dims=2))
                self._store(cache, "window_valid", key_valid[:, -W:].roll(forth, dims=1))
            window_terms = (
                window_softmax_terms(q, parts[0], parts[1], key_valid, W, self.scaling, sinks, positions, sinks_behind)
                if terms
                else None
            )
            k_out, v_out, *extra_out = (shift_into_state(x, T, W) for x in parts)
            extra_out = extra_out[0] if extra_out else None
            valid = shift_into_state(key_valid, T, W, dim=1)
        extras_out = iter(extra_out.split([x.shape[-1] for x in extras], dim=-1) if extras else ())
        payload = [k_out if x is k else v_out if x is v else next(extras_out) for x in payload]
        if self.sink and not sinks_behind:
            # Sinks stay in the softmax part for good: they never enter the linear state.
            valid = valid & ~sink_leaving(sinks[2], positions, W)
        return payload, valid, window_terms

    def _delta(self, fq, fk, v, beta, g, keep, cache, mode, window_terms):
        """The gated delta rule, in one of two forms (`normalize`).

        Normalized (positive features): GLA's state, the value with its normalizer column of ones
        written under phi(k), and before each write the delta rule erases along the unit key
        e = phi(k) / |phi(k)|: S_t = S_{t-1} diag(a_t) (I - b_t e_t e_t^T) + b_t u_t e_t^T with u_t =
        |phi(k_t)| [v_t, 1] / b_t, so the write is GLA's whatever b_t, which only sets the erase. As
        b_t -> 0 the layer is GLA; it is read by phi(q) and divided together with the window, as GLA is.

        Unnormalized: the delta rule on L2-normalized features, with no normalizer to share with the
        window, so its output is added, weighed by 1 - sigmoid(window factor): while nothing has left
        the window (a context within it) the layer is exactly window-plus-sinks softmax. (A convex mix
        w * softmax + (1 - w) * delta would shrink the softmax by w wherever the state is still empty:
        1.04x the teacher's perplexity at 512.)
        """
        if self.normalize:
            norm = fk.norm(dim=-1, keepdim=True)
            fk = fk / norm.clamp_min(NORMALIZER_EPS) * keep
            v = with_normalizer(v) * (norm * keep / beta.clamp_min(ERASE_FLOOR))
        else:
            fq, fk = F.normalize(fq, dim=-1), F.normalize(fk, dim=-1) * keep
        o, state = gated_delta_rule(
            fq, fk, v, beta[..., 0], g,
            initial_state=self._state(cache, "memory"), mode=mode, chunk_size=self.chunk_size,
        )  # fmt: skip
        self._store(cache, "memory", state)
        if self.normalize:
            if window_terms is None:
                return normalize_output(o[..., :-1], o[..., -1:])
            return self._share_normalizer(o, window_terms[0])
        if window_terms is None:
            return o
        win, _ = window_terms
        state_weight = torch.sigmoid(-self.window_factor)[None, :, None, None]
        return normalize_output(win[..., :-1], win[..., -1:]).to(state_weight.dtype) + state_weight * o.to(state_weight.dtype)

    def _convolve(self, q_feat, k_feat, v, valid, cache):
        """The short causal convolution over q/k/v features (padding zeroed first, the last steps cached)."""
        B, T, D = v.shape[0], v.shape[2], self.head_dim
        flat = [x.transpose(1, 2).reshape(B, T, -1) for x in (q_feat, k_feat, v)]
        x = torch.cat(flat, dim=-1) * valid[..., None]
        y, history = self.conv(x, self._state(cache, "conv"))
        self._store(cache, "conv", history)
        return (part.view(B, T, -1, D).transpose(1, 2) for part in y.split([f.shape[-1] for f in flat], dim=-1))

    def _state(self, cache: Cache | None, name: str) -> torch.Tensor | None:
        """One of this layer's cached states (see STATES), or None before the first step."""
        if cache is None:
            return None
        layer, index = cache.layers[self.layer_idx], STATES[name]
        return layer.recurrent_states[index] if has_state(layer) and layer.is_recurrent_states_initialized[index] else None

    def _store(self, cache: Cache | None, name: str, value: torch.Tensor) -> None:
        if cache is not None:
            cache.update_recurrent_state(value, self.layer_idx, state_idx=STATES[name])

    def _update_sinks(self, cache: Cache | None, k, v, positions, valid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sinks after these tokens. Once every row's are full they stay as cached, with no work.

        The cache layer then records the last sink's position (`last_sink`, a Python int
        read from the tensors while they fill: a host sync only then), so a decoding step neither
        waits on the device for it nor checks later tokens against the sinks.
        """
        layer = None if cache is None else cache.layers[self.layer_idx]
        kv, positions_kept = self._state(cache, "sink_kv"), self._state(cache, "sink_positions")
        sinks = None if kv is None else (kv[:, :, 0], kv[:, :, 1], positions_kept)
        if sinks is not None and layer.last_sink is not None:
            return sinks
        sinks = update_sinks(sinks, k, v, positions, valid, self.sink)
        if layer is not None:
            self._store(cache, "sink_kv", torch.stack(sinks[:2], dim=2))
            self._store(cache, "sink_positions", sinks[2])
            layer.last_sink = int(sinks[2].max()) if bool((sinks[2] >= 0).all()) else None
        return sinks


_LINEAR_CLASSES: dict[type, type] = {}


def linear_attentions(module: nn.Module) -> tuple[LinearAttention, ...]:
    """Every linear layer inside `module` in order: a converted model (its own list, also when loaded as remote
    code, whose classes are the export's copies), its backbone, or any wrapper of them (peft forwards the list)."""
    own = getattr(module, "linear_attentions", None)
    if own is not None:
        return tuple(own)
    return tuple(m for m in module.modules() if isinstance(m, LinearAttention))


def linear_attention_class(base: type[nn.Module]) -> type[LinearAttention]:
    """`LinearAttention` over the family's attention class (one class per family, made once)."""
    if issubclass(base, LinearAttention):
        return base
    if base not in _LINEAR_CLASSES:
        import sys

        rotary = getattr(sys.modules[base.__module__], "apply_rotary_pos_emb", None)
        if rotary is None:
            raise ValueError(f"{base.__name__} has no apply_rotary_pos_emb beside it: its family is not supported")
        _LINEAR_CLASSES[base] = type(f"Linear{base.__name__}", (LinearAttention, base), {"apply_rotary": staticmethod(rotary)})
    return _LINEAR_CLASSES[base]


_HYBRID_CLASSES: dict[tuple[str, str], type] = {}


def hybrid_class(config: LinearizeConfig, public: type[LinearizePreTrainedModel]) -> type:
    """The class of a model: `public` (`LinearizeModel` or `LinearizeForCausalLM`) over the base family's own
    class of the same role (e.g. `LlamaModel` or `LlamaForCausalLM`), from transformers' auto mapping."""
    from transformers.models.auto import modeling_auto

    kind = config.base_model_type
    key = (kind, public.__name__)
    if key not in _HYBRID_CLASSES:
        base = getattr(modeling_auto, public.family_mapping)[base_config_class(kind)]
        cls = type(public.__name__, (public, base), {"__module__": __name__})
        cls.__qualname__ = f"{public.__name__}[{base.__name__}]"
        _HYBRID_CLASSES[key] = cls
    return _HYBRID_CLASSES[key]


class LinearizePreTrainedModel(PreTrainedModel):
    """What the backbone and the causal LM share: a base family model whose `config.layer_types` linear layers are
    converted in place, built from the LinearizeConfig.

    `LinearizeModel(config)`, `LinearizeForCausalLM(config)` and `from_pretrained` give an instance of
    `hybrid_class(config, ...)`, which subclasses both the public class and the family's (e.g. `LlamaModel` or
    `LlamaForCausalLM`): everything not defined here (weight tying, initialization, device maps, generation,
    output capture) is the family's. `self.config` is the LinearizeConfig (its `layer_types` build the hybrid
    cache); the family's modules hold `config.base_config()`.
    """

    config_class = LinearizeConfig
    family_mapping = ""  # the transformers auto mapping whose class of the base family a public class extends

    def __new__(cls, config: LinearizeConfig | None = None, *args, **kwargs):
        if _is_public(cls):  # (copies arrive here with their class and no config)
            cls = hybrid_class(config, cls)
        return super().__new__(cls)

    def __init__(self, config: LinearizeConfig, *args, **kwargs):
        base = config.base_config()
        super().__init__(base, *args, **kwargs)
        config._attn_implementation_internal = base._attn_implementation_internal
        self.config = config
        family = family_of(base)
        layers = self.base_model.layers
        for index, kind in enumerate(config.layer_types):
            attention = getattr(layers[index], family.attention)
            if kind == LINEAR:
                LinearAttention.convert(attention, config, index, family)
            else:
                attention.config = SoftmaxAttentionConfig(attention.config)
        self.linear_attentions = linear_attentions(self)  # a tuple, so not registered as submodules twice

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config: LinearizeConfig | None = None, **kwargs):
        if not _is_public(cls):
            return super().from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        if not isinstance(config, LinearizeConfig):
            hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}
            config = LinearizeConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        return hybrid_class(config, cls).from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config: LinearizeConfig, **kwargs):
        target = hybrid_class(config, cls) if _is_public(cls) else cls
        return super(LinearizePreTrainedModel, target)._from_config(config, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The family's init for its modules; the linear layers' own init for the new parameters."""
        if not getattr(module, "gate_owned", False):
            super()._init_weights(module)
        if isinstance(module, (HedgehogFeatureMap, TaylorFeatureMap, LowRankGate, WriteStrength, ShortConv)):
            module.reset_parameters()
        elif isinstance(module, LinearAttention) and hasattr(module, "window_factor"):
            init.constant_(module.window_factor, module.window_logit)

    def _hybrid_cache(self, cache: Cache | None, use_cache: bool | None) -> Cache | None:
        """The cache a forward runs with: a new `DynamicCache` of this config's layer types when one is asked
        for and none is given (its linear layers hold states), or the given one; its fresh layers take this
        model's cache-layer classes (`cache_linearize.adopt_layers`), then it is checked."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if isinstance(cache, Cache):
            adopt_layers(cache)
        self._check_cache(cache)
        return cache

    def _note_padding(self, cache: Cache | None, attention_mask: torch.Tensor | None, embeds, kwargs: dict) -> None:
        """Tell the linear layers whether the new tokens of `embeds` (ids or embeddings) may include padding: a
        mask known to be all real (`padding_free`) is dropped, and the layers treat every token as real. Otherwise
        each linear layer's cache records that real tokens start after these (`valid_since`)."""
        if cache is None or attention_mask is None or attention_mask.ndim != 2 or embeds is None:
            return
        tokens = embeds.shape[1]
        if padding_free(attention_mask, tokens):
            kwargs[PADDING_KWARG] = None
            return
        for attention in self.linear_attentions:
            layer = cache.layers[attention.layer_idx]
            layer.valid_since = tokens_seen(layer) + tokens

    def _hybrid_inputs(self, embeds, attention_mask, position_ids, cache, kwargs: dict):
        """The family forward's mask and positions, with the 2D padding mask passed on to the linear layers.

        Without softmax layers, nothing needs a mask or a KV length, and the family's mask and position code
        would look for one in the cache: positions come from the linear layers' own count, the mask is a
        placeholder. Returns (attention_mask, position_ids) for the family's forward.
        """
        if attention_mask is not None and attention_mask.ndim == 2:
            kwargs.setdefault(PADDING_KWARG, attention_mask)
        if cache is not None and all(kind == LINEAR for kind in self.config.layer_types):
            B, T = embeds.shape[:2]
            if position_ids is None:
                start = tokens_seen(cache.layers[0])
                position_ids = torch.arange(start, start + T, device=embeds.device)[None]
            attention_mask = torch.ones(B, 1, T, 1, dtype=torch.bool, device=embeds.device)
        return attention_mask, position_ids

    def _attentions_per_layer(self, out):
        """`output_attentions` as one entry per layer: None for a linear layer, which makes no attention matrix."""
        linear = [kind == LINEAR for kind in self.config.layer_types]
        if out.attentions is not None and len(out.attentions) == linear.count(False) and any(linear):
            recorded = iter(out.attentions)
            out.attentions = tuple(None if is_linear else next(recorded) for is_linear in linear)
        return out

    def _check_cache(self, cache: Cache | None) -> None:
        if cache is None:
            return
        kinds = self.config.layer_types
        if not isinstance(cache, Cache) or len(cache.layers) != len(kinds) or any(
            (kind == LINEAR) != isinstance(layer, LinearizeCacheLayer) for kind, layer in zip(kinds, cache.layers)
        ):
            raise ValueError("this model's cache holds linear states: build it with DynamicCache(config=model.config)")


def _is_public(cls: type) -> bool:
    """Whether `cls` is `LinearizeModel` or `LinearizeForCausalLM` itself rather than one of their hybrid classes."""
    return "family_mapping" in cls.__dict__


class LinearizeModel(LinearizePreTrainedModel):
    """The backbone, as the base family's `AutoModel` gives it (`LlamaModel`, ...): hidden states and the cache."""

    family_mapping = "MODEL_MAPPING"
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]  # an export holds the causal LM: its head is not the backbone's

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ):
        """The family's forward, with the hybrid cache, the padding mask for linear layers and per-layer attentions."""
        cache = self._hybrid_cache(cache, use_cache)
        embeds = inputs_embeds if inputs_embeds is not None else input_ids
        self._note_padding(cache, attention_mask, embeds, kwargs)
        attention_mask, position_ids = self._hybrid_inputs(embeds, attention_mask, position_ids, cache, kwargs)
        return_dict = kwargs.pop("return_dict", None)
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        out = self._attentions_per_layer(out)
        return out if (getattr(self.config, "return_dict", True) if return_dict is None else return_dict) else out.to_tuple()


class LinearizeForCausalLM(DecodingRuntime, LinearizePreTrainedModel, GenerationMixin):
    """The base family's causal LM (`LlamaForCausalLM`, ...) with the linear layers of `config.layer_types` converted."""

    family_mapping = "MODEL_FOR_CAUSAL_LM_MAPPING"

    def __init__(self, config: LinearizeConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.cpu_decode_layout = False  # large weights column-major for SplitGemvLinear, from the first CPU decoding step
        self.compiled_step: Callable | None = None  # the decoding step's graph, once `compile_decoding` asks for it

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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
    ):
        """The family's forward, with the hybrid cache, the padding mask for linear layers and per-layer attentions.

        A decoding step (one token, a cache, no gradient) may take another path (`DecodingRuntime._decoding_path`):
        the graph of `compile_decoding`, or on CPU the eager step over weights laid out for it.
        """
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = self._hybrid_cache(cache, use_cache)
        embeds = inputs_embeds if inputs_embeds is not None else input_ids
        forward, in_place = self._decoding_path(cache, embeds)
        self._note_padding(cache, attention_mask, embeds, kwargs)
        return_dict = kwargs.pop("return_dict", None)
        args = (input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache, logits_to_keep)
        out = self._run_step(forward, args, kwargs) if in_place else forward(*args, **kwargs)
        return out if (getattr(self.config, "return_dict", True) if return_dict is None else return_dict) else out.to_tuple()

    def _forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache, logits_to_keep, **kwargs):
        """`forward` past its cache and layout set-up: what `compile_decoding` compiles."""
        embeds = inputs_embeds if inputs_embeds is not None else input_ids
        attention_mask, position_ids = self._hybrid_inputs(embeds, attention_mask, position_ids, cache, kwargs)
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            return_dict=True,
            **kwargs,
        )
        return self._attentions_per_layer(out)

    def generate(self, *args, **kwargs):
        """The family's generate; assisted decoding is refused, as a recurrent state cannot be rolled back."""
        config = kwargs.get("generation_config")
        assisted = kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens") or (
            config is not None and (config.prompt_lookup_num_tokens or getattr(config, "assistant_early_exit", None))
        )
        if assisted and LINEAR in self.config.layer_types:
            raise ValueError(
                "assisted and speculative decoding roll the cache back, which linear layers' recurrent state cannot do: "
                "generate without assistant_model / prompt_lookup_num_tokens"
            )
        return super().generate(*args, **kwargs)


__all__ = ["LinearizeConfig", "LinearizeModel", "LinearizeForCausalLM", "LinearAttention"]
