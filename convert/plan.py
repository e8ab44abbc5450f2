"""Select: which layers become linear.

A plan is a list of layer types. It comes from an explicit list of indices, or from a ratio
(linear:softmax) and a placement: `spread` puts the softmax layers evenly through the depth, `top`
keeps softmax in the top layers, `measured` keeps softmax where a short attention transfer matched
the teacher worst, `kl` where restoring a briefly transferred all-linear student's layer to softmax
lowers its KL to the teacher most, `retrieval` where the teacher's heads fetch a fact from beyond the
window (`retrieval.py`).

Sliding-window layers (Gemma 3's five local layers per global one, Mistral-style configs that mark
them in `layer_types`) already keep a constant-size cache, so converting them buys no memory and
only costs quality. A ratio therefore counts the global layers only: sliding layers stay as they
are (`W` in a plan string) unless the recipe says `layers.sliding: convert` (`--convert-sliding`),
or `--linear-layers` names them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI's --help reads PLACEMENTS here: no torch or transformers at import
    from transformers import PretrainedConfig

FULL, LINEAR, SLIDING = "full_attention", "linear_attention", "sliding_attention"
RATIO = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
PLACEMENTS = ("spread", "top", "measured", "kl", "retrieval")
SCORED = ("measured", "kl", "retrieval")  # placements that rank layers by a per-layer score the run measures
MEASURE_TOKENS = 8192  # the short all-linear attention transfer that `measured` and `kl` rank layers after
MEASURE_ROWS_TOKENS = 2048  # the tokens their per-layer scores are taken on


@dataclass
class LayerPlan:
    ratio: str | None = "3:1"  # linear:softmax
    placement: str = "spread"  # spread | top | measured | kl | retrieval
    linear_layers: list[int] | None = None  # explicit indices override ratio/placement
    keep_softmax: list[int] = field(default_factory=list)  # layers that never become linear
    # keep: a ratio counts the global layers and leaves sliding-window layers softmax (their cache is
    # bounded already); convert: a ratio counts every layer
    sliding: str = "keep"
    # The linear layers a scored placement (measured, kl, retrieval) chose for the recipe's own model,
    # reused for it instead of measuring again (the transfer ranking is short and noisy); ignored for
    # any other model.
    measured: list[int] | None = None
    # A scored placement's ranking, one score per layer in layer order, used instead of measuring it.
    # The ranking depends on the teacher and the attention settings, not on the ratio, so one
    # measurement serves every ratio (`--scores-from` copies an earlier export's).
    scores: list[float] | None = None

    @property
    def placement_before_scoring(self) -> str:
        """The placement a plan can be drawn with before the run scores the layers: a scored placement
        without given scores is drawn spread (the real plan comes when the run has scored them)."""
        return "spread" if self.placement in SCORED and self.scores is None else self.placement


def parse_ratio(text: str) -> tuple[int, int]:
    """'3:1' -> (3, 1); anything else is a one-line error with examples."""
    match = RATIO.match(str(text))
    if not match:
        raise ValueError(f"malformed ratio {text!r}: use LINEAR:SOFTMAX, e.g. 3:1, 1:1 or 1:0 (all linear)")
    linear, softmax = int(match.group(1)), int(match.group(2))
    if linear == 0:
        raise ValueError(f"ratio {text!r} leaves no layer linear: use LINEAR:SOFTMAX with LINEAR >= 1, e.g. 3:1")
    return linear, softmax


def parse_layers(text: str | list[int], num_layers: int) -> list[int]:
    """'0,1,2' or [0, 1, 2] -> sorted unique indices, each checked against the model's depth."""
    if isinstance(text, str):
        try:
            indices = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise ValueError(f"malformed layer list {text!r}: use comma-separated indices, e.g. 0,1,2,4") from None
    else:
        indices = list(text)
    for i in indices:
        if not 0 <= i < num_layers:
            raise ValueError(f"layer index {i} out of range: the model has {num_layers} layers (0-{num_layers - 1})")
    if not indices:
        raise ValueError("the layer list is empty: name at least one layer to make linear")
    return sorted(set(indices))


