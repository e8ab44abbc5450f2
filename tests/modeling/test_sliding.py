"""Sliding-window teachers (Gemma 3): a ratio counts the global layers and keeps the sliding ones, and a
converted sliding layer is its teacher exactly while the context fits the teacher's window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig
from conftest import tiny_fields

from linearize.convert.plan import LINEAR, SLIDING, describe, plan_layers
from linearize.convert.recipes import parse_recipe
from linearize.convert.swap import linearize_model
from linearize.modeling.families import sliding_layers
from linearize.modeling.modeling_linearize import LinearAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8
# Gemma 3's pattern in small: five sliding layers, then a global one, twice.
GEMMA_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 2


def gemma_like() -> torch.nn.Module:
    config = Gemma3TextConfig(
        **tiny_fields(
            num_hidden_layers=len(GEMMA_TYPES),
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=GEMMA_TYPES,
            max_position_embeddings=256,
            initializer_range=0.2,
            pad_token_id=0,
        )
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_sliding_layers_are_read_from_layer_types():
    assert sliding_layers(gemma_like().config) == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]


def test_a_ratio_counts_the_global_layers_and_keeps_sliding_ones():
    sliding = [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert describe(plan_layers(12, "1:1", sliding=sliding)) == "WWWWWLWWWWWS"
    assert describe(plan_layers(12, "1:0", sliding=sliding)) == "WWWWWLWWWWWL"
    assert describe(plan_layers(12, "1:1", placement="top", sliding=sliding)) == "WWWWWLWWWWWS"
    scores = [0.0] * 12
    scores[5] = 1.0  # the retrieval score keeps the first global layer instead
    assert describe(plan_layers(12, "1:1", "retrieval", layer_scores=scores, sliding=sliding)) == "WWWWWSWWWWWL"
    # --convert-sliding: the ratio counts every layer, as for a model without sliding layers
    assert describe(plan_layers(12, "3:1", sliding=sliding, convert_sliding=True)) == "LLLWLLLWLLLS"
    # explicit indices are taken as given, sliding or not
    assert plan_layers(12, None, linear_layers=[0, 5], sliding=sliding)[:2] == [LINEAR, SLIDING]
    assert describe(plan_layers(12, None, linear_layers=[0, 5], sliding=sliding)) == "LWWWWLWWWWWS"


def test_a_model_of_sliding_layers_only_needs_convert_sliding():
    with pytest.raises(ValueError, match="^every layer of this model attends within a sliding window.*--convert-sliding"):
        plan_layers(4, "3:1", sliding=[0, 1, 2, 3])
    assert describe(plan_layers(4, "3:1", sliding=[0, 1, 2, 3], convert_sliding=True)) == "LLLW"


def test_recipe_key_layers_sliding():
    assert parse_recipe({}).layers.sliding == "keep"
    assert parse_recipe({"layers": {"sliding": "convert"}}).layers.sliding == "convert"
    with pytest.raises(ValueError, match="^recipe key 'layers.sliding' must be 'keep' or 'convert', got 'all'$"):
        parse_recipe({"layers": {"sliding": "all"}})


def test_converted_sliding_layer_is_the_teacher_while_the_context_fits_its_window():
    teacher = gemma_like()
    types = plan_layers(12, None, linear_layers=[0, 1, 5], sliding=sliding_layers(teacher.config))
    student = linearize_model(teacher, types, {"window": 64, "sink": 4, "chunk_size": 4}).eval()
    layers = {i: layer.self_attn for i, layer in enumerate(student.model.layers) if isinstance(layer.self_attn, LinearAttention)}
    assert sorted(layers) == [0, 1, 5]
    for i in (0, 1):  # sliding teachers: the softmax part is the teacher's window, without sinks
        assert (layers[i].window, layers[i].sink) == (WINDOW, 0)
    assert (layers[5].window, layers[5].sink) == (64, 4)  # the global layer keeps the recipe's

    ids = torch.randint(2, 128, (2, WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=1e-5, atol=1e-5)
        # past the window the state adds tokens the teacher no longer saw: the outputs part
        longer = torch.randint(2, 128, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(2))
        assert not torch.allclose(student(longer).logits[:, -1], teacher(longer).logits[:, -1], atol=1e-3)


def test_a_converted_sliding_layer_never_looks_past_the_teachers_window():
    """With the state's share at zero, a converted sliding layer is its teacher at any length: its softmax part
    covers the teacher's window and nothing more (no sinks, no wider recipe window)."""
    teacher = gemma_like()
    student = linearize_model(teacher, plan_layers(12, None, linear_layers=[0, 2, 7]), {"window": 64, "sink": 4}).eval()
    with torch.no_grad():
        for layer in student.model.layers:
            if isinstance(layer.self_attn, LinearAttention):
                layer.self_attn.window_factor.fill_(40.0)  # sigmoid(40) = 1: the window's terms only
        ids = torch.randint(2, 128, (2, 5 * WINDOW), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=1e-4, atol=1e-4)



def test_the_card_tells_sliding_layers_apart():
    from types import SimpleNamespace

    from linearize.convert.card import conversion_markdown, model_card

    kinds = [SLIDING] * 5 + [LINEAR] + [SLIDING] * 5 + ["full_attention"]
    config = SimpleNamespace(
        linear_attention={"kind": "gla", "feature_map": "hedgehog", "gate": "lowrank", "window": 512, "sink": 64},
        layer_types=kinds, linearize_teacher="gemma", base_model_type="gemma3_text",
    )  # fmt: skip
    card = model_card(config, {"name": "gemma-3-270m", "hub_id": "google/gemma-3-270m"}, "out/g")
    assert "the other 11 keep softmax attention. 10 of those are the teacher's sliding-window layers" in card
    assert "`W W W W W L W W W W W S`" in card
    scores = {str(i): 0.01 * i for i in range(12)}
    md = conversion_markdown({"layer_types": kinds, "retrieval_scores": scores})
    assert "Softmax layers kept (the teacher's retrieval score): 11 (0.11)." in md  # the global one only


@pytest.mark.slow
def test_real_gemma_keeps_its_sliding_layers_and_a_converted_one_is_exact_past_the_window():
    """The embedded Gemma-3-270M: the ratio plan converts global layers only, and converted sliding layers with
    the state's share at zero reproduce the teacher's hidden states on 1,024 held-out tokens (twice its window)."""
    from linearize.convert.data import heldout_text
    from linearize.convert.sources import load_model

    teacher, tokenizer, _ = load_model("gemma3")
    teacher.eval()
    sliding = sliding_layers(teacher.config)
    assert [i for i in range(18) if i not in sliding] == [5, 11, 17]
    assert describe(plan_layers(18, "3:1", sliding=sliding)) == "WWWWWLWWWWWLWWWWWS"
    student = linearize_model(teacher, plan_layers(18, None, linear_layers=[0, 1, 12], sliding=sliding), {"window": 512, "sink": 64})
    student.eval()
    ids = torch.tensor([tokenizer(heldout_text())["input_ids"][:1024]])
    with torch.no_grad():
        for layer in student.model.layers:
            if isinstance(layer.self_attn, LinearAttention):
                assert (layer.self_attn.window, layer.self_attn.sink) == (512, 0)
                layer.self_attn.window_factor.fill_(40.0)
        hidden = [m.model(ids, use_cache=False).last_hidden_state for m in (student, teacher)]
        torch.testing.assert_close(*hidden, rtol=1e-3, atol=1e-3)
