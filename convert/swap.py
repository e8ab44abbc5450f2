"""Swap: a teacher `PreTrainedModel` -> a `LinearizeForCausalLM` with the chosen layers linear.

The student is the teacher's own family model, built from the teacher's config plus the layer
plan; it takes every teacher weight under the same name, and only the linear layers' new
parameters (feature maps, gates, window mix) start from their own initialization. A multimodal
teacher (Gemma 3) gives its text decoder.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..modeling.configuration_linearize import LINEAR, LinearizeConfig
from ..modeling.families import family_of
from ..modeling.modeling_linearize import LinearAttention, LinearizeForCausalLM

# Teacher weights that belong to a multimodal wrapper, not to its text decoder: prefix -> the decoder's.
TEXT_PREFIXES = {"gemma3": ("model.language_model.", "model.")}


def check_supported(config: PretrainedConfig) -> None:
    """Raise, naming what is unsupported and the supported families, when the teacher cannot be converted."""
    if config.model_type == "linearize":
        return
    family_of(config.get_text_config())


def student_config(
    teacher: PretrainedConfig, layer_types: list[str], linear_attention: dict[str, Any], teacher_name: str | None = None
) -> LinearizeConfig:
    """The student's config: every base field of the teacher, the layer plan and the linear settings.

    In `layer_types`, `linear_attention` marks a linear layer; any other entry keeps the base model's own
    attention type for that layer (full or sliding-window softmax).
    """
    check_supported(teacher)
    if teacher.model_type == "linearize":
        fields = teacher.to_dict()
        fields.update(layer_types=_with_base_types(layer_types, teacher.base_layer_types))
        fields["linear_attention"] = linear_attention
        return LinearizeConfig(**fields)
    base = teacher.get_text_config()
    base_types = list(base.layer_types) if getattr(base, "layer_types", None) else None
    return LinearizeConfig(
        base_model_type=base.model_type,
        layer_types=_with_base_types(layer_types, base_types),
        base_layer_types=base_types,
        linear_attention=linear_attention,
        linearize_teacher=teacher_name,
        **{k: v for k, v in base.to_dict().items() if k != "layer_types"},
    )


def _with_base_types(layer_types: list[str], base_types: list[str] | None) -> list[str]:
    if base_types is not None and len(base_types) != len(layer_types):
        raise ValueError(f"layer_types has {len(layer_types)} entries but the model has {len(base_types)} layers")
    return [LINEAR if kind == LINEAR else (base_types[i] if base_types else "full_attention") for i, kind in enumerate(layer_types)]


def linearize_model(
    teacher: PreTrainedModel,
    layer_types: list[str],
    linear_attention: dict[str, Any] | None = None,
    teacher_name: str | None = None,
) -> LinearizeForCausalLM:
    """Build the hybrid student from a teacher in memory, sharing the teacher's weight tensors.

    The student is built on the meta device and takes the teacher's tensors as its own (no copy, no
    random init of weights that are overwritten anyway), so teacher and student together hold one
    set of frozen weights. Only the linear layers' new parameters get memory and their own init.
    Nothing here or in training writes a shared tensor in place (the LoRA merge gets its own copies of
    the adapted projections first), so the teacher stays as it was.
    """
    config = student_config(teacher.config, layer_types, linear_attention or {}, teacher_name)
    config._attn_implementation_internal = teacher.config.get_text_config()._attn_implementation or "sdpa"
    first = next(teacher.parameters())
    with torch.device("meta"):
        student = LinearizeForCausalLM(config)
    tensors = _decoder_tensors(teacher)
    unused = set(tensors)
    missing = []
    for module_name, module in student.named_modules():
        for slot in ("_parameters", "_buffers"):
            for name, tensor in list(getattr(module, slot).items()):
                full = f"{module_name}.{name}" if module_name else name
                if tensor is None or full not in tensors:
                    if tensor is not None and not _is_new_parameter(student, full):
                        missing.append(full)
                    continue
                unused.discard(full)
                source = tensors[full]
                if slot == "_parameters":
                    module._parameters[name] = torch.nn.Parameter(source, requires_grad=tensor.requires_grad)
                else:
                    module._buffers[name] = source
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [name for name in missing if name not in tied]
    if missing or unused - tied:
        raise ValueError(
            f"teacher weights do not match the student layout (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unused - tied)[:5]}): is the checkpoint complete?"
        )
    for layer in student.modules():
        if isinstance(layer, LinearAttention):
            layer.materialize_linear_parts(first.device, first.dtype)
    if config.tie_word_embeddings:
        student.tie_weights()
    student.generation_config = copy.deepcopy(teacher.generation_config)
    return student


def _decoder_tensors(teacher: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Every teacher parameter and buffer under the text decoder's names (a multimodal wrapper's other towers dropped)."""
    named = dict(teacher.named_parameters(remove_duplicate=False))
    named.update(teacher.named_buffers(remove_duplicate=False))
    if teacher.config.model_type not in TEXT_PREFIXES:
        return named
    wrapper, decoder = TEXT_PREFIXES[teacher.config.model_type]
    out = {decoder + k[len(wrapper) :]: v for k, v in named.items() if k.startswith(wrapper)}
    out.update({k: v for k, v in named.items() if k.startswith("lm_head.")})
    return out


def _is_new_parameter(student: torch.nn.Module, name: str) -> bool:
    """Parameters that only linear layers have (the teacher cannot provide them)."""
    owner, _, tail = name.rpartition(".")
    while owner:
        module = student.get_submodule(owner)
        if isinstance(module, LinearAttention):
            return tail.split(".")[0] in module.linear_parts
        owner, _, head = owner.rpartition(".")
        tail = f"{head}.{tail}"
    return False


def new_parameters(student: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters of stage 1, by name: those the teacher does not have."""
    return {name: p for name, p in student.named_parameters() if _is_new_parameter(student, name)}
