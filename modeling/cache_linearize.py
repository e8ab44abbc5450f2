"""The cache of a converted model: transformers' `DynamicCache`, with this model's own layer classes.

A `DynamicCache` built from the config holds a `LinearAttentionLayer` for each linear layer and a
`DynamicLayer` for each softmax layer. `adopt_layers`, called by the model's forward, swaps each fresh
one for the subclass here, so any cache (the model's own, `generate`'s, or one a user built from the
config) works:
- `LinearizeCacheLayer`: a linear layer's recurrent states (in the slots `STATES` names: the memory,
  its normalizer, sinks, the window's ring) plus the plain Python facts its steps read without a
  host sync, as fields.
- `ReservedDynamicLayer`: a softmax layer's keys and values, appended in place into reserved room.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from .configuration_linearize import STATES

RESERVE_MIN = 256  # positions of room a softmax layer's cache reserves at least (ReservedDynamicLayer)


class LinearizeCacheLayer(LinearAttentionLayer):
    """A linear layer's cache: transformers' recurrent-state slots, and what the layer's steps need besides.

    The fields are Python values, so a decoding step reads them without a host sync, and a compiled
    step sees `seen` as a size (`decoding_linearize.STEP_SIZES`). `reset()` clears them with the states.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._clear()

    def _clear(self) -> None:
        self.seen = 0  # tokens taken in, padding included (the same for every row)
        self.last_sink: int | None = None  # the position of the last sink once every row's sinks are full
        self.valid_since = 0  # real tokens start here: before it, ring slots may hold padding

    def reset(self) -> None:
        super().reset()
        self._clear()


def has_state(layer: LinearizeCacheLayer | None) -> bool:
    """Whether a linear layer's cache holds a step (not fresh, not reset)."""
    return layer is not None and layer.has_previous_state[STATES["memory"]]


def tokens_seen(layer: LinearizeCacheLayer | None) -> int:
    """Tokens (padding included) a linear layer's cache has taken in: the same for every row.

    A Python int on the cache layer (`seen`), so positions never need a host sync. It
    counts only while the layer `has_previous_state` (its memory slot's flag, which the layer sets
    after each step and `cache.reset()` clears): a reset cache starts again at position 0.
    """
    return layer.seen if has_state(layer) else 0


def record_seen(layer: LinearizeCacheLayer, seen: int) -> None:
    """Set a linear layer's token count: `seen`, and the layer's own count where it keeps one.

    From transformers 5.25 a `LinearAttentionLayer` answers `cache.get_seq_length()` from
    `cumulative_length_linear`, which only its convolution-state updates advance (this module keeps
    every state through `update_recurrent_state`), and the families' positions start from that answer.
    """
    layer.seen = seen
    layer.cumulative_length_linear.fill_(seen)


class ReservedDynamicLayer(DynamicLayer):
    """transformers' `DynamicLayer` for a softmax layer, appending into reserved room instead of concatenating.

    `DynamicLayer.update` copies the whole cache into a fresh tensor on every token: at 16K tokens of
    SmolLM2 that is 25 MB written per layer and step, 1.6 ms of a softmax layer's ~7 ms on 2 cores,
    and the fresh pages fault in besides. Here `keys` / `values` are views of the first n positions
    of buffers with a quarter more room; a step writes its token in place, and only a full buffer is
    copied (amortized O(1) per token). Whatever replaces `keys` / `values` from outside (crop, beam
    reorder, batch selection, offloading) stays the truth: the next update reserves again from it.
    A compiled decoding step finds its room already made (`reserve_before_graph`, from
    `LinearizeForCausalLM.forward`) and its length in `filled`, so its graph holds the
    in-place write, no allocation, and no view of the cache as an input: only the whole buffers,
    whose strides follow from their sizes. Their capacity is a symbolic size (STEP_SIZES), so growths
    reuse the graph: 48 ms per step for the 3:1 student at 16K, against 64 ms when the graph
    concatenates.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.room: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffers `keys` / `values` are prefixes of
        self.lent: tuple[torch.Tensor, torch.Tensor] | None = None  # the views last handed out as `keys` / `values`
        self.filled = 0  # positions written into the room
        self.ready = False  # a compiled step's room is made (`reserve_before_graph`)

    def reserve(self, tokens: int, like: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Make room for `tokens` more positions and one spare, shaped and typed as `like` (default: the cache's own).

        The spare keeps the cache a strict prefix of its buffer: a view that filled it would be contiguous,
        and a compiled graph specialized on the other case would compile again.
        """
        room, lent = self.room, self.lent
        filled = super().get_seq_length()
        needed = filled + tokens
        if room is None or lent is None or lent[0] is not self.keys or lent[1] is not self.values or needed >= room[0].shape[-2]:
            capacity = needed + max(RESERVE_MIN, needed // 4)
            room = tuple(x.new_empty(*x.shape[:-2], capacity, x.shape[-1]) for x in like or (self.keys, self.values))
            if filled:
                room[0][..., :filled, :].copy_(self.keys)
                room[1][..., :filled, :].copy_(self.values)
            self.room, self.lent = room, (self.keys, self.values)
        self.filled = filled

    def reserve_before_graph(self) -> None:
        """Before a compiled decoding step: its token's room, made eagerly, so the graph only writes in place."""
        self.reserve(1)
        self.ready = True

    def _ready(self) -> bool:
        return torch.compiler.is_compiling() and self.ready

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self._ready():
            self.reserve(key_states.shape[-2], (key_states, value_states))
        room, filled = self.room, self.filled
        needed = filled + key_states.shape[-2]
        room[0][..., filled:needed, :].copy_(key_states)
        room[1][..., filled:needed, :].copy_(value_states)
        self.keys, self.values = room[0][..., :needed, :], room[1][..., :needed, :]
        self.lent, self.filled, self.ready = (self.keys, self.values), needed, False
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """In a compiled step, the reserved length: reading `keys` would make its view a graph input."""
        return self.filled if self._ready() else super().get_seq_length()

    def reset(self) -> None:
        self.room = self.lent = None
        self.ready = False
        super().reset()


def adopt_layers(cache: Cache) -> None:
    """Give a cache's fresh plain layers this model's classes: `LinearizeCacheLayer` for linear layers,
    `ReservedDynamicLayer` for softmax ones. Layers already holding tokens keep their class."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer and not any(layer.has_previous_state.values()):
            cache.layers[index] = LinearizeCacheLayer(number_of_states=layer.number_of_states)
        elif type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[index] = ReservedDynamicLayer()
