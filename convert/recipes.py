"""Recipes: one YAML file = one complete, reproducible conversion.

A recipe is validated against the dataclasses below; any unknown key or wrong type is a one-line
error naming the key. Shipped recipes live in the `recipes/` folder (package data); their `aliases`
are the CLI's short model names.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from ..modeling.configuration_linearize import LINEAR_ATTENTION_DEFAULTS, validate_linear_attention
from ..options import dtype_name
from .data import is_offline
from .plan import PLACEMENTS, SCORED, LayerPlan, parse_ratio


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """What `auto` means everywhere: bf16 on a GPU (half fp32's memory), fp32 on a CPU (faster there than bf16)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclass
class Attention:
    kind: str = "gla"
    feature_map: str = "hedgehog"
    feature_dim: int | None = None
    gate: str = "lowrank"
    gate_rank: int = 16
    decay_init: list[float] = field(default_factory=lambda: [0.995, 0.9998])
    normalize: bool = True
    window: int = 0
    sink: int = 0
    window_logit: float = 2.0
    chunk_size: int = 64
    conv_size: int = 0
    rope_features: bool = True
    seed: int = 0


@dataclass
class Stage:
    """Data and optimization of one training stage; `tokens: 0` skips it."""

    tokens: int = 0
    dataset: str = "embedded"
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    seq_len: int | list[int] = 512  # a list is a length curriculum: equal token shares, in the order given
    batch_size: int = 4  # rows per step at the first length; longer lengths keep its tokens per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    loss: str = "mse"  # transfer: mse; finetune: kl | ce
    # transfer: position t of a T-token row weighs 1 + late_weight * t / T in the MSE (0: uniform), so
    # the fit leans toward late positions, where the state holds the most context
    late_weight: float = 0.0
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: list[str] = field(default_factory=list)  # empty: the attention's own projections, per family
    lora_layers: str = "linear"  # linear: the swapped layers only; all: every attention layer
    checkpoint_every: int = 25  # optimizer steps
    # Recompute activations in backward (finetune): None decides by size, on when they would outweigh the weights.
    gradient_checkpointing: bool | None = None

    @property
    def seq_lens(self) -> list[int]:
        return [self.seq_len] if isinstance(self.seq_len, int) else list(self.seq_len)


@dataclass
class Evaluation:
    heldout_tokens: int = 16384
    heldout_seq_len: int = 512  # the before/after perplexity's window (the untrained student is scored at it)
    # Perplexity against context: teacher and student score the same held-out tokens in windows of each
    # length (and of heldout_seq_len); lengths past the model's max_position_embeddings are dropped.
    contexts: list[int] = field(default_factory=lambda: [512, 2048, 4096])
    tasks: list[str] = field(default_factory=lambda: ["arc_easy", "piqa", "hellaswag"])
    limit: int | None = 200


@dataclass
class Recipe:
    name: str = "custom"
    description: str = ""
    model: str = "embedded:smollm2-135m-instruct"
    aliases: list[str] = field(default_factory=list)
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on GPU
    seed: int = 0
    layers: LayerPlan = field(default_factory=LayerPlan)
    attention: Attention = field(default_factory=Attention)
    transfer: Stage = field(default_factory=lambda: Stage(tokens=0, lr=1e-2, loss="mse"))
    finetune: Stage = field(default_factory=lambda: Stage(tokens=0, lr=1e-4, loss="kl"))
    eval: Evaluation = field(default_factory=Evaluation)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the teacher loads in: the recipe's, or for `auto` the device's (`auto_dtype`)."""
        return auto_dtype(device) if self.dtype == "auto" else getattr(torch, self.dtype)

    def linear_attention(self) -> dict[str, Any]:
        return {k: getattr(self.attention, k) for k in LINEAR_ATTENTION_DEFAULTS}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(value: Any, annotation: Any, where: str) -> Any:
    """Validate one value against a (simple) type annotation; return it, coerced where harmless."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(value, option, where)
            except ValueError as err:
                errors.append(err)
        raise errors[0]
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"recipe key {where!r} must be a list, got {value!r}")
        (item,) = typing.get_args(annotation)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, where)
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if annotation is str and isinstance(value, (int, float)) and not isinstance(value, bool) and where.endswith("ratio"):
        raise ValueError(f"recipe key {where!r} must be a quoted string like \"3:1\", got {value!r}")
    if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
        raise ValueError(f"recipe key {where!r} must be {annotation.__name__}, got {value!r}")
    return value


def _build(cls: type, data: Any, where: str = "") -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"recipe section {where or 'top level'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ValueError(f"unknown recipe key {key!r}: allowed keys here are {', '.join(names)}")
    base = cls()
    values = {}
    for name in names:
        if name in data:
            sub = f"{where}.{name}" if where else name
            current = getattr(base, name)
            if dataclasses.is_dataclass(current):
                section = data[name] or {}
                if not isinstance(section, dict):
                    raise ValueError(f"recipe section {sub!r} must be a mapping, got {section!r}")
                merged = {**dataclasses.asdict(current), **section}
                values[name] = _check(merged, hints[name], sub)
            else:
                values[name] = _check(data[name], hints[name], sub)
    return dataclasses.replace(base, **values)


