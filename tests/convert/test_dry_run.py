"""`--dry-run` on every shipped recipe, and the estimate's terms against hand computations."""

import math

import pytest
import torch

from linearize.convert import dry_run
from linearize.convert.recipes import parse_recipe, shipped_recipes

# Each GPU recipe's checkpoint, from its public config.json: (hub id, parameters in billions, layers, family).
GPU_RECIPES = {
    "llama-3.2-1b-gla": ("meta-llama/Llama-3.2-1B", 1.236, 16, "llama"),
    "llama-3.2-3b-gla": ("meta-llama/Llama-3.2-3B", 3.213, 28, "llama"),
    "llama-3.1-8b-gla": ("meta-llama/Llama-3.1-8B", 8.030, 32, "llama"),
    "qwen2.5-1.5b-gla": ("Qwen/Qwen2.5-1.5B", 1.544, 28, "qwen2"),
    "qwen2.5-7b-gla": ("Qwen/Qwen2.5-7B", 7.616, 28, "qwen2"),
    "qwen3-1.7b-gla": ("Qwen/Qwen3-1.7B", 1.721, 28, "qwen3"),
    "qwen3-8b-gla": ("Qwen/Qwen3-8B", 8.191, 36, "qwen3"),
    "mistral-7b-gla": ("mistralai/Mistral-7B-v0.3", 7.248, 32, "mistral"),
    "gemma-3-1b-gla": ("google/gemma-3-1b-pt", 1.000, 26, "gemma3_text"),
    "phi-3-mini-gla": ("microsoft/Phi-3-mini-4k-instruct", 3.821, 32, "phi3"),
    "olmo-2-1b-gla": ("allenai/OLMo-2-0425-1B", 1.485, 16, "olmo2"),
}
FUSED_QKV = {"phi3"}


@pytest.fixture
def offline(monkeypatch):
    """No hub: the config copies under recipes/configs serve the shipped recipes; a fixed matmul throughput."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: patch the constant
    monkeypatch.setattr(dry_run, "matmul_flops", lambda device, dtype, seconds=0.3: 1e11)


def test_every_shipped_recipe_is_listed_here():
    ratios = {f"smollm2-gla-{r}" for r in ("5to1", "7to1", "14to1", "1to0")}
    assert set(shipped_recipes()) == {*GPU_RECIPES, "smollm2-gla", "smollm2-performer", *ratios}


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_each_gpu_recipe_carries_the_proven_method_with_lolcats_budgets(name):
    recipe = shipped_recipes()[name]
    proven = shipped_recipes()["smollm2-gla"]
    hub, billions, _, family = GPU_RECIPES[name]
    assert recipe.model == hub and recipe.dtype == "auto"  # bf16 on a GPU
    assert recipe.layers.ratio == "3:1" and recipe.layers.placement == "retrieval" and recipe.layers.measured is None
    assert recipe.attention == proven.attention  # window 512, 64 sinks, q/k before RoPE, the same gate and map
    assert recipe.transfer.seq_lens == [2048] and recipe.finetune.seq_lens == [2048, 4096]
    assert recipe.finetune.loss == "kl" and recipe.finetune.lora_rank == 8
    targets = ["qkv_proj", "o_proj"] if family in FUSED_QKV else ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert recipe.finetune.lora_targets == targets
    # LoLCATs' 20M tokens per stage at 8B, scaled by sqrt(size), to half a million
    tokens = round(min(20e6, 20e6 * math.sqrt(billions / 8)) / 5e5) * 5e5
    assert recipe.transfer.tokens == recipe.finetune.tokens == tokens
    for stage in (recipe.transfer, recipe.finetune):
        assert "/" in stage.dataset and stage.text_field == "text" and stage.checkpoint_every > 0
        assert stage.batch_size * stage.seq_lens[0] == 8192  # tokens per optimizer step


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_dry_run_of_every_shipped_recipe_is_sane(name, offline):
    recipe = shipped_recipes()[name]
    plan = dry_run.dry_run(recipe, torch.device("cpu"), low_memory=True)
    layers = len(plan["layer_types"])
    if name in GPU_RECIPES:
        _, billions, expected_layers, family = GPU_RECIPES[name]
        assert plan["parameters"] / 1e9 == pytest.approx(billions, abs=1e-3)
        assert layers == expected_layers
        assert dict(plan["rows"])["model config"].startswith(f"{family}, {layers} layers")
        # 3:1 over the layers the ratio counts: all of them, or the global ones where the teacher slides (Gemma 3)
        counted = layers - plan["layer_types"].count("sliding_attention")
        assert plan["layer_types"].count("linear_attention") == counted - math.ceil(counted / 4)
    assert plan["weight_bytes"] == plan["parameters"] * 4  # fp32 on a CPU (auto dtype)
    assert 0 <= plan["new_parameters"] < 0.02 * plan["parameters"]  # Performer's random features train nothing
    assert 0 < plan["lora_parameters"] < 0.02 * plan["parameters"]
    assert plan["peak_bytes"] > plan["weight_bytes"] + dry_run.RUNTIME_BYTES
    assert plan["peak_bytes"] == max(plan["memory"].values())
    trains = {"transfer": recipe.transfer.tokens > 0 and plan["new_parameters"] > 0, "finetune": recipe.finetune.tokens > 0}
    for stage, runs in trains.items():
        assert (plan["seconds"][stage] > 0) == runs and (stage in plan["memory"]) == runs
    assert plan["seconds"]["perplexity"] > 0
    assert all(seconds >= 0 for seconds in plan["seconds"].values())


def test_dry_run_from_the_cli_answers_for_every_gpu_recipe(linearize_main, offline, tmp_path, monkeypatch):
    import transformers

    monkeypatch.chdir(tmp_path)

    def loading(*args, **kwargs):
        raise AssertionError("a dry run loaded weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)
    for name in ("gemma-3-1b-gla", "phi-3-mini-gla"):
        code, out, err = linearize_main("--recipe", name, "--dry-run")
        assert code == 0, err
        assert "estimated peak memory" in out and "estimated time, finetune" in out and "-" not in out.split("time")[-1]
    assert list(tmp_path.iterdir()) == []


def _tied_llama(tmp_path, vocab=4096, hidden=64, inner=128, layers=4, heads=4, kv_heads=2):
    """A config whose tied embedding outweighs the decoder (as Gemma 3 270M's does): saved, no weights."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
                         max_position_embeddings=4096)  # fmt: skip
    config.save_pretrained(tmp_path)
    head_dim = hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inner + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden  # embedding (= head), layers, final norm


