"""The cache (cache_linearize.py): a linear layer's cache does not grow, a step keeps its buffers, a reset
cache starts over, and the softmax layers' reserved KV cache appends in place."""

from __future__ import annotations

import pytest
import torch
from hybrid import DELTA, FULL, LIN, make_model, random_ids
from transformers.cache_utils import DynamicCache, DynamicLayer

from linearize.modeling.cache_linearize import LinearizeCacheLayer, ReservedDynamicLayer
from linearize.modeling.configuration_linearize import STATES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def recurrent_bytes(layer) -> int:
    states = getattr(layer, "recurrent_states", {}) or {}
    return sum(t.numel() * t.element_size() for t in states.values() if isinstance(t, torch.Tensor))


def kv_bytes(layer) -> int:
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or keys.numel() == 0:
        return 0
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()


@pytest.mark.parametrize("kind", ["gla", "performer", "gla-sinks", "deltanet"])
@torch.no_grad()
def test_cache_does_not_grow(kind):
    window = 4
    settings = {"window": window, "chunk_size": 16}
    if kind == "performer":
        settings.update(kind="performer", feature_map="performer")
    if kind == "gla-sinks":
        settings.update(sink=2)
    if kind == "deltanet":
        settings.update(DELTA, sink=2, conv_size=4)
    model = make_model([LIN, LIN, FULL], settings, seed=5)
    prompt = random_ids(1, 9, seed=41)
    caches = {}
    for n in (10, 1000):
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True)
        assert out.sequences.shape[1] == 9 + n
        caches[n] = out.cache
    short, long = caches[10].layers, caches[1000].layers
    # layer 0: linear -> a fixed-size state, no KV at all
    assert type(long[0]) is LinearizeCacheLayer
    assert recurrent_bytes(short[0]) == recurrent_bytes(long[0]) > 0
    assert kv_bytes(short[0]) == kv_bytes(long[0]) == 0
    if kind == "performer":  # the key stabilizer is the second state
        assert all(isinstance(long[0].recurrent_states[i], torch.Tensor) for i in (0, 1))
    # layer 1: the same fixed state, the window's last `window` keys/values among its states
    assert type(long[1]) is LinearizeCacheLayer
    assert recurrent_bytes(short[1]) == recurrent_bytes(long[1])
    window_kv = long[1].recurrent_states[STATES["window_kv"]]
    assert window_kv.shape[2:4] == (2, window)
    if kind in ("gla-sinks", "deltanet"):  # the two sink tokens' keys/values and positions, a fixed size too
        assert long[1].recurrent_states[STATES["sink_kv"]].shape[2:4] == (2, 2)
        assert long[1].recurrent_states[STATES["sink_positions"]].shape[1] == 2
    # layer 2: softmax -> an ordinary KV cache that grows with every token (appended in place)
    assert type(long[2]) is ReservedDynamicLayer and isinstance(long[2], DynamicLayer)
    assert long[2].keys.shape[2] == 9 + 1000 - 1
    assert kv_bytes(long[2]) > 50 * kv_bytes(short[2]) > 0


