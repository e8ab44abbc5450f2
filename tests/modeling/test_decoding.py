"""The decoding runtime and CPU layouts (decoding_linearize.py, cpu_layout_linearize.py): the in-place steps
equal the general path, weights laid out for CPU decoding equal the linear layers and save back, compiled
decoding generates what eager does, and split decode attention equals SDPA."""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch
from hybrid import DELTA, FULL, LIN, NEW, PROMPT, greedy_by_recomputation, left_padded, make_model, random_ids
from transformers.cache_utils import DynamicCache

import linearize.modeling.cache_linearize as cache_linearize
import linearize.modeling.cpu_layout_linearize as cpu_layout_linearize
import linearize.modeling.decoding_linearize as decoding_linearize
from linearize.modeling.configuration_linearize import STATES
from linearize.modeling.cpu_layout_linearize import GateUpMLP, SplitGemvLinear, still_fused
from linearize.modeling.decoding_linearize import SoftmaxAttentionConfig, split_decode_attention
from linearize.modeling.modeling_linearize import HedgehogFeatureMap, LinearAttention, LinearizeForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


STEP_CASES = {
    "sinks": {"window": 4, "sink": 2},
    "sinks-unrotated": {"window": 4, "sink": 2, "rope_features": False},
    "no-sinks": {"window": 4},
    "elu-key-gate": {"window": 4, "sink": 1, "feature_map": "elu", "gate": "key"},
    "identity-no-gate": {"window": 4, "feature_map": "identity", "gate": "none"},
    "taylor-retnet": {"window": 4, "sink": 2, "feature_map": "taylor", "feature_dim": 4, "gate": "retnet"},
}


@pytest.mark.parametrize("case", list(STEP_CASES))
@torch.no_grad()
def test_the_in_place_gla_step_equals_the_general_path(case, monkeypatch):
    """Once the window runs, GLA's decoding steps take `_gla_step`; each gives the general path's logits
    and leaves the same cache (state, ring, its unrotated keys), padded rows included."""
    model = make_model([LIN, FULL, LIN], {**STEP_CASES[case], "chunk_size": 16}, seed=9)
    # The short row's last padding leaves the window during decoding (where no sinks hold it back).
    ids, mask = left_padded([random_ids(11, seed=51), random_ids(2, seed=52)])
    cache = DynamicCache(config=model.config)
    model(ids, attention_mask=mask, cache=cache)
    taken = []
    monkeypatch.setattr(LinearAttention, "_gla_step", lambda self, *a, _f=LinearAttention._gla_step: taken.append(1) or _f(self, *a))
    general = copy.deepcopy(cache)
    for t in range(6):  # past a full turn of the ring
        token = random_ids(2, 1, seed=60 + t)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        fast = model(token, attention_mask=mask, cache=cache).logits
        with monkeypatch.context() as m:
            m.setattr(LinearAttention, "_steps_in_place", lambda *a: False)
            slow = model(token, attention_mask=mask, cache=general).logits
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    assert len(taken) >= 2 * 2 if STEP_CASES[case].get("sink") else len(taken) == 6 * 2, "the in-place step was taken"
    # A beam reorder replaces the states; the next step reads the new ones, to the same logits.
    cache.reorder_cache(torch.tensor([1, 0])), general.reorder_cache(torch.tensor([1, 0]))
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    fast = model(random_ids(2, 1, seed=70), attention_mask=mask, cache=cache).logits
    with monkeypatch.context() as m:
        m.setattr(LinearAttention, "_steps_in_place", lambda *a: False)
        slow = model(random_ids(2, 1, seed=70), attention_mask=mask, cache=general).logits
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    for index in (0, 2):
        got, want = cache.layers[index].recurrent_states, general.layers[index].recurrent_states
        for name, slot in STATES.items():
            if isinstance(want.get(slot), torch.Tensor):
                torch.testing.assert_close(got[slot], want[slot], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def cache_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    """Every tensor a hybrid cache holds: the linear layers' states, the softmax layers' views and their rooms."""
    found = []
    for layer in cache.layers:
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            found += [x for x in values if isinstance(x, torch.Tensor)]
    return found


@pytest.mark.parametrize("settings", [{"window": 4, "sink": 2}, {**DELTA, "window": 4, "sink": 2}], ids=["gla", "deltanet"])
@torch.no_grad()
def test_a_step_written_in_place_runs_in_inference_mode_and_leaves_ordinary_tensors(settings, monkeypatch):
    """An eager decoding step whose cache is only written in place (`_gla_step` in every linear layer, the
    softmax rooms made) runs under inference mode; the cache and the outputs stay ordinary tensors, so a
    later prompt outside inference mode continues the same cache. Other steps run as called."""
    monkeypatch.setattr(cache_linearize, "RESERVE_MIN", 1)  # the softmax room grows during the steps
    model = make_model([LIN, FULL, LIN], {**settings, "chunk_size": 16}, seed=3)
    modes = []
    model.linear_attentions[0].register_forward_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    ids = random_ids(1, 9, seed=70)
    cache = DynamicCache(config=model.config)
    model(ids, cache=cache)
    for t in range(5):
        token = random_ids(1, 1, seed=71 + t)
        out = model(token, cache=cache, output_hidden_states=True)
        ids = torch.cat([ids, token], dim=1)
        assert not out.logits.is_inference() and not any(h.is_inference() for h in out.hidden_states)
    out.logits.add_(1.0)  # an ordinary tensor takes in-place changes
    assert modes[0] is False and modes[1:] == [settings.get("kind") != "deltanet"] * 5
    assert not any(x.is_inference() for x in cache_tensors(cache))
    more = random_ids(1, 3, seed=80)
    cached = model(more, cache=cache).logits  # a prompt of several tokens: no inference mode, in-place writes
    full = model(torch.cat([ids, more], dim=1)).logits[:, -3:]
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)


