"""Per-family adapters: what a converted attention layer must know about the teacher's own module.

Everything else (embeddings, decoder layers, norms, MLPs, rotary embeddings per layer type,
masks, soft-capping, the output head) stays the family's own transformers classes. An adapter
says only where the attention module and its projections live and how q/k/v come out of them;
partial rotary comes with the family's own `apply_rotary_pos_emb`, and the attention scale is
the module's own `scaling` (Gemma's query_pre_attn_scalar, Granite's attention_multiplier).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True)
class Family:
    attention: str = "self_attn"  # the decoder layer's attention module
    qkv: str = "separate"  # "separate" q/k/v_proj | "fused" qkv_proj = [q | k | v] | "per_head" query_key_value = per head [q k v]
    qk_norm: str | None = None  # "head": per-head q/k norms (Qwen3, Gemma3) | "flat": over the whole projection (OLMo 2)
    output: str = "o_proj"  # the output projection
    cache_arg: str = "cache"  # the keyword the decoder layer passes the cache under

    @property
    def projections(self) -> tuple[str, ...]:
        """The attention module's linear projections, by name (LoRA's default targets)."""
        inputs = {"separate": ("q_proj", "k_proj", "v_proj"), "fused": ("qkv_proj",), "per_head": ("query_key_value",)}
        return (*inputs[self.qkv], self.output)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "granite": Family(),
    "qwen3": Family(qk_norm="head"),
    "gemma3_text": Family(qk_norm="head"),
    "olmo2": Family(qk_norm="flat"),
    "phi3": Family(qkv="fused"),
    "gpt_neox": Family(attention="attention", qkv="per_head", output="dense", cache_arg="layer_past"),
}
# Families whose attention is not multi-head q/k/v, with the reason given back to the user.
KNOWN_UNSUPPORTED = {
    "deepseek_v2": "multi-head latent attention (compressed KV)",
    "deepseek_v3": "multi-head latent attention (compressed KV)",
    "kimi_k2": "multi-head latent attention (compressed KV)",
    "mamba": "no attention layers (a state-space model)",
    "mamba2": "no attention layers (a state-space model)",
}


def sliding_layers(config: PretrainedConfig) -> list[int]:
    """Indices of the decoder's sliding-window softmax layers, as its `layer_types` marks them."""
    return [i for i, kind in enumerate(getattr(config.get_text_config(), "layer_types", None) or []) if kind == "sliding_attention"]


def family_of(config: PretrainedConfig) -> Family:
    """The adapter for a (text) config, or a one-line error naming what is unsupported."""
    kind = config.model_type
    if kind in FAMILIES:
        return FAMILIES[kind]
    supported = ", ".join(sorted(FAMILIES))
    if getattr(config, "is_encoder_decoder", False):
        reason = "encoder-decoder models"
    elif kind in KNOWN_UNSUPPORTED:
        reason = KNOWN_UNSUPPORTED[kind]
    elif getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        reason = "multi-head latent attention (compressed KV)"
    else:
        reason = "its attention layout"
    raise ValueError(f"unsupported architecture {kind!r} ({reason}): linearize converts decoder-only {supported}")
