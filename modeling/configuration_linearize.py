"""Configuration of a linearized (hybrid linear/softmax attention) Llama-family causal LM.

It keeps every field of the base architecture (Llama, Mistral, Qwen2, Qwen3 share one layout)
and adds `layer_types` plus `linear_attention`, the settings of the linear layers.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

LAYER_TYPES = ("full_attention", "linear_attention", "hybrid_sliding")

LINEAR_ATTENTION_DEFAULTS: dict[str, Any] = {
    "kind": "gla",  # "gla" (gated, decaying state) or "performer" (FAVOR+ random features, no decay)
    "feature_map": "hedgehog",  # "hedgehog" | "elu" | "identity" | "performer"
    "feature_dim": None,  # hedgehog: per-half width (default head_dim); performer: random features (default 4*head_dim)
    "gate": "lowrank",  # gla: "lowrank" (learned, per key channel) | "key" (no weights) | "none"
    "gate_rank": 16,
    "decay_init": [0.995, 0.9998],  # lowrank gate: initial decays, spread over the key channels
    "normalize": True,  # divide by phi(q).z
    "window": 0,  # >0: softmax over the last `window` tokens mixed into the linear layer
    "sink": 0,  # with a window: the first `sink` tokens also stay in the softmax part (attention sinks)
    "chunk_size": 64,
    # True: feature maps see RoPE'd q/k, as the teacher's softmax does. False: q/k before RoPE, so the
    # linear state is position-free (recency comes from the decay) and holds up past the training length.
    "rope_features": True,
    "seed": 0,  # performer random features are drawn from this seed and saved as a buffer
}


class LinearizeConfig(PretrainedConfig):
    """Base Llama-family fields + `layer_types` + `linear_attention` settings."""

    model_type = "linearize"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        tie_word_embeddings: bool = False,
        rope_parameters: dict | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        mlp_bias: bool = False,
        qk_norm: bool = False,
        attention_dropout: float = 0.0,
        base_model_type: str = "llama",
        layer_types: list[str] | None = None,
        linear_attention: dict[str, Any] | None = None,
        linearize_teacher: str | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        self.qkv_bias = qkv_bias
        self.o_bias = o_bias
        self.mlp_bias = mlp_bias
        self.qk_norm = qk_norm
        self.attention_dropout = attention_dropout
        self.base_model_type = base_model_type
        self.linearize_teacher = linearize_teacher
        self.layer_types = list(layer_types or ["full_attention"] * num_hidden_layers)
        self.linear_attention = {**LINEAR_ATTENTION_DEFAULTS, **(linear_attention or {})}
        window = self.linear_attention["window"]
        # The hybrid cache keeps `sliding_window - 1` tokens: the window plus the key about to enter the state.
        self.sliding_window = window + 1 if window else None
        # Linear layers keep up to four states: the (key x value) memory, Performer's key stabilizer,
        # and the attention sinks' keys/values and positions.
        self.number_of_conv_states = 4
        # Our check first: transformers' own layer_types validator (in super().__init__) raises a
        # non-ValueError listing layer types this model cannot build.
        self.validate_layers()
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def validate_layers(self) -> None:
        """Fail early, with the fix, on a layer plan the model cannot build."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but the model has {self.num_hidden_layers} layers"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer types {bad}: use {list(LAYER_TYPES)}")
        settings = self.linear_attention
        unknown = sorted(set(settings) - set(LINEAR_ATTENTION_DEFAULTS))
        if unknown:
            raise ValueError(
                f"unknown linear_attention settings {unknown}: valid keys are {sorted(LINEAR_ATTENTION_DEFAULTS)}"
            )
        window = settings["window"]
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"linear_attention.window={window!r}: use a non-negative integer (0 = no window)")
        if settings["kind"] not in ("gla", "performer"):
            raise ValueError(f"linear_attention.kind={settings['kind']!r}: use 'gla' or 'performer'")
        if settings["feature_map"] not in ("hedgehog", "elu", "identity", "performer"):
            raise ValueError(
                f"linear_attention.feature_map={settings['feature_map']!r}: use hedgehog, elu, identity or performer"
            )
        if settings["kind"] == "performer" and (settings["feature_map"] != "performer" or not settings["normalize"]):
            raise ValueError("performer attention needs feature_map='performer' and normalize=true")
        if settings["gate"] not in ("lowrank", "key", "none"):
            raise ValueError(f"linear_attention.gate={settings['gate']!r}: use lowrank, key or none")
        if settings["kind"] == "gla" and settings["feature_map"] == "performer" and settings["gate"] != "none":
            raise ValueError("performer features carry their own stabilizer decay: use gate='none' with them")
        decay = settings["decay_init"]
        if not (isinstance(decay, (list, tuple)) and len(decay) == 2 and all(0 < float(d) < 1 for d in decay)):
            raise ValueError(f"linear_attention.decay_init={decay!r}: use two decays in (0, 1), e.g. [0.995, 0.9998]")
        sink = settings["sink"]
        if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
            raise ValueError(f"linear_attention.sink={sink!r}: use a non-negative integer (0 = no sinks)")
        if sink and not window:
            raise ValueError("attention sinks live in the softmax window: set linear_attention.window > 0 too")
        if settings["window"] and not settings["normalize"]:
            raise ValueError("a softmax window needs normalize=true: the window and the linear part share one normalizer")
        if "hybrid_sliding" in self.layer_types and not settings["window"]:
            raise ValueError("hybrid_sliding layers need linear_attention.window > 0")