def bmm_calls(monkeypatch) -> list[int]:
    """Count `torch.bmm` calls: the split GEMV's product, which nothing else on these paths uses."""
    calls, bmm = [], torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *args, **kwargs: calls.append(1) or bmm(*args, **kwargs))
    return calls


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_the_split_gemv_equals_the_linear_layer(rows, bias, monkeypatch):
    torch.set_num_threads(2)
    calls = bmm_calls(monkeypatch)
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 20, bias=bias)
    split = copy.deepcopy(plain)
    monkeypatch.setattr(cpu_layout_linearize, "SPLIT_GEMV_MIN", 0)
    subclass = type("QuantizedLinear", (torch.nn.Linear,), {})(48, 20)  # owns its layout: left alone
    cpu_layout_linearize.lay_out_for_cpu_decode(torch.nn.Sequential(split, subclass), column_major=True)
    assert type(split) is SplitGemvLinear and split.weight.t().is_contiguous() and torch.equal(split.weight, plain.weight)
    assert type(subclass).__name__ == "QuantizedLinear" and subclass.weight.is_contiguous()
    x = torch.randn(rows, 1, 48)
    with torch.no_grad():
        torch.testing.assert_close(split(x), plain(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == (rows <= cpu_layout_linearize.SPLIT_GEMV_ROWS), "the split product runs for decoding-sized batches only"
    x.requires_grad_(True)
    y = split(x)
    assert len(calls) == (rows <= cpu_layout_linearize.SPLIT_GEMV_ROWS), "autograd takes nn.Linear's path"
    grads = torch.autograd.grad(y.square().sum(), [x, split.weight])
    want = torch.autograd.grad(plain(x).square().sum(), [x, plain.weight])
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_cpu_decoding_lays_weights_out_column_major_and_saving_puts_them_back(tmp_path, monkeypatch):
    """The first decoding step stores the large weights column-major (values, parameters and the tied
    head unchanged) and decodes through the split GEMV; saving and training see row-major weights."""
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_layout_linearize, "SPLIT_GEMV_MIN", 1024)
    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16}, tie_word_embeddings=True)
    before = {name: p for name, p in model.named_parameters()}
    ids = random_ids(1, PROMPT, seed=11)
    expected, expected_logits = greedy_by_recomputation(model, ids, NEW)
    assert not model.cpu_decode_layout, "prefill alone leaves the layout alone"
    calls = bmm_calls(monkeypatch)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, PROMPT:].tolist() == expected[0].tolist()
    for got, want in zip(out.logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    linear = model.model.layers[0].self_attn
    projections = [linear.q_proj, linear.k_proj, linear.v_proj]
    large = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() >= 1024]
    assert model.cpu_decode_layout and large and calls
    mlps = [layer.mlp for layer in model.model.layers]
    fused = [*linear.fused_parts, *(proj for mlp in mlps for proj in (mlp.gate_proj, mlp.up_proj))]
    assert all(type(m) is SplitGemvLinear and m.weight.t().is_contiguous() for m in large if m not in fused)
    # The linear layer's q/k/v weights and its gate's first projection are column slices of one column-major
    # tensor: one product a step.
    columns = linear.qkv_columns
    assert columns is not None and columns.is_contiguous()
    assert linear.fused_parts == (*projections, linear.gate.down)
    names = ("q_proj", "k_proj", "v_proj", "gate.down")
    assert torch.equal(columns.t(), torch.cat([before[f"model.layers.0.self_attn.{n}.weight"] for n in names]))
    offsets = [proj.weight.data_ptr() - columns.data_ptr() for proj in linear.fused_parts]
    widths = [proj.out_features for proj in linear.fused_parts]
    assert offsets == [4 * sum(widths[:i]) for i in range(len(widths))]
    # So are every MLP's gate and up weights (the family's MLP computes down(act(gate(x)) * up(x))).
    assert all(isinstance(mlp, GateUpMLP) and mlp.gate_up_columns is not None for mlp in mlps)
    assert all(still_fused(mlp.gate_up_columns, (mlp.gate_proj, mlp.up_proj)) for mlp in mlps)
    assert {name: p for name, p in model.named_parameters()} == before, "the same parameter objects"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert all(m.weight.is_contiguous() for m in large) and not model.cpu_decode_layout and linear.qkv_columns is None
    assert all(mlp.gate_up_columns is None for mlp in mlps)
    reloaded = LinearizeForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    model.generate(ids, max_new_tokens=2, do_sample=False)
    assert model.cpu_decode_layout and linear.qkv_columns is not None
    model.train()
    assert all(m.weight.is_contiguous() for m in large) and not model.cpu_decode_layout and linear.qkv_columns is None
    model.eval()


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 3])
def test_hedgehog_step_follows_its_parameters(batch):
    """A step's Hedgehog map (one token per row, no autograd) uses [W, -W] and [b, -b] made once: it must
    equal `hedgehog`, and be made again when a parameter changes in place or is replaced."""
    from linearize.kernels.feature_maps import hedgehog

    torch.manual_seed(0)
    fmap = HedgehogFeatureMap(3, 8, 8)
    with torch.no_grad():
        fmap.weight.normal_()
        fmap.bias.normal_()
    x = torch.randn(batch, 3, 1, 8)

    def check() -> None:
        with torch.no_grad():
            torch.testing.assert_close(fmap(x), hedgehog(x, fmap.weight, fmap.bias), rtol=1e-6, atol=1e-7)

    check()
    made = fmap._signed_cache[2]
    check()
    assert fmap._signed_cache[2] is made  # kept while nothing changed
    with torch.no_grad():
        fmap.weight.mul_(2.0)
    check()
    fmap.bias.data = torch.randn(3, 8)
    check()
    with torch.inference_mode():  # as an in-place decoding step runs it
        torch.testing.assert_close(fmap(x), hedgehog(x, fmap.weight, fmap.bias), rtol=1e-6, atol=1e-7)
    with torch.inference_mode():  # parameters made as accelerate's offload hooks load them: no version to key on
        fmap.weight.data, fmap.bias.data = fmap.weight * 0.5, fmap.bias + 1.0
        torch.testing.assert_close(fmap(x), hedgehog(x, fmap.weight, fmap.bias), rtol=1e-6, atol=1e-7)
        fmap.weight.mul_(3.0)
        torch.testing.assert_close(fmap(x), hedgehog(x, fmap.weight, fmap.bias), rtol=1e-6, atol=1e-7)


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 3])
def test_a_steps_paired_hedgehog_maps_equal_the_two_maps(batch):
    """A decoding step runs phi(q) and phi(k) as one product over both maps' signed weights, joined once:
    it must equal the two maps apart, and follow a change to either."""
    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16})
    linear = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, linear.n_heads, 1, linear.head_dim, generator=gen)
    k = torch.randn(batch, linear.n_kv_heads, 1, linear.head_dim, generator=gen)

    def check() -> None:
        fq, fk = linear._step_features(q, k)
        torch.testing.assert_close(fq, linear.feature_map_q(q), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fk, linear.feature_map_k(k), rtol=1e-6, atol=1e-7)

    check()
    made = linear._paired_maps_cache[2]
    check()
    assert linear._paired_maps_cache[2] is made
    linear.feature_map_k.weight.mul_(2.0)
    check()
    linear.feature_map_q.bias.data = torch.randn_like(linear.feature_map_q.bias)
    check()
    linear.feature_map_k.to(torch.float64)  # maps of another dtype (or on another device, offloaded) run apart
    made = linear._paired_maps_cache[2]
    check()
    assert linear._paired_maps_cache[2] is made