def _recipe(model, **stages):
    data = shipped_recipes()["smollm2-gla"].to_dict()
    data.update(name="t", model=model, aliases=[], layers={"ratio": "3:1", "placement": "spread"})
    for stage, tokens in stages.items():
        data[stage]["tokens"] = tokens
    return parse_recipe(data)


def test_a_tied_head_is_counted_once_and_every_time_is_positive(tmp_path, offline):
    params = _tied_llama(tmp_path)
    embedding = 4096 * 64
    assert params < 2 * embedding  # subtracting the head as well as the embedding left a negative body
    plan = dry_run.dry_run(_recipe(str(tmp_path), transfer=4096, finetune=4096), torch.device("cpu"), low_memory=True)
    assert plan["parameters"] == params
    assert plan["weight_bytes"] == 4 * params
    assert all(seconds > 0 for seconds in plan["seconds"].values() if seconds)
    assert not any("-" in value for item, value in plan["rows"] if item.startswith("estimated time"))


def test_the_heap_and_the_device_change_the_peak_as_measured(tmp_path, offline):
    """CPU: glibc's heap keeps every stage's transients (their sum, fragmented), --low-memory holds one stage's at a time;
    both on top of the runtime. GPU: allocated bytes in bf16, no runtime."""
    params = _tied_llama(tmp_path)
    recipe = _recipe(str(tmp_path), transfer=4096, finetune=4096)
    low = dry_run.dry_run(recipe, torch.device("cpu"), low_memory=True)
    fast = dry_run.dry_run(recipe, torch.device("cpu"), low_memory=False)
    weights = 4 * params
    stages = {k: v - dry_run.RUNTIME_BYTES - weights for k, v in low["memory"].items()}
    assert low["peak_bytes"] == dry_run.RUNTIME_BYTES + weights + max(stages.values())
    assert stages["export"] == weights  # the serialized copy
    retained = sum(stages.get(name, 0) for name in dry_run.HEAP_RETAINED_STAGES)
    kept = int(dry_run.HEAP_RETENTION * retained)
    assert fast["memory"]["finetune"] == dry_run.RUNTIME_BYTES + weights + kept
    assert fast["memory"]["export"] == dry_run.RUNTIME_BYTES + weights + max(kept, weights)  # in the heap's free blocks
    assert low["memory"]["export"] == dry_run.RUNTIME_BYTES + 2 * weights
    assert fast["peak_bytes"] == max(fast["memory"].values()) >= low["peak_bytes"]
    gpu = dry_run.dry_run(recipe, torch.device("cuda"), low_memory=False)
    assert gpu["weight_bytes"] == 2 * params  # bf16
    assert gpu["peak_bytes"] < low["peak_bytes"] - dry_run.RUNTIME_BYTES
    assert "allocated" in dict(gpu["rows"]).get("estimated memory, finetune", "")


def test_dry_run_decides_low_memory_as_the_cli_does(tmp_path, offline, monkeypatch):
    _tied_llama(tmp_path)
    recipe = _recipe(str(tmp_path), transfer=4096, finetune=4096)
    monkeypatch.setattr(dry_run, "needs_low_memory", lambda weights: True)
    assert dry_run.dry_run(recipe, torch.device("cpu"))["low_memory"] is True
    monkeypatch.setattr(dry_run, "needs_low_memory", lambda weights: False)
    assert dry_run.dry_run(recipe, torch.device("cpu"))["low_memory"] is False


def test_ranked_placements_estimate_their_placement_pass(tmp_path, offline):
    """measured and kl train every layer as linear first, and kl then runs one forward per layer: both are timed."""
    _tied_llama(tmp_path)
    seconds = {}
    for placement in ("spread", "retrieval", "measured", "kl"):
        recipe = _recipe(str(tmp_path), transfer=4096, finetune=4096)
        recipe.layers.placement = placement
        seconds[placement] = dry_run.dry_run(recipe, torch.device("cpu"), low_memory=False)["seconds"]["placement pass"]
    assert seconds["spread"] == seconds["retrieval"] == 0
    assert 0 < seconds["measured"] < seconds["kl"]
    recipe.layers.scores = [0.1, 0.4, 0.2, 0.3]  # an earlier export's ranking: no pass, and its plan
    estimate = dry_run.dry_run(recipe, torch.device("cpu"), low_memory=False)
    assert estimate["seconds"]["placement pass"] == 0
    assert estimate["layer_types"] == ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    assert dict(estimate["rows"])["layer plan (L linear, S softmax, W sliding window)"] == "LSLL (kl placement by the given scores)"