def parse_recipe(data: dict[str, Any]) -> Recipe:
    """A validated `Recipe` from a mapping (defaults fill what it leaves out)."""
    recipe = _build(Recipe, data)
    if recipe.transfer.loss != "mse":
        raise ValueError("recipe key 'transfer.loss' must be 'mse' (attention transfer matches outputs)")
    if recipe.finetune.loss not in ("kl", "ce"):
        raise ValueError(f"recipe key 'finetune.loss' must be 'kl' or 'ce', got {recipe.finetune.loss!r}")
    if recipe.finetune.late_weight:
        raise ValueError("recipe key 'finetune.late_weight' has no effect: position weighting is stage 1's, set 'transfer.late_weight'")
    if recipe.transfer.gradient_checkpointing is not None:
        raise ValueError(
            "recipe key 'transfer.gradient_checkpointing' has no effect: stage 1 backpropagates each layer's loss "
            "in its forward, so one layer's activations exist at a time; remove it (it applies to 'finetune')"
        )
    if recipe.finetune.lora_layers not in ("linear", "all"):
        raise ValueError(f"recipe key 'finetune.lora_layers' must be 'linear' or 'all', got {recipe.finetune.lora_layers!r}")
    if recipe.layers.sliding not in ("keep", "convert"):
        raise ValueError(f"recipe key 'layers.sliding' must be 'keep' or 'convert', got {recipe.layers.sliding!r}")
    if recipe.layers.placement not in PLACEMENTS:
        raise ValueError(f"recipe key 'layers.placement' must be one of {', '.join(PLACEMENTS)}, got {recipe.layers.placement!r}")
    if recipe.layers.scores is not None and recipe.layers.placement not in SCORED:
        raise ValueError(
            f"recipe key 'layers.scores' ranks the layers of a scored placement ({', '.join(SCORED)}), "
            f"not {recipe.layers.placement!r}: set layers.placement (--placement), or remove the scores"
        )
    if recipe.layers.scores is not None and not all(math.isfinite(s) for s in recipe.layers.scores):
        raise ValueError(f"recipe key 'layers.scores' must hold finite numbers, got {recipe.layers.scores!r}")
    for name in ("transfer", "finetune"):
        lengths = getattr(recipe, name).seq_lens
        if not lengths or any(n < 2 for n in lengths):
            raise ValueError(f"recipe key '{name}.seq_len' must be a length >= 2 or a list of them, got {lengths!r}")
    if any(n < 2 for n in recipe.eval.contexts):
        raise ValueError(f"recipe key 'eval.contexts' must hold lengths >= 2 (e.g. [512, 2048, 4096]), got {recipe.eval.contexts!r}")
    _check_numbers(recipe)
    recipe.dtype = dtype_name(recipe.dtype, "recipe key 'dtype'")  # the words --dtype takes: bf16 is bfloat16
    validate_linear_attention(recipe.linear_attention())
    return recipe


# Numeric recipe keys, their smallest valid value, and the flag that sets them (named in the error).
LIMITS = {
    "transfer.tokens": (0, "--transfer-tokens"),
    "finetune.tokens": (0, "--finetune-tokens"),
    "transfer.batch_size": (1, "--batch-size"),
    "finetune.batch_size": (1, "--batch-size"),
    "transfer.checkpoint_every": (1, "--checkpoint-every"),
    "finetune.checkpoint_every": (1, "--checkpoint-every"),
    "transfer.warmup_steps": (0, None),
    "transfer.late_weight": (0, None),
    "finetune.warmup_steps": (0, None),
    "transfer.weight_decay": (0, None),
    "finetune.weight_decay": (0, None),
    "finetune.lora_rank": (1, "--lora-rank"),
    "finetune.lora_alpha": (1, None),
    "eval.heldout_tokens": (1, "--heldout-tokens"),
    "eval.heldout_seq_len": (2, None),
    "eval.limit": (1, None),
}