@torch.no_grad()
def test_only_an_mlp_computing_the_gated_formula_takes_the_fused_product():
    """`gate_up_mlp_class` checks each MLP class once against down(act(gate(x)) * up(x)); a class that computes
    anything else keeps its own forward, and a fused MLP whose weights were replaced falls back to it."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16})
    mlp = model.model.layers[0].mlp
    assert type(mlp) is LlamaMLP

    class ScaledMLP(LlamaMLP):
        def forward(self, x):
            return 0.5 * super().forward(x)

    other = copy.deepcopy(mlp)
    other.__class__ = ScaledMLP
    assert cpu_layout_linearize.gate_up_mlp_class(other) is None
    gated = cpu_layout_linearize.gate_up_mlp_class(mlp)
    assert gated is not None and issubclass(gated, GateUpMLP) and issubclass(gated, LlamaMLP)
    x = torch.randn(1, 1, mlp.gate_proj.in_features)
    want = mlp(x)
    mlp.__class__ = gated
    mlp.gate_up_columns = cpu_layout_linearize.fuse_columns((mlp.gate_proj, mlp.up_proj))
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.contiguous() * 2  # replaced: the columns are stale
    torch.testing.assert_close(mlp(x), LlamaMLP.forward(mlp, x))
    assert mlp.gate_up_columns is None


def test_a_fused_projection_left_stale_by_a_conversion_is_dropped():
    """A round trip through float64 gives the q/k/v parameters new fp32 tensors: the old fused columns,
    of the same dtype again, must not serve the next step (a changed weight shows it), and are dropped."""
    torch.set_num_threads(2)
    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16})
    ids = random_ids(1, PROMPT, seed=13)
    model.generate(ids, max_new_tokens=2, do_sample=False)
    linear = model.model.layers[0].self_attn
    assert linear.qkv_columns is not None
    model.double().float()
    with torch.no_grad():
        linear.q_proj.weight.mul_(1.5)
    expected, expected_logits = greedy_by_recomputation(model, ids, NEW)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, PROMPT:].tolist() == expected[0].tolist()
    for got, want in zip(out.logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert linear.qkv_columns is None


@pytest.mark.parametrize(
    "layer_types, kind",
    [([LIN, FULL], {}), ([LIN, LIN], {}), ([LIN, FULL], DELTA)],
    ids=["hybrid", "all-linear", "deltanet-hybrid"],
)
@torch.no_grad()
def test_compiled_decoding_generates_what_the_eager_model_does(layer_types, kind, monkeypatch):
    """After `compile_decoding`, generate's steps past the filling sinks run one torch.compile graph
    without graph breaks (the position symbolic from the first) and give the eager model's tokens
    and logits; the weights stay row-major, and the softmax layers keep their reserved, in-place caches.
    The delta rule's steps (the general path, not `_gla_step`) keep one graph too."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(2)
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(cpu_layout_linearize, "SPLIT_GEMV_MIN", 1024)
    model = make_model(layer_types, {**kind, "window": 4, "sink": 4, "chunk_size": 16}, tie_word_embeddings=True)
    ids = random_ids(1, 3, seed=12)  # the first step fills the last sink: it stays eager (a host sync)
    expected, expected_logits = greedy_by_recomputation(model, ids, NEW)
    assert model.compile_decoding() is model
    steps = []
    compiled = model.compiled_step
    model.compiled_step = lambda *args, **kwargs: steps.append(1) or compiled(*args, **kwargs)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, 3:].tolist() == expected[0].tolist()
    for got, want in zip(out.logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(steps) == NEW - 2, "every step once the sinks are full runs the compiled graph"
    assert not counters["graph_break"], dict(counters["graph_break"])
    # The position is symbolic from the first compiled step (STEP_SIZES), and the same step serves while the
    # sinks are inside the window and after (it masks them itself): one graph for 22 positions, none made
    # when the ring wraps to its first slot (5 times here).
    assert counters["stats"]["unique_graphs"] == 1, "one graph, not one per position or regime"
    large = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() >= 1024]
    assert large and all(type(m) is SplitGemvLinear and m.weight.is_contiguous() for m in large)
    assert not model.cpu_decode_layout
    assert any(type(layer) is cache_linearize.ReservedDynamicLayer for layer in out.cache.layers) == (FULL in layer_types)
    assert not any(x.is_inference() for x in cache_tensors(out.cache)), "the graph ran in inference mode, writing in place"