@pytest.mark.parametrize("kind", ["gla-sinks", "deltanet", "performer"])
@torch.no_grad()
def test_a_decoding_step_never_waits_on_the_device_and_keeps_its_state_buffer(kind):
    """Once the prompt is in (sinks full), a decoding step of the linear layers reads no tensor value on the
    host (no .item(), bool() or int() of a tensor: each is a device sync on CUDA) and updates the recurrent
    state and the window's ring where the cache holds them (static addresses, as CUDA graphs need). The
    one read allowed is the model's look at a CPU mask (`_note_padding`), which a CUDA mask never gets."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    settings = {"window": 4, "sink": 2, "chunk_size": 16}
    if kind == "deltanet":
        settings.update(DELTA, conv_size=4)
    if kind == "performer":
        settings.update(kind="performer", feature_map="performer", sink=0)
    model = make_model([LIN, LIN], settings, seed=5)  # all linear: positions come from the cache too
    prompt = random_ids(2, 12, seed=3)
    cache = DynamicCache(config=model.config)
    model(prompt, attention_mask=torch.ones_like(prompt), cache=cache)
    states = cache.layers[0].recurrent_states
    addresses = [states[STATES[name]].data_ptr() for name in ("memory", "window_kv")]

    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                callers = [frame.name for frame in traceback.extract_stack()]
                self.reads.append("_note_padding" if "_note_padding" in callers else callers[-2])
            return func(*args, **(kwargs or {}))

    mask = torch.ones(2, 13, dtype=torch.long)
    with HostReads() as mode:
        model(random_ids(2, 1, seed=4), attention_mask=mask, cache=cache)
    assert mode.reads == ["_note_padding"]
    assert [states[STATES[name]].data_ptr() for name in ("memory", "window_kv")] == addresses


@pytest.mark.parametrize("kind", ["gla-sinks", "deltanet", "performer"])
@torch.no_grad()
def test_a_reset_cache_starts_over(kind):
    """cache.reset() (how generate reuses a cache) zeros the buffers in place; the linear layers then start a new
    sequence at position 0, with empty sinks, window and state, as with a fresh cache."""
    settings = {"window": 4, "sink": 2, "chunk_size": 16}
    if kind == "deltanet":
        settings.update(DELTA, conv_size=4)
    if kind == "performer":
        settings.update(kind="performer", feature_map="performer", sink=0)
    model = make_model([LIN, LIN], settings, seed=5)

    def run(cache) -> torch.Tensor:
        logits = [model(random_ids(2, 9, seed=1), cache=cache).logits]
        logits += [model(random_ids(2, 1, seed=2 + t), cache=cache).logits for t in range(3)]
        return torch.cat(logits, dim=1)

    cache = DynamicCache(config=model.config)
    first = run(cache)
    model(random_ids(2, 7, seed=9), cache=cache)  # more tokens, then start over
    cache.reset()
    torch.testing.assert_close(run(cache), first)


@torch.no_grad()
def test_a_reserved_softmax_cache_appends_in_place_and_honours_outside_changes():
    """`ReservedDynamicLayer` returns what transformers' `DynamicLayer` returns for the same updates, writes
    decoding tokens into its reserved room without copying, and takes crop / beam reorder / reset as the truth."""
    gen = torch.Generator().manual_seed(0)

    def kv(batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 2, tokens, 8, generator=gen), torch.randn(batch, 2, tokens, 8, generator=gen)

    reserved, plain = ReservedDynamicLayer(), DynamicLayer()

    def update(batch: int, tokens: int) -> torch.Tensor:
        k, v = kv(batch, tokens)
        got, want = reserved.update(k, v), plain.update(k, v)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        assert reserved.get_seq_length() == plain.get_seq_length()
        return got[0]

    first = update(3, 300)
    room = first.data_ptr()
    for _ in range(20):
        assert update(3, 1).data_ptr() == room, "a decoding token is written in place"
    update(3, 200)  # past the room: reserved again, still equal
    reserved.crop(-5), plain.crop(-5)
    update(3, 1)
    beams = torch.tensor([2, 0, 0])
    reserved.reorder_cache(beams), plain.reorder_cache(beams)
    update(3, 2)
    reserved.reset(), plain.reset()
    assert reserved.get_seq_length() == 0
    update(1, 4)


@torch.no_grad()
def test_softmax_layers_of_a_fresh_cache_get_the_reserved_layer():
    model = make_model([LIN, FULL], {"chunk_size": 16})
    cache = DynamicCache(config=model.config)
    assert type(cache.layers[1]) is DynamicLayer
    model(random_ids(1, 5), cache=cache)
    assert type(cache.layers[1]) is ReservedDynamicLayer and cache.layers[1].get_seq_length() == 5
