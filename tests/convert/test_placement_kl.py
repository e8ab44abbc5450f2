"""KL placement: each layer's KL drop against a hand-computed KL, the ranking on a model where one layer
matters, and the plan a conversion keeps."""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from linearize.convert.pipeline import convert
from linearize.convert.recipes import load_recipe
from linearize.convert.train import measure_kl_gains
from linearize.modeling.configuration_linearize import LINEAR

SETTINGS = {"kind": "gla", "feature_map": "hedgehog", "window": 8, "sink": 2}


def _kl_by_hand(model, ids: torch.Tensor, restored: list) -> float:
    """Mean over rows and positions of sum_v p(v) (log p(v) - log q(v)): p with every layer softmax, q with `restored`."""
    layers = [m for m in model.modules() if hasattr(m, "teacher_attention")]
    with torch.no_grad():
        for layer in layers:
            layer.teacher_attention = True
        p = model(ids, use_cache=False).logits[:, :-1].double().softmax(-1)
        for layer in layers:
            layer.teacher_attention = layer in restored
        q = model(ids, use_cache=False).logits[:, :-1].double().softmax(-1)
        for layer in layers:
            layer.teacher_attention = False
    return float((p * (p.log() - q.log())).sum(-1).mean())


def test_kl_gain_is_the_drop_in_kl_when_one_layer_is_restored(tiny_linearize):
    model = tiny_linearize([LINEAR] * 3, SETTINGS)
    ids = torch.randint(2, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    gains = measure_kl_gains(model, ids, batch_size=2)
    layers = [m for m in model.modules() if hasattr(m, "teacher_attention")]
    every_linear = _kl_by_hand(model, ids, [])
    assert every_linear > 0
    assert sorted(gains) == [0, 1, 2]
    for layer in layers:
        expected = every_linear - _kl_by_hand(model, ids, [layer])
        assert abs(gains[layer.layer_idx] - expected) < 1e-5 * max(1.0, abs(expected))


def test_kl_ranking_restores_the_layer_that_matters(tiny_linearize):
    model = tiny_linearize([LINEAR] * 4, SETTINGS)
    with torch.no_grad():  # layer 2 writes 400x more into the residual stream than the others
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(40.0 if layer.self_attn.layer_idx == 2 else 0.1)
    ids = torch.randint(2, 128, (2, 64), generator=torch.Generator().manual_seed(2))
    gains = measure_kl_gains(model, ids)
    assert max(gains, key=gains.get) == 2
    assert gains[2] > 5 * max(g for i, g in gains.items() if i != 2)


def test_kl_placement_keeps_the_highest_gain_layer_softmax(tmp_path, tiny_llama_dir, tiny_tokenizer):
    recipe = load_recipe("smollm2-gla")
    recipe.layers.placement, recipe.layers.ratio, recipe.layers.measured = "kl", "3:1", None
    recipe.attention.window, recipe.attention.sink = 16, 2
    recipe.transfer.tokens, recipe.transfer.seq_len, recipe.finetune.tokens = 256, 64, 0
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    _, report = convert(teacher, tiny_tokenizer, recipe=recipe, output=tmp_path / "out", measure=False)
    gains = {int(k): v for k, v in report.kl_gains.items()}
    assert sorted(gains) == [0, 1, 2, 3] and not report.retrieval_scores and not report.layer_errors
    best = max(gains, key=gains.get)
    assert report.layer_types[best] == "full_attention" and report.layer_types.count("full_attention") == 1
    assert dict(report.rows())["softmax layers by KL drop when restored"] == f"{best} ({gains[best]:.3g})"
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["kl_gains"] == report.kl_gains
    assert f"measured: [{', '.join(str(i) for i in range(4) if i != best)}]" in saved["recipe_yaml"]


def test_scores_from_an_earlier_export_plan_another_ratio_without_measuring(tmp_path, tiny_llama_dir, linearize_main, monkeypatch):
    """One kl pass serves every ratio: --scores-from takes an export's gains, and only matching runs may."""
    import yaml

    from linearize.convert import pipeline

    monkeypatch.chdir(tmp_path)
    common = [
        "--model", tiny_llama_dir, "--placement", "kl", "--window", "16", "--sink", "2", "--transfer-tokens", "256",
        "--finetune-tokens", "0", "--seq-len", "64", "--heldout-tokens", "256", "--no-measure", "--max-new-tokens", "0", "--quiet",
    ]  # fmt: skip
    code, _, err = linearize_main(*common, "--ratio", "3:1", "--output", "kl3")
    assert code == 0, err
    first = json.loads((tmp_path / "kl3" / "report.json").read_text())
    gains = [first["kl_gains"][str(i)] for i in range(4)]

    def measuring(*args, **kwargs):
        raise AssertionError("the ranking was measured again")

    monkeypatch.setattr(pipeline, "measure_kl_gains", measuring)
    del first["attention"]["window_logit"]  # an export from before a setting existed ran its default
    (tmp_path / "kl3" / "report.json").write_text(json.dumps(first))
    code, _, err = linearize_main(*common, "--ratio", "1:1", "--scores-from", "kl3", "--output", "kl1")
    assert code == 0, err
    second = json.loads((tmp_path / "kl1" / "report.json").read_text())
    top_two = sorted(sorted(range(4), key=lambda i: gains[i], reverse=True)[:2])
    assert [i for i, t in enumerate(second["layer_types"]) if t != LINEAR] == top_two
    assert second["kl_gains"] == first["kl_gains"]
    assert yaml.safe_load(second["recipe_yaml"])["layers"]["scores"] == gains

    refusals = {
        "another placement": (["--placement", "spread"], "this run's placement is 'spread': add --placement measured or kl or retrieval"),
        "other settings": (["--window", "32"], "it ranked its layers with other attention settings (window): convert with its settings"),
        "no report": (["--scores-from", "nowhere"], "--scores-from nowhere: no report.json there: pass a folder that `linearize` converted"),
    }
    for name, (extra, message) in refusals.items():
        args = [*common, "--ratio", "1:1", "--scores-from", "kl3", "--output", f"bad-{name}", *extra]
        code, _, err = linearize_main(*args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (name, err)
        assert not (tmp_path / f"bad-{name}").exists()


def test_scores_for_another_depth_are_refused_before_the_teacher_loads(tiny_llama_dir):
    from linearize.convert.pipeline import apply_overrides, check_inputs

    recipe = apply_overrides(load_recipe("smollm2-gla"), {"layers.placement": "kl", "layers.measured": [], "layers.scores": [0.3, 0.1, 0.2]})
    message = "recipe key 'layers.scores' holds 3 scores but the model has 4 layers: take them from an export of this model (--scores-from DIR)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_inputs(str(tiny_llama_dir), recipe, None, False, torch.device("cpu"))