def test_symbolic_step_sizes_keeps_the_users_dynamic_sources_and_needs_none_from_an_older_torch(monkeypatch):
    """The compiled step runs with STEP_SIZES added to whatever dynamic sources the user set, restored after;
    a torch without `dynamic_sources` gets the step itself (it then compiles as Dynamo decides)."""
    seen = []
    step = decoding_linearize.symbolic_step_sizes(lambda x: seen.append(torch.compiler.config.dynamic_sources) or x)
    with torch.compiler.config.patch(dynamic_sources="L['mine']"):
        assert step(3) == 3
        assert torch.compiler.config.dynamic_sources == "L['mine']"
    assert seen == ["L['mine']," + decoding_linearize.STEP_SIZES]
    monkeypatch.setattr(torch.compiler, "config", types.SimpleNamespace())
    assert decoding_linearize.symbolic_step_sizes(abs) is abs


@torch.no_grad()
def test_compiled_decoding_of_a_padded_batch_through_growing_rooms(monkeypatch):
    """Two rows, one left-padded (the softmax layer's step takes SDPA's masked path inside the graph),
    past two growths of the reserved room: the eager model's tokens and logits."""
    torch.set_num_threads(2)
    torch._dynamo.reset()
    monkeypatch.setattr(cache_linearize, "RESERVE_MIN", 4)
    model = make_model([LIN, FULL, LIN], {"window": 4, "sink": 2, "chunk_size": 16})
    ids = random_ids(2, 9, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = model.generate(ids, **kwargs)
    got = model.compile_decoding().generate(ids, **kwargs)
    assert got.sequences.tolist() == want.sequences.tolist()
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    softmax = got.cache.layers[1]
    assert type(softmax) is cache_linearize.ReservedDynamicLayer and softmax.room[0].shape[-2] > 9 + 4 + 1
    assert not any(x.is_inference() for x in cache_tensors(got.cache)), "the rooms grew outside inference mode"


def calls_an_extern_kernel(codes: list[str]) -> bool:
    """Whether inductor's generated code leaves any product to an extern (library) kernel."""
    return any(re.search(r"extern_kernels\.\w+\(", code) for code in codes)


@pytest.mark.parametrize("prompt", [12, 3], ids=["sinks-behind", "sinks-in-window"])
@pytest.mark.parametrize("layer_types", [[LIN, LIN], [LIN, FULL]], ids=["all-linear", "hybrid"])
@torch.no_grad()
def test_the_compiled_step_fuses_its_products_and_writes_the_rings_in_place(layer_types, prompt, monkeypatch):
    """On CPU, compiled: after inductor's reinplacing no functional scatter is left, so each ring's
    new slot, and a softmax layer's new token in its reserved room, is written in place where a
    scatter would rewrite the whole buffer every token (COMPILED_STEP_OPTIONS), from a prompt past sinks
    + window and from one that starts with the sinks inside it; a full room grows outside the graph. All-linear, no extern BLAS call is left either (the small products are `step_bmm`'s fused
    multiply-and-sum, the small linears the split GEMV's)."""
    import torch._inductor.fx_passes.post_grad as post_grad
    from torch._inductor.utils import run_and_get_code

    from torch._dynamo.utils import counters

    torch.set_num_threads(2)
    torch._dynamo.reset()
    counters.clear()
    left, reinplace = [], post_grad.reinplace_inplaceable_ops

    def reinplace_and_record(*args) -> None:
        reinplace(*args)
        functional = (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default)
        left.extend(
            n.target
            for n in args[-1].nodes
            if n.op == "call_function" and ("scatter" in str(n.target) or n.target in functional)
        )

    monkeypatch.setattr(post_grad, "reinplace_inplaceable_ops", reinplace_and_record)
    # rope_features off: keys wait in the window unrotated, so a second ring (the payload) is written too.
    monkeypatch.setattr(cache_linearize, "RESERVE_MIN", 4)
    model = make_model(layer_types, {"window": 4, "sink": 2, "chunk_size": 16, "rope_features": False})
    cache = DynamicCache(config=model.config)
    ids = random_ids(1, prompt, seed=13)
    token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
    model.compile_decoding()
    steps = 16  # the softmax room grows at least twice

    def decode() -> None:
        nonlocal token, ids
        for _ in range(steps):
            ids = torch.cat([ids, token], 1)
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)

    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would skip the passes
        _, codes = run_and_get_code(decode)
    assert codes and cache.layers[0].recurrent_states[STATES["window_payload"]] is not None
    assert not left, f"slot writes left as whole-buffer scatters: {left}"
    # One graph: the position and the room's capacity are symbolic from the first step (STEP_SIZES), and
    # the step masks sinks still inside the window itself, so neither the next positions, nor the sinks
    # leaving the window, nor its wraps (4 here), nor the room's growths compile again.
    assert counters["stats"]["unique_graphs"] == 1
    if FULL in layer_types:
        softmax = cache.layers[1]
        assert type(softmax) is cache_linearize.ReservedDynamicLayer and softmax.keys.shape[-2] == ids.shape[1]
        assert softmax.room[0].shape[-2] > 16, "the room grew"
        assert softmax.keys.untyped_storage().data_ptr() == softmax.room[0].untyped_storage().data_ptr()
        want = model(ids).logits[:, -1:].argmax(-1)
        assert torch.equal(token, want)
    else:
        assert not calls_an_extern_kernel(codes), "a product left to an extern kernel"


