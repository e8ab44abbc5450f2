"""Recipes: shipped YAML parses, the schema names bad keys, and CLI flags override recipe fields."""

import re
from importlib import resources

import pytest
import yaml

from linearize.convert.cli import convert_parser, recipe_from_args
from linearize.convert.recipes import Recipe, load_recipe, parse_recipe, shipped_recipe_for, shipped_recipes
from linearize.convert.sources import resolve

EMBEDDED = "embedded:smollm2-135m-instruct"


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- shipped recipes -----------------------------------------------------------------------------


def test_every_shipped_recipe_parses():
    files = sorted(e.name for e in resources.files("linearize.recipes").iterdir() if e.name.endswith(".yaml"))
    assert len(files) >= 6
    recipes = shipped_recipes()
    assert sorted(f"{name}.yaml" for name in recipes) == files  # one recipe per file, named like the file
    for name, recipe in recipes.items():
        assert isinstance(recipe, Recipe)
        assert load_recipe(name) == recipe
        assert recipe.description, name
        assert recipe.layers.ratio or recipe.layers.linear_layers, name
        assert recipe.transfer.tokens > 0 or recipe.finetune.tokens > 0, name
        assert recipe.attention.kind in ("gla", "performer")


def test_shipped_smollm2_recipe_fields():
    recipe = load_recipe("smollm2-gla")
    assert recipe.model == EMBEDDED
    assert recipe.layers.ratio == "3:1" and recipe.layers.placement == "retrieval" and recipe.layers.keep_softmax == []
    assert recipe.attention.kind == "gla" and recipe.attention.window == 512 and recipe.attention.sink == 64
    assert recipe.transfer.lr == pytest.approx(0.01) and isinstance(recipe.transfer.lr, float)
    assert recipe.finetune.loss == "kl" and recipe.finetune.lora_targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    perf = load_recipe("smollm2-performer")
    assert perf.attention.kind == "performer" and perf.attention.feature_map == "performer"
    assert perf.transfer.tokens == 0


@pytest.mark.parametrize("short", ["llama", "smollm2"])
def test_short_names_resolve_to_the_embedded_model(short, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder of that name can shadow it
    source = resolve(short)
    assert source.spec == EMBEDDED
    assert source.kind == "embedded"
    assert shipped_recipe_for(short).name == "smollm2-gla"
    # the model itself, shared by the performer and the ratio recipes, maps to its default too
    assert shipped_recipe_for(EMBEDDED).name == "smollm2-gla"


def test_unknown_short_name_lists_the_accepted_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"unknown model 'lama'.*hub id.*\.gguf.*short name \(gemma3, llama, smollm2\)"):
        resolve("lama")


def test_a_recipe_file_round_trips(tmp_path):
    recipe = load_recipe("smollm2-gla")
    path = write(tmp_path, yaml.safe_dump(recipe.to_dict()))
    assert load_recipe(str(path)) == recipe


def test_defaults_fill_what_a_recipe_leaves_out():
    recipe = parse_recipe({"transfer": {"tokens": 100}})
    assert recipe.transfer.tokens == 100
    assert recipe.transfer.lr == pytest.approx(1e-2)  # the stage's own default, not the generic Stage's
    assert recipe.layers.ratio == "3:1"


# ---- schema errors -------------------------------------------------------------------------------


def test_unknown_top_level_key_is_named():
    with pytest.raises(ValueError, match=r"unknown recipe key 'modle': allowed keys here are name, .*model"):
        parse_recipe({"modle": "x"})


def test_unknown_nested_key_is_named(tmp_path):
    path = write(tmp_path, "transfer:\n  tokns: 1000\n")
    with pytest.raises(ValueError, match=r"unknown recipe key 'transfer\.tokns': allowed keys here are tokens"):
        load_recipe(str(path))
    with pytest.raises(ValueError, match=r"unknown recipe key 'attention\.kernel'"):
        parse_recipe({"attention": {"kernel": "gla"}})


