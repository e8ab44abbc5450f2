"""Configuration of a linearized (hybrid linear/softmax attention) causal LM of any supported family.

The config carries every field of the base model's own config (resolved by that config class, so
defaults and derived values are the family's), plus:
- `base_model_type`: the family (`llama`, `gemma3_text`, `gpt_neox`, ...) whose transformers classes
  the model is built from;
- `layer_types`: what each layer's cache holds. Linear layers are `linear_attention` (a fixed-size
  state: transformers' `LinearAttentionLayer`); softmax layers keep the base model's own type
  (`full_attention`, `sliding_attention`), so `DynamicCache(config=...)` builds the right cache;
- `base_layer_types`: the base config's own `layer_types` (None if it has none), which the family
  model is built with, so its masks and rotary embeddings per layer type stay the teacher's;
- `linear_attention`: the settings of the linear layers.
"""

from __future__ import annotations

import math

from typing import Any

from transformers import PretrainedConfig

LINEAR = "linear_attention"
# Feature maps whose features are positive: what a shared normalizer phi(q).z needs (the delta rule's
# normalized form takes only these).
POSITIVE_FEATURE_MAPS = ("hedgehog", "elu")
LINEAR_ATTENTION_DEFAULTS: dict[str, Any] = {
    # "gla" (gated, decaying state), "performer" (FAVOR+ random features, no decay) or "deltanet" (gated delta rule)
    "kind": "gla",
    "feature_map": "hedgehog",  # "hedgehog" | "elu" | "identity" | "taylor" | "performer"
    # hedgehog: per-half width (default head_dim); taylor: projection size d (default 16, 1 + d + d^2
    # features); performer: random features (default 4*head_dim)
    "feature_dim": None,
    # "lowrank" (learned; per key channel, per head for taylor and unnormalized deltanet) | "key" (no weights) |
    # "retnet" (fixed multi-scale per-head decay, no weights) | "none"
    "gate": "lowrank",
    "gate_rank": 16,
    "decay_init": [0.995, 0.9998],  # lowrank gate: initial decays, spread over the key channels
    # Divide by phi(q).z. For deltanet: true keeps GLA's normalized state and its write, the delta rule
    # erasing along the unit key before each write; false L2-normalizes q/k and adds its output.
    "normalize": True,
    "window": 0,  # >0: softmax over the last `window` tokens mixed into every linear layer
    "sink": 0,  # with a window: the first `sink` tokens also stay in the softmax part (attention sinks)
    # With a window: each head's mix starts at this logit toward the softmax side. 2.0 gives the window
    # sigmoid(2) = 0.88 of the weight, close to sliding-window-plus-sinks attention; 0 splits it evenly.
    "window_logit": 2.0,
    "chunk_size": 64,
    "conv_size": 0,  # deltanet: >1 adds a short causal convolution over q/k/v features (identity at start)
    # True: feature maps see RoPE'd q/k, as the teacher's softmax does. False: q/k before RoPE, so the
    # linear state is position-free (recency comes from the decay) and holds up past the training length.
    "rope_features": True,
    "seed": 0,  # performer random features are drawn from this seed and saved as a buffer
}
# What a linear layer keeps in its cache layer (`LinearizeCacheLayer`, a transformers `LinearAttentionLayer`), by state index. Keys and values of the
# sinks and of the window's ring are stored as [B, Hkv, 2, tokens, D]: each a contiguous block, as the
# decoding step's matmuls read them fastest; what else a token carries until it enters the state
# (keys before RoPE, the write strength) sits in `window_payload`.
STATES = {
    "memory": 0,
    "stabilizer": 1,
    "sink_kv": 2,
    "sink_positions": 3,
    "window_kv": 4,
    "window_valid": 5,
    "conv": 6,
    "window_payload": 7,
}
OWN_FIELDS = ("base_model_type", "layer_types", "base_layer_types", "linear_attention", "linearize_teacher")
# Fields of a saved config that describe the file, not the base model.
NOT_BASE_FIELDS = ("model_type", "transformers_version", "architectures", "auto_map", "number_of_conv_states")


def base_config_class(model_type: str) -> type[PretrainedConfig]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"base_model_type {model_type!r} is not a transformers model type")
    return CONFIG_MAPPING[model_type]