@torch.no_grad()
def test_compiled_split_gemv_fuses_every_one_row_product():
    """Compiled, a one-row product over a row-major weight fuses into inductor's own reduction at any size
    (no library GEMV: its speed over row-major weights varies 3x between CPUs); several rows keep nn.Linear's
    path. Both give nn.Linear's answer."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    for rows, out_features, extern in [(1, 48, False), (1, 1 << 17, False), (3, 48, True)]:  # 4M elements: a head
        x = torch.randn(rows, 1, 32)
        layer = torch.nn.Linear(32, out_features)
        want = layer(x)
        layer.__class__ = SplitGemvLinear
        with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would return no code
            got, codes = run_and_get_code(torch.compile(layer, dynamic=False), x)
        torch.testing.assert_close(got, want)
        assert codes
        assert calls_an_extern_kernel(codes) == extern, (rows, out_features)


def sdpa_calls(monkeypatch) -> list[int]:
    calls, sdpa = [], decoding_linearize.sdpa_attention_forward
    monkeypatch.setattr(decoding_linearize, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    return calls


@pytest.mark.parametrize("keys", [40, 43])
@pytest.mark.parametrize("scaling", [None, 0.3])
@torch.no_grad()
def test_split_decode_attention_equals_sdpa(keys, scaling, monkeypatch):
    """One query over a long GQA cache (keys past the blocks' multiple, a reserved cache's strided view): SDPA's answer."""
    monkeypatch.setattr(decoding_linearize, "SPLIT_DECODE_MIN_KEYS", 32)
    torch.manual_seed(0)
    room = torch.randn(2, 2, 2, 64, 8)  # [B, Hkv, k | v, room, D]
    key, value = room[:, :, 0, :keys], room[:, :, 1, :keys]
    query = torch.randn(2, 6, 1, 8)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 3
    want, _ = decoding_linearize.sdpa_attention_forward(module, query, key, value, None, scaling=scaling)
    calls = sdpa_calls(monkeypatch)
    got, weights = split_decode_attention(module, query, key, value, None, scaling=scaling)
    assert not calls and weights is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mask = torch.ones(2, 1, 1, keys, dtype=torch.bool)
    split_decode_attention(module, query, key, value, mask, scaling=scaling)
    split_decode_attention(module, torch.cat([query, query], 2), key, value, None, scaling=scaling)
    assert len(calls) == 2, "a mask or another query count is SDPA's"


