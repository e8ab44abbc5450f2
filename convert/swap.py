"""Swap: a teacher `PreTrainedModel` -> a `LinearizeForCausalLM` with the chosen layers linear.

The student is built from the teacher's config plus the layer plan, then takes every teacher
weight under the same name; only the linear layers' new parameters (feature maps, gates, window
mix) start from their own initialization.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..modeling.configuration_linearize import LinearizeConfig
from ..modeling.modeling_linearize import LinearAttention, LinearizeForCausalLM

logger = logging.getLogger(__name__)

SUPPORTED = {
    "llama": {"qk_norm": False},
    "mistral": {"qk_norm": False},
    "qwen2": {"qk_norm": False},
    "qwen3": {"qk_norm": True},
    "linearize": {},
}


def check_supported(config: PretrainedConfig) -> None:
    """Raise, listing the supported families, when the teacher's architecture is not one of them."""
    if config.model_type not in SUPPORTED:
        names = ", ".join(sorted(k for k in SUPPORTED if k != "linearize"))
        raise ValueError(
            f"unsupported architecture {config.model_type!r}: linearize converts Llama-family models ({names})"
        )


def student_config(
    teacher: PretrainedConfig, layer_types: list[str], linear_attention: dict[str, Any], teacher_name: str | None = None
) -> LinearizeConfig:
    """The student's config: every base field of the teacher, plus the layer plan and linear settings."""
    check_supported(teacher)
    kind = teacher.model_type
    if kind == "linearize":
        fields = teacher.to_dict()
        fields.update(layer_types=layer_types, linear_attention=linear_attention)
        return LinearizeConfig(**fields)
    attention_bias = bool(getattr(teacher, "attention_bias", False))
    if kind == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attention_bias
    if getattr(teacher, "use_sliding_window", False) or (kind == "mistral" and getattr(teacher, "sliding_window", None)):
        logger.warning("the teacher uses sliding-window attention; its softmax layers become full attention here")
    return LinearizeConfig(
        vocab_size=teacher.vocab_size,
        hidden_size=teacher.hidden_size,
        intermediate_size=teacher.intermediate_size,
        num_hidden_layers=teacher.num_hidden_layers,
        num_attention_heads=teacher.num_attention_heads,
        num_key_value_heads=teacher.num_key_value_heads,
        head_dim=getattr(teacher, "head_dim", None) or teacher.hidden_size // teacher.num_attention_heads,
        hidden_act=teacher.hidden_act,
        max_position_embeddings=teacher.max_position_embeddings,
        initializer_range=teacher.initializer_range,
        rms_norm_eps=teacher.rms_norm_eps,
        pad_token_id=teacher.pad_token_id,
        bos_token_id=teacher.bos_token_id,
        eos_token_id=teacher.eos_token_id,
        tie_word_embeddings=teacher.tie_word_embeddings,
        rope_parameters=dict(teacher.rope_parameters),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(teacher, "mlp_bias", False)),
        qk_norm=SUPPORTED[kind]["qk_norm"],
        attention_dropout=float(getattr(teacher, "attention_dropout", 0.0) or 0.0),
        base_model_type=kind,
        layer_types=layer_types,
        linear_attention=linear_attention,
        linearize_teacher=teacher_name,
    )


def linearize_model(
    teacher: PreTrainedModel,
    layer_types: list[str],
    linear_attention: dict[str, Any] | None = None,
    teacher_name: str | None = None,
) -> LinearizeForCausalLM:
    """Build the hybrid student from a teacher in memory; the teacher is left untouched."""
    config = student_config(teacher.config, layer_types, linear_attention or {}, teacher_name)
    config._attn_implementation = teacher.config._attn_implementation or "sdpa"
    dtype = next(teacher.parameters()).dtype
    student = LinearizeForCausalLM(config).to(dtype)
    state = teacher.state_dict()
    missing, unexpected = student.load_state_dict(state, strict=False)
    new = {name for name in missing if _is_new_parameter(student, name)}
    if set(missing) - new - {"lm_head.weight"} or unexpected:
        raise ValueError(
            f"teacher weights do not match the student layout (missing {sorted(set(missing) - new)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}): is this a Llama-family checkpoint?"
        )
    if config.tie_word_embeddings:
        student.tie_weights()
    student.generation_config = copy.deepcopy(teacher.generation_config)
    return student.to(next(teacher.parameters()).device)


def _is_new_parameter(student: torch.nn.Module, name: str) -> bool:
    """Parameters that only linear layers have (the teacher cannot provide them)."""
    owner = name.rsplit(".", 1)[0]
    module = student.get_submodule(owner) if owner else student
    while owner and not isinstance(module, LinearAttention):
        owner = owner.rsplit(".", 1)[0] if "." in owner else ""
        module = student.get_submodule(owner) if owner else student
    if not isinstance(module, LinearAttention):
        return False
    tail = name[len(owner) + 1 :]
    return not tail.startswith(("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))


def new_parameters(student: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters of stage 1, by name: those the teacher does not have."""
    return {name: p for name, p in student.named_parameters() if _is_new_parameter(student, name)}