@pytest.mark.parametrize(
    "text, key",
    [
        ('transfer:\n  tokens: "many"\n', "transfer.tokens"),
        ("transfer:\n  tokens: 1.5\n", "transfer.tokens"),
        ("transfer:\n  lr: fast\n", "transfer.lr"),
        ("layers:\n  keep_softmax: 0\n", "layers.keep_softmax"),
        ("layers:\n  keep_softmax: [0, x]\n", "layers.keep_softmax[1]"),
        ("attention:\n  normalize: maybe\n", "attention.normalize"),
        ("seed: true\n", "seed"),
    ],
)
def test_wrong_type_is_named(tmp_path, text, key):
    with pytest.raises(ValueError, match=f"recipe key '{re.escape(key)}' must be"):
        load_recipe(str(write(tmp_path, text)))


@pytest.mark.parametrize("ratio", ["3:1", "1"])  # YAML reads an unquoted 3:1 as the number 181
def test_unquoted_ratio_asks_for_quotes(tmp_path, ratio):
    path = write(tmp_path, f"layers:\n  ratio: {ratio}\n")
    with pytest.raises(ValueError, match=r"recipe key 'layers\.ratio' must be a quoted string like \"3:1\""):
        load_recipe(str(path))


def test_section_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ValueError, match=r"recipe section 'transfer' must be a mapping"):
        load_recipe(str(write(tmp_path, "transfer: 5\n")))
    with pytest.raises(ValueError, match=r"recipe section 'top level' must be a mapping"):
        load_recipe(str(write(tmp_path, "- a\n- b\n")))


@pytest.mark.parametrize(
    "data, key",
    [
        ({"finetune": {"loss": "mse"}}, "finetune.loss"),
        ({"transfer": {"loss": "kl"}}, "transfer.loss"),
        ({"layers": {"placement": "middle"}}, "layers.placement"),
        ({"dtype": "fp8"}, "dtype"),
    ],
)
def test_bad_choice_is_named(data, key):
    with pytest.raises(ValueError, match=f"recipe key '{re.escape(key)}' must be"):
        parse_recipe(data)


def test_malformed_yaml_is_a_clear_error(tmp_path):
    path = write(tmp_path, "layers:\n  ratio: \"3:1\"\n   placement: [spread\n", name="broken.yaml")
    with pytest.raises(ValueError, match=r"recipe '.*broken\.yaml' is not valid YAML: "):
        load_recipe(str(path))


def test_missing_recipe_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"recipe file '.*nope\.yaml' not found"):
        load_recipe(str(tmp_path / "nope.yaml"))


def test_unknown_recipe_name_lists_the_shipped_ones():
    with pytest.raises(ValueError, match=r"unknown recipe 'smollm3-gla': use a YAML file or one of .*smollm2-gla"):
        load_recipe("smollm3-gla")


# ---- CLI flags override recipe fields ------------------------------------------------------------


def args(*argv):
    return recipe_from_args(convert_parser().parse_args(list(argv)))


def test_flags_override_the_default_recipe_of_a_short_name():
    base = load_recipe("smollm2-gla")
    recipe = args(
        "--model", "llama", "--ratio", "1:1", "--placement", "top", "--keep-softmax", "",
        "--transfer-tokens", "1000", "--finetune-tokens", "0", "--seq-len", "64", "--batch-size", "2",
        "--transfer-lr", "0.002", "--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--window", "0", "--sink", "0",
        "--checkpoint-every", "3", "--heldout-tokens", "256", "--seed", "7", "--dtype", "float32",
    )  # fmt: skip
    assert recipe.name == "smollm2-gla"
    assert (recipe.layers.ratio, recipe.layers.placement, recipe.layers.keep_softmax) == ("1:1", "top", [])
    assert recipe.transfer.tokens == 1000 and recipe.finetune.tokens == 0
    assert recipe.transfer.seq_len == recipe.finetune.seq_len == 64
    assert recipe.transfer.batch_size == recipe.finetune.batch_size == 2
    assert recipe.transfer.checkpoint_every == recipe.finetune.checkpoint_every == 3
    assert recipe.transfer.lr == pytest.approx(0.002)
    assert recipe.finetune.lora_rank == 4 and recipe.finetune.lora_targets == ["q_proj", "v_proj"]
    assert recipe.attention.window == 0 and recipe.eval.heldout_tokens == 256
    assert (recipe.seed, recipe.dtype) == (7, "float32")
    # what no flag touched stays as the recipe says
    assert recipe.finetune.lr == base.finetune.lr and recipe.attention.feature_map == base.attention.feature_map
    assert recipe.eval.tasks == base.eval.tasks