def _check_numbers(recipe: Recipe) -> None:
    """Refuse out-of-range budgets, sizes and plans before any model loads, naming the key and its flag."""
    for key, (low, flag) in LIMITS.items():
        section, leaf = key.split(".")
        value = getattr(getattr(recipe, section), leaf)
        finite = not isinstance(value, float) or math.isfinite(value)
        if value is not None and not (finite and value >= low):
            where = f"{flag} (recipe key {key!r})" if flag else f"recipe key {key!r}"
            must = f"at least {low}" if finite else f"a finite number >= {low}"
            raise ValueError(f"{where} must be {must}, got {value!r}")
    for name, flag in (("transfer", "--transfer-lr"), ("finetune", "--finetune-lr")):
        lr = getattr(recipe, name).lr
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"{flag} (recipe key '{name}.lr') must be a positive finite number, got {lr!r}")
    if recipe.layers.ratio is not None:
        parse_ratio(recipe.layers.ratio)
    for key, flag in (("linear_layers", "--linear-layers"), ("keep_softmax", "--keep-softmax"), ("measured", None)):
        negative = [i for i in getattr(recipe.layers, key) or [] if i < 0]
        if negative:
            where = f"{flag} (recipe key 'layers.{key}')" if flag else f"recipe key 'layers.{key}'"
            raise ValueError(f"{where} has negative index {negative[0]}: layers count from 0")
    for name in ("transfer", "finetune"):
        stage = getattr(recipe, name)
        if stage.tokens and stage.split != "train" and is_offline(stage.dataset):
            raise ValueError(
                f"--split {stage.split!r} (recipe key '{name}.split') applies to hub datasets only: {stage.dataset!r} "
                "is read whole as training text (the embedded corpus keeps its held-out slice for perplexity); drop --split"
            )


def shipped_recipes() -> dict[str, Recipe]:
    """The recipes that ship with the package, by name."""
    found = {}
    for entry in resources.files("linearize.recipes").iterdir():
        if entry.name.endswith(".yaml"):
            recipe = parse_recipe(yaml.safe_load(entry.read_text()))
            found[recipe.name] = recipe
    return found


def load_recipe(name_or_path: str) -> Recipe:
    """A shipped recipe by name, or a YAML file by path."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {name_or_path!r} not found: check the path")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"recipe {name_or_path!r} is not valid YAML: {str(err).splitlines()[0]}") from None
        return parse_recipe(data or {})
    shipped = shipped_recipes()
    if name_or_path not in shipped:
        raise ValueError(f"unknown recipe {name_or_path!r}: use a YAML file or one of {', '.join(sorted(shipped))}")
    return shipped[name_or_path]


# Every model without a shipped recipe gets the method the embedded default proved (window + sinks,
# retrieval placement, attention transfer then LoRA-KL), with token budgets scaled to its size.
GENERIC_BASE = "smollm2-gla"
BASE_PARAMS = 106e6  # the body (no embedding, no head) the base recipe's CPU budgets were measured on
GPU_TOKENS = 20_000_000  # LoLCATs' per-stage budget for an 8B model on a GPU
GPU_PARAMS = 8e9


def generic_budget(n_params: int, accelerated: bool) -> int:
    """Stage-1 tokens for a model whose body (embedding and head left out) has `n_params`: on a GPU LoLCATs'
    20M at 8B, scaled by sqrt(size) (at least 2M); on a CPU the base recipe's budget up to its size and the
    same body compute for larger models (at least 8K). The vocabulary does not count: it is not trained,
    and a large one (Gemma's 262K tokens) would halve the budget of layers no bigger than the base's."""
    base = shipped_recipes()[GENERIC_BASE].transfer.tokens
    if accelerated:
        tokens = min(GPU_TOKENS, max(2_000_000, GPU_TOKENS * math.sqrt(n_params / GPU_PARAMS)))
    else:
        tokens = min(base, max(8192, base * BASE_PARAMS / n_params))
    return int(tokens) // 1024 * 1024


def generic_recipe(model: str, n_params: int, accelerated: bool) -> Recipe:
    """The proven method for any model: the base recipe's plan rule, attention and stages, budgets scaled."""
    base = shipped_recipes()[GENERIC_BASE]
    transfer = generic_budget(n_params, accelerated)
    finetune = transfer * base.finetune.tokens // base.transfer.tokens // 1024 * 1024
    where = "GPU" if accelerated else "CPU"
    return dataclasses.replace(
        base,
        name="generic",
        description=f"{base.name}'s method (window, sinks, retrieval placement, transfer then LoRA-KL), "
        f"budgets for {n_params / 1e6:,.0f}M body parameters on a {where}",
        model=model,
        aliases=[],
        layers=dataclasses.replace(base.layers, measured=None),
        transfer=dataclasses.replace(base.transfer, tokens=transfer),
        finetune=dataclasses.replace(base.finetune, tokens=finetune, lora_targets=[]),  # the family's own projections
    )


def shipped_recipe_for(model: str) -> Recipe | None:
    """The shipped recipe whose name or alias is `model`; for a model spec, that model's default recipe (the
    one with short names; several recipes, e.g. one per ratio, can share a model)."""
    recipes = shipped_recipes().values()
    for recipe in recipes:
        if model == recipe.name or model in recipe.aliases:
            return recipe
    matching = sorted((r for r in recipes if r.model == model), key=lambda r: (not r.aliases, r.name))
    return matching[0] if matching else None


def recipe_to_yaml(recipe: Recipe) -> str:
    """The recipe as YAML that `--recipe FILE` reads back to the same run."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False, default_flow_style=None, width=100)