def softmax_count(num_layers: int, ratio: tuple[int, int]) -> int:
    """How many layers keep softmax: the ratio's share, rounded half up."""
    linear, softmax = ratio
    return int(num_layers * softmax / (linear + softmax) + 0.5)


def choose_softmax(
    num_layers: int,
    ratio: tuple[int, int],
    placement: str,
    keep_softmax: list[int] | None = None,
    layer_scores: list[float] | None = None,
    candidates: list[int] | None = None,
) -> list[int]:
    """Indices that keep softmax attention under a ratio and placement, among `candidates` (default: every
    layer); a scored placement keeps the highest."""
    candidates = list(range(num_layers)) if candidates is None else candidates
    keep = [i for i in (parse_layers(keep_softmax, num_layers) if keep_softmax else []) if i in candidates]
    wanted = max(softmax_count(len(candidates), ratio), len(keep))
    free = [i for i in candidates if i not in keep]
    extra = wanted - len(keep)
    if extra <= 0:
        return keep
    if placement == "spread":
        # The last layer of each of `extra` equal groups: L L L S L L L S ... over the free layers.
        picked = [free[int((j + 1) * len(free) / extra) - 1] for j in range(extra)]
    elif placement == "top":
        picked = free[-extra:]
    elif placement in SCORED:
        if layer_scores is None or len(layer_scores) != num_layers:
            raise ValueError(f"{placement} placement needs one score per layer")
        picked = sorted(free, key=lambda i: layer_scores[i], reverse=True)[:extra]
    else:
        raise ValueError(f"unknown placement {placement!r}: use {', '.join(PLACEMENTS[:-1])} or {PLACEMENTS[-1]}")
    return sorted(set(keep) | set(picked))


def layer_types(num_layers: int, linear: list[int], sliding: list[int] | None = None) -> list[str]:
    """The plan as layer types: linear_attention, or the base's softmax (sliding_attention where it slides)."""
    linear, sliding = set(linear), set(sliding or [])
    return [LINEAR if i in linear else SLIDING if i in sliding else FULL for i in range(num_layers)]


def plan_layers(
    num_layers: int,
    ratio: str | None = "3:1",
    placement: str = "spread",
    linear_layers: str | list[int] | None = None,
    keep_softmax: list[int] | None = None,
    layer_scores: list[float] | None = None,
    sliding: list[int] | None = None,
    convert_sliding: bool = False,
) -> list[str]:
    """The full plan: explicit indices win over ratio and placement (an explicit empty list is an error).

    `sliding` lists the teacher's sliding-window layers: a ratio leaves them softmax and counts the
    others, unless `convert_sliding`.
    """
    sliding = sorted(set(sliding or []))
    if linear_layers is not None:
        linear = parse_layers(linear_layers, num_layers)
    else:
        if ratio is None:
            raise ValueError("no layer plan: pass --ratio (e.g. 3:1) or --linear-layers (e.g. 0,1,2)")
        candidates = list(range(num_layers)) if convert_sliding else [i for i in range(num_layers) if i not in sliding]
        if not candidates:
            raise ValueError(
                "every layer of this model attends within a sliding window, so its cache is bounded already: "
                "pass --convert-sliding to convert them anyway, or --linear-layers"
            )
        softmax = choose_softmax(num_layers, parse_ratio(ratio), placement, keep_softmax, layer_scores, candidates)
        linear = [i for i in candidates if i not in softmax]
    if not linear:
        raise ValueError("the plan makes no layer linear: lower the softmax share or shrink keep_softmax")
    return layer_types(num_layers, linear, sliding)


def sliding_plan(config: PretrainedConfig, layers: LayerPlan) -> tuple[list[int], bool]:
    """plan_layers' `sliding` and `convert_sliding` for a teacher's config and a recipe's `layers` section."""
    from ..modeling.families import sliding_layers

    return sliding_layers(config), layers.sliding == "convert"


def describe(types: list[str]) -> str:
    """Compact plan string, e.g. 'SSLLLSLLL...' (L linear, S softmax, W sliding-window softmax)."""
    return "".join({LINEAR: "L", SLIDING: "W"}.get(t, "S") for t in types)