def test_no_flags_keep_the_recipe():
    assert args("--recipe", "smollm2-gla") == load_recipe("smollm2-gla")


def test_explicit_linear_layers_flag():
    recipe = args("--model", "llama", "--linear-layers", "0, 2,3")
    assert recipe.layers.linear_layers == [0, 2, 3]


def test_switching_attention_kind_switches_its_defaults():
    perf = args("--model", "llama", "--attention", "performer")
    assert (perf.attention.kind, perf.attention.feature_map, perf.attention.gate) == ("performer", "performer", "none")
    gla = args("--recipe", "smollm2-performer", "--attention", "gla")
    assert (gla.attention.kind, gla.attention.feature_map, gla.attention.gate) == ("gla", "hedgehog", "lowrank")
    explicit = args("--recipe", "smollm2-performer", "--attention", "gla", "--feature-map", "elu", "--gate", "key")
    assert (explicit.attention.feature_map, explicit.attention.gate) == ("elu", "key")
    # The delta rule keeps GLA's normalized state with positive features, and adds its output otherwise.
    delta = args("--model", "llama", "--attention", "deltanet")
    assert (delta.attention.kind, delta.attention.feature_map, delta.attention.normalize) == ("deltanet", "hedgehog", True)
    delta = args("--model", "llama", "--attention", "deltanet", "--feature-map", "identity")
    assert (delta.attention.feature_map, delta.attention.normalize) == ("identity", False)


def test_flags_override_a_recipe_file(tmp_path):
    path = write(tmp_path, 'model: ./m\nlayers:\n  ratio: "1:1"\ntransfer:\n  tokens: 64\n  seq_len: 16\n')
    recipe = args("--recipe", str(path), "--transfer-tokens", "128")
    assert recipe.model == "./m" and recipe.layers.ratio == "1:1"
    assert recipe.transfer.tokens == 128 and recipe.transfer.seq_len == 16


def test_bad_flag_values_are_named():
    with pytest.raises(ValueError, match=r"malformed list '0,x'"):
        args("--model", "llama", "--linear-layers", "0,x")
    with pytest.raises(ValueError, match="nothing to convert: pass --model"):
        args()
    with pytest.raises(SystemExit):  # argparse: an int flag given a word
        args("--model", "llama", "--transfer-tokens", "many")


def test_measured_plan_follows_its_ratio_and_placement(tmp_path):
    from linearize.convert.cli import convert_parser, recipe_from_args

    def plan(*argv):
        layers = recipe_from_args(convert_parser().parse_args(["--model", "llama", *argv])).layers
        return layers.ratio, layers.placement, layers.measured, layers.linear_layers

    kept = [0, 1, 2, 3, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19, 21, 22, 24, 25, 26, 27, 28, 29]
    recipe = load_recipe("smollm2-gla").to_dict()
    recipe["layers"].update(placement="measured", measured=kept)
    kept_plan = ["--placement", "measured", "--recipe", str(write(tmp_path, yaml.safe_dump(recipe)))]
    assert plan(*kept_plan) == ("3:1", "measured", kept, None)
    assert plan(*kept_plan, "--ratio", "1:1")[:3] == ("1:1", "measured", [])  # measured anew, not the 3:1 layers
    assert plan(*kept_plan, "--placement", "retrieval")[2] == []
    assert plan(*kept_plan, "--linear-layers", "0,1")[3] == [0, 1]
    assert plan(*kept_plan, "--model", "./another-model")[2] == []  # the plan was measured on SmolLM2, not on this model
    assert plan() == ("3:1", "retrieval", None, None)  # the default probes its plan: deterministic and cheap


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention.conv_size": 4}, "conv_size is a deltanet setting"),
        (
            {"attention.kind": "deltanet", "attention.feature_map": "identity"},
            "deltanet with normalize=true keeps GLA's normalizer, which needs positive features",
        ),
        ({"attention.gate": "sigmoid"}, "lowrank, key, retnet or none"),
    ],
)
def test_bad_attention_settings_are_refused_with_the_recipe(overrides, message):
    """Before any model loads: the recipe itself carries the linear layers' settings check."""
    from linearize.convert.pipeline import apply_overrides

    with pytest.raises(ValueError, match=message):
        apply_overrides(load_recipe("smollm2-gla"), overrides)