@torch.no_grad()
def test_split_decode_attention_compiled_is_one_grouped_product(monkeypatch):
    """Inside a compiled graph, one query over a short strided GQA cache: SDPA's answer, from two
    products for all heads (not SDPA, nor the eager path's per-head blocks unrolled)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    room = torch.randn(2, 2, 2, 64, 8)
    key, value = room[:, :, 0, :40], room[:, :, 1, :40]
    query = torch.randn(2, 6, 1, 8)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 3
    want, _ = decoding_linearize.sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    calls = sdpa_calls(monkeypatch)
    graphs = []

    def record(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(split_decode_attention, backend=record, fullgraph=True)
    got, weights = compiled(module, query, key, value, None, scaling=0.3)
    assert not calls and weights is None
    products = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in (torch.matmul, torch.bmm)]
    assert len(products) == 2, [n.target for n in graphs[0].graph.nodes]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_softmax_layers_see_split_decode_for_sdpa_and_follow_the_model(monkeypatch):
    monkeypatch.setattr(decoding_linearize, "SPLIT_DECODE_MIN_KEYS", 4)
    model = make_model([LIN, FULL], {"window": 4, "chunk_size": 16}, attn_implementation="sdpa")
    softmax = model.model.layers[1].self_attn
    assert isinstance(softmax.config, SoftmaxAttentionConfig) and softmax.config.base is model.model.config
    assert model.config._attn_implementation == "sdpa"
    assert softmax.config._attn_implementation == decoding_linearize.SPLIT_DECODE
    assert softmax.config.hidden_size == model.config.hidden_size
    ids = random_ids(1, PROMPT, seed=11)
    expected, expected_logits = greedy_by_recomputation(model, ids, NEW)
    calls = []
    split = decoding_linearize.split_decode_attention
    interface = decoding_linearize.AttentionInterface
    interface.register(decoding_linearize.SPLIT_DECODE, lambda *a, **k: calls.append(a[1].shape[2]) or split(*a, **k))
    try:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    finally:
        interface.register(decoding_linearize.SPLIT_DECODE, split)
    assert out.sequences[0, PROMPT:].tolist() == expected[0].tolist() and calls.count(1) == NEW - 1
    for got, want in zip(out.logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    model.set_attn_implementation("eager")
    assert softmax.config._attn_implementation == "eager"
