"""Learning rates that cannot train (zero, negative, NaN, infinite) and negative layer indices are
refused when the recipe is read, in one line naming the key, whether they come from a recipe file or
from a flag, and before any weights load."""

from __future__ import annotations

import re

import pytest

from linearize.convert.recipes import load_recipe, parse_recipe

BAD_LRS = ["0", "0.0", "-1.0e-3", ".nan", "nan", ".inf", "-.inf"]  # as YAML spells them


@pytest.mark.parametrize("stage", ["transfer", "finetune"])
@pytest.mark.parametrize("lr", BAD_LRS)
def test_a_recipe_lr_that_cannot_train_is_refused(tmp_path, stage, lr):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"{stage}:\n  lr: {lr}\n")
    with pytest.raises(ValueError, match=rf"recipe key '{stage}\.lr'\) must be a positive finite number, got ") as err:
        load_recipe(str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("stage", ["transfer", "finetune"])
def test_a_small_positive_lr_is_kept(stage):
    assert getattr(parse_recipe({stage: {"lr": 1e-7}}), stage).lr == pytest.approx(1e-7)


@pytest.mark.parametrize("key", ["transfer.weight_decay", "finetune.weight_decay", "transfer.late_weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_other_float_keys_must_be_finite(key, value):
    section, leaf = key.split(".")
    with pytest.raises(ValueError, match=rf"recipe key '{re.escape(key)}' must be a finite number >= 0, got {value!r}"):
        parse_recipe({section: {leaf: value}})


@pytest.mark.parametrize(
    "layers, message",
    [
        ({"linear_layers": [-1]}, "--linear-layers (recipe key 'layers.linear_layers') has negative index -1"),
        ({"linear_layers": [0, 2, -3]}, "--linear-layers (recipe key 'layers.linear_layers') has negative index -3"),
        ({"keep_softmax": [-1]}, "--keep-softmax (recipe key 'layers.keep_softmax') has negative index -1"),
        ({"measured": [0, -1]}, "recipe key 'layers.measured' has negative index -1"),
    ],
)
def test_negative_layer_indices_are_refused(layers, message):
    with pytest.raises(ValueError, match=re.escape(message) + ": layers count from 0$"):
        parse_recipe({"layers": layers})


@pytest.mark.parametrize(
    "contexts, message",
    [
        ([1], "recipe key 'eval.contexts' must hold lengths >= 2 (e.g. [512, 2048, 4096]), got [1]"),
        ([512, 0], "recipe key 'eval.contexts' must hold lengths >= 2 (e.g. [512, 2048, 4096]), got [512, 0]"),
        ("512,2048", "recipe key 'eval.contexts' must be a list, got '512,2048'"),
        (None, "recipe key 'eval.contexts' must be a list, got None"),
        ([512.0], "recipe key 'eval.contexts[0]' must be int, got 512.0"),
    ],
)
def test_bad_perplexity_contexts_are_refused(contexts, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_recipe({"eval": {"contexts": contexts}})


@pytest.mark.parametrize(
    "layers, message",
    [
        ({"placement": "spread", "scores": [1.0, 0.5]}, "recipe key 'layers.scores' ranks the layers of a scored placement (measured, kl, retrieval), not 'spread'"),
        ({"placement": "kl", "scores": [1.0, float("nan")]}, "recipe key 'layers.scores' must hold finite numbers, got [1.0, nan]"),
        ({"placement": "kl", "scores": "1,2"}, "recipe key 'layers.scores' must be a list, got '1,2'"),
    ],
)
def test_bad_layer_scores_are_refused(layers, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        parse_recipe({"layers": layers})


def test_perplexity_contexts_are_kept():
    assert parse_recipe({"eval": {"contexts": [4096, 512]}}).eval.contexts == [4096, 512]


# ---- through the command line ----------------------------------------------------------------------

LR = "must be a positive finite number, got"
CLI_CASES = {
    "zero transfer lr": (["--transfer-lr", "0"], f"--transfer-lr (recipe key 'transfer.lr') {LR} 0.0"),
    "negative finetune lr": (["--finetune-lr", "-0.001"], f"--finetune-lr (recipe key 'finetune.lr') {LR} -0.001"),
    "negative lr, exponent": (["--finetune-lr=-1e-4"], f"--finetune-lr (recipe key 'finetune.lr') {LR} -0.0001"),
    "NaN transfer lr": (["--transfer-lr", "nan"], f"--transfer-lr (recipe key 'transfer.lr') {LR} nan"),
    "NaN finetune lr": (["--finetune-lr", "nan"], f"--finetune-lr (recipe key 'finetune.lr') {LR} nan"),
    "infinite finetune lr": (["--finetune-lr", "inf"], f"--finetune-lr (recipe key 'finetune.lr') {LR} inf"),
    "negative linear layer": (["--linear-layers", "-1"], "--linear-layers (recipe key 'layers.linear_layers') has negative index -1"),
    "negative in a list": (["--linear-layers=-1,2"], "--linear-layers (recipe key 'layers.linear_layers') has negative index -1"),
    "negative kept layer": (["--keep-softmax", "-1"], "--keep-softmax (recipe key 'layers.keep_softmax') has negative index -1"),
    "negative lr, exponent, apart": (["--finetune-lr", "-1e-4"], f"--finetune-lr (recipe key 'finetune.lr') {LR} -0.0001"),
    "negative in a list, apart": (["--linear-layers", "-1,2"], "--linear-layers (recipe key 'layers.linear_layers') has negative index -1"),
    "negative kept list, apart": (["--keep-softmax", "-1,0"], "--keep-softmax (recipe key 'layers.keep_softmax') has negative index -1"),
    "recipe lr 0": ("finetune:\n  lr: 0\n", f"--finetune-lr (recipe key 'finetune.lr') {LR} 0.0"),
    "recipe lr NaN": ("transfer:\n  lr: .nan\n", f"--transfer-lr (recipe key 'transfer.lr') {LR} nan"),
    "recipe negative layer": ("layers:\n  linear_layers: [-1]\n", "--linear-layers (recipe key 'layers.linear_layers') has negative index -1"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_the_cli_refuses_in_one_line_before_loading(case, linearize_main, tiny_llama_dir, tmp_path, monkeypatch):
    import transformers

    from linearize.convert import train

    def loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the input was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)
    monkeypatch.setattr(train, "run_loop", loading)
    monkeypatch.chdir(tmp_path)
    given, message = CLI_CASES[case]
    flags = given
    if isinstance(given, str):  # a recipe file
        (tmp_path / "recipe.yaml").write_text(given)
        flags = ["--recipe", "recipe.yaml"]
    code, out, err = linearize_main("--model", tiny_llama_dir, "--output", "out", "--quiet", "--no-measure", *flags)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"linearize: error: {message}" + (": layers count from 0" if "index" in message else "")], err
    assert not out.strip()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["recipe.yaml"] if isinstance(given, str) else [])