class LinearizeConfig(PretrainedConfig):
    """The base family's fields + `layer_types` + `linear_attention` settings."""

    model_type = "linearize"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        base_model_type: str = "llama",
        layer_types: list[str] | None = None,
        base_layer_types: list[str] | None = None,
        linear_attention: dict[str, Any] | None = None,
        linearize_teacher: str | None = None,
        **fields,
    ):
        saved = {k: fields.pop(k) for k in ("auto_map", "architectures") if k in fields}  # the export's, not the base's
        fields = {k: v for k, v in fields.items() if k not in NOT_BASE_FIELDS}
        implementation = fields.pop("attn_implementation", None)
        if base_layer_types is not None:
            fields["layer_types"] = base_layer_types
        base = base_config_class(base_model_type)(**fields)
        resolved = {k: v for k, v in base.to_dict().items() if k not in NOT_BASE_FIELDS and k != "layer_types"}
        self.base_model_type = base_model_type
        self.base_layer_types = list(base.layer_types) if getattr(base, "layer_types", None) else None
        self.linearize_teacher = linearize_teacher
        self.linear_attention = {**LINEAR_ATTENTION_DEFAULTS, **(linear_attention or {})}
        num_layers = resolved["num_hidden_layers"]
        self.layer_types = list(layer_types or self.base_layer_types or ["full_attention"] * num_layers)
        # The linear layers' states (see STATES); transformers sizes every LinearAttentionLayer by this.
        self.number_of_conv_states = len(STATES)
        self.validate_layers(num_layers)
        super().__init__(attn_implementation=implementation, **resolved, **saved)
        self.use_cache = resolved.get("use_cache", True)  # popped by the base __init__ as a generation setting

    def base_config(self) -> PretrainedConfig:
        """The base family's own config, as the teacher had it: what the family's classes are built from."""
        fields = {k: v for k, v in self.to_dict().items() if k not in OWN_FIELDS + NOT_BASE_FIELDS}
        if self.base_layer_types is not None:
            fields["layer_types"] = list(self.base_layer_types)
        config = base_config_class(self.base_model_type)(**fields)
        config._attn_implementation_internal = self._attn_implementation_internal
        return config

    def softmax_type(self, index: int) -> str:
        """The base model's attention type of layer `index` (what its cache holds when it stays softmax)."""
        return self.base_layer_types[index] if self.base_layer_types else "full_attention"

    def validate_layers(self, num_layers: int) -> None:
        """Fail early, with the fix, on a layer plan the model cannot build."""
        if len(self.layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but the model has {num_layers} layers")
        allowed = {LINEAR, *(self.base_layer_types or ["full_attention"])}
        bad = sorted(set(self.layer_types) - allowed)
        if bad:
            raise ValueError(f"unknown layer types {bad}: use {sorted(allowed)}")
        for i, kind in enumerate(self.layer_types):
            if kind != LINEAR and kind != self.softmax_type(i):
                raise ValueError(
                    f"layer {i} is {self.softmax_type(i)!r} in the base model: keep that type or make it {LINEAR!r}"
                )
        validate_linear_attention(self.linear_attention)


def validate_linear_attention(settings: dict[str, Any]) -> None:
    """Refuse, naming the fix, linear-attention settings no layer can be built with (recipes check them before any model loads)."""
    unknown = sorted(set(settings) - set(LINEAR_ATTENTION_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown linear_attention settings {unknown}: valid keys are {sorted(LINEAR_ATTENTION_DEFAULTS)}"
        )
    window = settings["window"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"linear_attention.window={window!r}: use a non-negative integer (0 = no window)")
    if settings["kind"] not in ("gla", "performer", "deltanet"):
        raise ValueError(f"linear_attention.kind={settings['kind']!r}: use 'gla', 'performer' or 'deltanet'")
    if settings["feature_map"] not in ("hedgehog", "elu", "identity", "taylor", "performer"):
        raise ValueError(
            f"linear_attention.feature_map={settings['feature_map']!r}: use hedgehog, elu, identity, taylor or performer"
        )
    if settings["kind"] == "deltanet" and settings["feature_map"] == "performer":
        raise ValueError("deltanet attention does not take performer features: use hedgehog, elu, identity or taylor")
    if settings["kind"] == "deltanet" and settings["normalize"] and settings["feature_map"] not in POSITIVE_FEATURE_MAPS:
        raise ValueError(
            "deltanet with normalize=true keeps GLA's normalizer, which needs positive features: "
            "use feature_map hedgehog or elu, or normalize=false"
        )
    conv = settings["conv_size"]
    if isinstance(conv, bool) or not isinstance(conv, int) or conv < 0 or conv == 1:
        raise ValueError(f"linear_attention.conv_size={conv!r}: use 0 (no convolution) or a kernel size of at least 2")
    if conv and settings["kind"] != "deltanet":
        raise ValueError("linear_attention.conv_size is a deltanet setting: set kind='deltanet' or conv_size=0")
    if settings["kind"] == "performer" and (settings["feature_map"] != "performer" or not settings["normalize"]):
        raise ValueError("performer attention needs feature_map='performer' and normalize=true")
    if settings["gate"] not in ("lowrank", "key", "retnet", "none"):
        raise ValueError(f"linear_attention.gate={settings['gate']!r}: use lowrank, key, retnet or none")
    if settings["kind"] == "gla" and settings["feature_map"] == "performer" and settings["gate"] != "none":
        raise ValueError("performer features carry their own stabilizer decay: use gate='none' with them")
    decay = settings["decay_init"]
    if not (isinstance(decay, (list, tuple)) and len(decay) == 2 and all(0 < float(d) < 1 for d in decay)):
        raise ValueError(f"linear_attention.decay_init={decay!r}: use two decays in (0, 1), e.g. [0.995, 0.9998]")
    logit = settings["window_logit"]
    if isinstance(logit, bool) or not isinstance(logit, (int, float)) or not math.isfinite(logit):
        raise ValueError(f"linear_attention.window_logit={logit!r}: use a finite number (2.0 = 0.88 on the window)")
    sink = settings["sink"]
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"linear_attention.sink={sink!r}: use a non-negative integer (0 = no sinks)")
    if sink and not window:
        raise ValueError("attention sinks live in the softmax window: set linear_attention.window > 0 too")
    if settings["window"] and not settings["normalize"] and settings["kind"] != "deltanet":
        raise ValueError("a softmax window needs normalize=true: the window and the linear part share one normalizer")