# ---- any model gets a sound recipe; a dry run plans the big ones without loading them ---------------


def test_a_model_without_a_recipe_gets_the_proven_method(tiny_llama_dir):
    from linearize.convert.pipeline import default_recipe

    recipe = default_recipe(str(tiny_llama_dir))
    proven = shipped_recipes()["smollm2-gla"]
    assert recipe.name == "generic" and recipe.model == str(tiny_llama_dir)
    assert (recipe.attention.window, recipe.attention.sink) == (proven.attention.window, proven.attention.sink) == (512, 64)
    assert recipe.layers.placement == "retrieval" and recipe.layers.measured is None
    assert recipe.transfer.tokens == proven.transfer.tokens and recipe.finetune.tokens > 0
    assert recipe.finetune.lora_targets == []  # the family's own projections, whatever their names


def test_generic_budgets_scale_with_size_and_device():
    from linearize.convert.recipes import generic_budget

    assert generic_budget(106_000_000, accelerated=False) == 40960  # the proven budget at its own size
    assert generic_budget(100_000_000, accelerated=False) == 40960  # never above it
    assert generic_budget(212_000_000, accelerated=False) == 20480  # the same compute: half the tokens
    assert generic_budget(135_000_000_000, accelerated=False) == 8192  # never below the floor
    assert generic_budget(8_000_000_000, accelerated=True) == 20_000_000 // 1024 * 1024  # LoLCATs at 8B
    assert 2_000_000 <= generic_budget(1_000_000_000, accelerated=True) < generic_budget(8_000_000_000, accelerated=True)


@pytest.mark.parametrize("tied", [True, False])
def test_budgets_are_sized_by_the_body_not_the_vocabulary(tied):
    from transformers import LlamaConfig

    from linearize.convert.budget import parameter_count

    config = LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    # by hand: per layer q 16x16, k and v 16x8, o 16x16, MLP 3 x 16x32, two norms of 16; a final norm of 16
    layer = 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 32 + 2 * 16
    body = 2 * layer + 16
    vocabulary = 1000 * 16 * (1 if tied else 2)
    assert parameter_count(config, body_only=True) == body
    assert parameter_count(config) == body + vocabulary


def test_dry_run_from_the_cli_loads_and_writes_nothing(linearize_main, tmp_path, monkeypatch):
    import huggingface_hub.constants
    import transformers

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def loading(*args, **kwargs):
        raise AssertionError("a dry run loaded weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)
    code, out, err = linearize_main("--recipe", "llama-3.1-8b-gla", "--dry-run", "--ratio", "1:1")
    assert code == 0, err
    assert "linearize --dry-run" in out and "8.030 B" in out and "LSLSLS" in out.replace("\n", "")
    assert "estimated memory, finetune" in out and "estimated peak memory" in out and "estimated time, transfer" in out
    assert "name: llama-3.1-8b-gla" in out  # the effective recipe, printed as YAML
    assert list(tmp_path.iterdir()) == []


def test_teachers_load_with_their_own_layers(tmp_path, monkeypatch):
    """Hub kernels stay off at load: with `kernels` installed transformers would fetch layers at run time."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from linearize.convert import sources

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    seen = {}

    def from_pretrained(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(RuntimeError, match="loaded"):
        sources.load_model(str(tmp_path))
    assert seen["use_kernels"] is False


@pytest.mark.parametrize("name, softmax", [("smollm2-gla-5to1", 5), ("smollm2-gla-7to1", 4), ("smollm2-gla-14to1", 2), ("smollm2-gla-1to0", 0)])
def test_ratio_recipes_are_the_default_method_at_another_ratio(name, softmax):
    from linearize.convert.plan import parse_ratio, softmax_count

    recipe, proven = shipped_recipes()[name], shipped_recipes()["smollm2-gla"]
    assert recipe.model == proven.model and not recipe.aliases
    assert (recipe.attention, recipe.transfer, recipe.finetune, recipe.eval) == (proven.attention, proven.transfer, proven.finetune, proven.eval)
    ratio = recipe.layers.ratio
    assert name.endswith(ratio.replace(":", "to")) and softmax_count(30, parse_ratio(ratio)) == softmax
    if softmax:  # the softmax layers are where the default keeps them: the teacher's retrieval layers
        assert recipe.layers.placement == "retrieval"
