"""Export (issue 2): a self-contained folder that loads with only torch + transformers.

The round trip uses the real embedded SmolLM2-135M (layers 0-2 swapped to GLA) and loads the export
in a subprocess where neither `linearize` nor `triton` can be imported. The folder-handling checks
run on a tiny random model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_linearize
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from linearize.convert.budget import weight_bytes
from linearize.convert.export import AUTO_MAP, export
from linearize.modeling.cpu_layout_linearize import lay_out_for_cpu_decode
from linearize.modeling.modeling_linearize import LinearAttention
from linearize.convert.swap import linearize_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIN, FULL = "linear_attention", "full_attention"
REMOTE_FILES = [
    "modeling_linearize.py", "configuration_linearize.py", "families.py", "cache_linearize.py", "decoding_linearize.py",
    "cpu_layout_linearize.py", "ops.py", "gla_torch.py", "delta_torch.py", "window_torch.py", "feature_maps.py",
]  # fmt: skip
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
PROMPT = (
    "Linear attention keeps a fixed-size state, so the memory of the cache does not grow with the "
    "length of the text. For example, a model that reads a long document"
)
NEW_TOKENS = 20


def safetensors_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            weights.update({key: f.get_tensor(key) for key in f.keys()})
    return weights


def assert_flat_remote_code(folder: Path) -> None:
    """Every Python file of the export imports only its neighbours (also inside functions): the set is complete."""
    for path in folder.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*from \.\.", text, flags=re.MULTILINE), f"{path.name} imports from a parent package"
        assert not re.search(r"^\s*(from|import) linearize\b", text, flags=re.MULTILINE), f"{path.name} imports linearize"
        for neighbour in re.findall(r"^\s*from \.(\w+) import", text, flags=re.MULTILINE):
            assert (folder / f"{neighbour}.py").is_file(), f"{path.name} imports .{neighbour}, which the export lacks"


def assert_no_pickles(folder: Path) -> None:
    pickles = [p.name for p in folder.rglob("*") if p.suffix in PICKLE_SUFFIXES]
    assert not pickles, f"pickle-format files in the export: {pickles}"


# ----------------------------------------------------------------------------------------------
# folder handling, on a tiny model


@pytest.fixture
def tiny_student():
    return make_tiny_linearize(
        [LIN, FULL, LIN], {"kind": "performer", "feature_map": "performer", "window": 4, "chunk_size": 16}
    )


def test_export_tiny_layout_and_in_process_reload(tiny_student, tmp_path):
    out = export(tiny_student, None, tmp_path / "model")
    assert out == (tmp_path / "model").resolve()
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", *REMOTE_FILES} <= names
    assert not [n for n in names if n.startswith(".")], "staging left-overs"
    assert_no_pickles(out)
    assert_flat_remote_code(out)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["layer_types"] == [LIN, FULL, LIN]
    assert config["linear_attention"]["kind"] == "performer" and config["linear_attention"]["window"] == 4
    weights = safetensors_weights(out)
    # the Performer random features are saved, so a loaded model computes exactly what was exported
    for i in (0, 2):
        key = f"model.layers.{i}.self_attn.performer_projection"
        assert torch.equal(weights[key], tiny_student.state_dict()[key])
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(loaded).__name__ == "LinearizeForCausalLM"
    ids = torch.randint(2, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, tiny_student(ids).logits, rtol=0, atol=0)


def test_export_refuses_non_empty_folder_without_overwrite(tiny_student, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export(tiny_student, None, target)
    assert (target / "keep.txt").read_text() == "user data"
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "staging folder left behind"


def test_export_overwrite_replaces_folder(tiny_student, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.bin").write_bytes(b"old weights")
    export(tiny_student, None, target, overwrite=True)
    names = {p.name for p in target.iterdir()}
    assert "stale.bin" not in names and "model.safetensors" in names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "old or staging folder left behind"
    # and again over its own previous export
    export(tiny_student, None, target, overwrite=True)
    assert (target / "config.json").is_file()


def test_export_into_existing_empty_folder(tiny_student, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    export(tiny_student, None, target)
    assert (target / "model.safetensors").is_file()


def test_export_refuses_a_disk_too_small_before_writing(tiny_student, tmp_path, monkeypatch):
    target = tmp_path / "model"
    export(tiny_student, None, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    free = weight_bytes(tiny_student)  # the weights fit, the folder's other files do not
    disk = types.SimpleNamespace(total=10 * free, used=9 * free, free=free)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk)
    for output in (target, tmp_path / "new" / "model"):
        with pytest.raises(OSError, match=r"^the export needs about .* GiB free: free some space or choose another --output$"):
            export(tiny_student, None, output, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "staging or new folder written"
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before, "the previous export changed"


def test_weight_bytes_counts_fused_projection_slices_apart(tiny_student):
    """q/k/v laid out for eager CPU decoding are slices of one storage: each still counts."""
    expected = sum(p.numel() * p.element_size() for p in tiny_student.parameters()) + sum(
        b.numel() * b.element_size() for b in tiny_student.buffers()
    )
    lay_out_for_cpu_decode(tiny_student, column_major=True, smallest=0)
    assert any(m.qkv_columns is not None for m in tiny_student.modules() if isinstance(m, LinearAttention))
    assert weight_bytes(tiny_student) == expected


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_the_export_is_sized_before_the_teacher_loads(tiny_llama_dir, dtype):
    """The disk check runs before loading, on sizes that must equal what the loaded teacher then holds."""
    from linearize.convert.pipeline import load_teacher, loaded_weight_bytes
    from linearize.convert.recipes import generic_recipe
    from linearize.convert.sources import load_config

    recipe = generic_recipe(str(tiny_llama_dir), 10**6, accelerated=False)
    recipe.dtype = dtype
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    estimate = loaded_weight_bytes(str(tiny_llama_dir), load_config(str(tiny_llama_dir)), recipe, accelerator.device)
    teacher, tokenizer, _, _ = load_teacher(str(tiny_llama_dir), None, recipe, accelerator)
    parameters = weight_bytes(teacher) - sum(b.numel() * b.element_size() for b in teacher.buffers())
    assert estimate == parameters
    in_memory = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    assert loaded_weight_bytes(in_memory, in_memory.config, recipe, accelerator.device) == weight_bytes(
        load_teacher(in_memory, tokenizer, recipe, accelerator)[0]
    )


# ----------------------------------------------------------------------------------------------
# the real thing: embedded SmolLM2-135M, layers 0-2 GLA


LOADER = textwrap.dedent(
    """
    import importlib.abc, json, sys

    BLOCKED = {"linearize", "triton"}


    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None


    sys.meta_path.insert(0, Block())
    for name in BLOCKED:
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{name} is importable")

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    folder, ids, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    model.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        last = model(x).logits[0, -1]
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)
    top = last.topk(10)
    print("RESULT " + json.dumps({
        "tokens": out[0, len(ids):].tolist(),
        "top_ids": top.indices.tolist(),
        "top_values": top.values.tolist(),
        "class": type(model).__name__,
        "family": next(c.__name__ for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")),
        "code_file": sys.modules[type(model).__module__].__file__,
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "blocked_loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED),
    }))
    """
)


@pytest.fixture(scope="module")
def real_export(embedded_teacher, tmp_path_factory):
    """(teacher, tokenizer, student, export folder): SmolLM2 with layers 0-2 GLA, exported once per module."""
    teacher, tokenizer, _ = embedded_teacher
    n = teacher.config.num_hidden_layers
    layer_types = [LIN] * 3 + [FULL] * (n - 3)
    student = linearize_model(teacher, layer_types, {"kind": "gla"}, teacher_name="smollm2").eval()
    root = tmp_path_factory.mktemp("export")
    yield teacher, tokenizer, student, export(student, tokenizer, root / "smollm2-gla3")
    shutil.rmtree(root)  # half a GB of fp32 weights: gone before the next module writes its own


@pytest.mark.slow
def test_real_export_layout(real_export):
    teacher, _, _, folder = real_export
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", *REMOTE_FILES} <= names
    assert_no_pickles(folder)
    assert_flat_remote_code(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["architectures"] == ["LinearizeForCausalLM"]
    assert config["layer_types"] == [LIN] * 3 + [FULL] * 27
    assert config["linear_attention"]["kind"] == "gla"
    assert config["base_model_type"] == "llama" and config["linearize_teacher"] == "smollm2"
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert config[field] == getattr(teacher.config, field), field


@pytest.mark.slow
def test_real_export_weights_keep_teacher_names_and_values(real_export):
    teacher, _, _, folder = real_export
    weights = safetensors_weights(folder)
    teacher_state = teacher.state_dict()
    tied = {"lm_head.weight"} if teacher.config.tie_word_embeddings else set()
    for key, value in teacher_state.items():
        if key in tied:
            continue
        assert key in weights, f"teacher weight {key} missing from the export"
        assert torch.equal(weights[key], value), f"{key} changed"
    new = set(weights) - set(teacher_state)
    assert new, "the linear layers' own parameters were not saved"
    linear_prefixes = tuple(f"model.layers.{i}.self_attn." for i in range(3))
    assert all(key.startswith(linear_prefixes) for key in new), sorted(new)[:5]
    assert all(weights[key].dtype == torch.float32 for key in weights)


@pytest.mark.slow
def test_real_export_round_trip_without_linearize(real_export, tmp_path):
    _, tokenizer, student, folder = real_export
    ids = tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 16  # the prefill takes the chunked path, decoding the recurrent one
    x = torch.tensor([ids])
    with torch.no_grad():
        last = student(x).logits[0, -1]
        expected = student.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = expected[0, len(ids) :].tolist()

    script = tmp_path / "load_export.py"
    script.write_text(LOADER)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),  # no user site, no shared module cache
        "HF_HOME": str(tmp_path / "hf"),
        "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-I", str(script), str(folder), json.dumps(ids), str(NEW_TOKENS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT ") :])

    assert result["blocked_loaded"] == []
    assert Path(result["code_file"]).is_relative_to(tmp_path / "hf_modules"), result["code_file"]
    assert result["class"] == "LinearizeForCausalLM"
    assert result["family"] == "LlamaForCausalLM"  # the base family's own class, with linear layers swapped in
    assert result["missing"] == [] and result["unexpected"] == []
    assert result["tokens"] == expected
    top = last.topk(10)
    assert result["top_ids"] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(result["top_values"]), top.values, rtol=1e-5, atol=1e-4)


def test_export_fails_on_a_missing_remote_code_file(tmp_path, monkeypatch):
    import importlib

    export_module = importlib.import_module("linearize.convert.export")  # the module, not the function

    monkeypatch.setattr(export_module, "REMOTE_CODE", [*export_module.REMOTE_CODE, ("kernels", "no_such_kernel.py")])
    with pytest.raises(FileNotFoundError, match=r"no_such_kernel.py', which is missing: reinstall linearize"):
        export_module.write_remote_code(tmp_path)


def test_an_export_missing_a_file_its_code_imports_is_caught(tmp_path, monkeypatch):
    """The completeness check can fail: the remote code written without window_torch.py, which the model imports."""
    import importlib

    export_module = importlib.import_module("linearize.convert.export")
    monkeypatch.setattr(export_module, "REMOTE_CODE", [e for e in export_module.REMOTE_CODE if e[1] != "window_torch.py"])
    export_module.write_remote_code(tmp_path)
    with pytest.raises(AssertionError, match="imports .window_torch, which the export lacks"):
        assert_flat_remote_code(tmp_path)


def test_convert_does_not_import_eval():
    """eval builds on convert (its data, sources and scoring), never the reverse."""
    import subprocess
    import sys

    code = "import sys, linearize.convert.pipeline, linearize.convert.cli; print(any(m.startswith('linearize.eval') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.slow
def test_real_export_card_snippet_generates(real_export, tmp_path):
    """The card of a real instruct export, its snippet copied as it stands: a chat reply, with no prompt, no
    linearize and standard input closed."""
    from conftest import PROMPT, front_matter, run_isolated, snippet

    _, tokenizer, student, folder = real_export
    card = (folder / "README.md").read_text()
    meta = front_matter(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["license"] == "apache-2.0"
    assert card.count("\n# SmolLM2-135M-Instruct, linearized (GLA, 3 of 30 layers linear)\n") == 1
    code = snippet(card)
    assert "apply_chat_template" in code
    proc = run_isolated(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert PROMPT not in proc.stdout + proc.stderr
    # what the student in this process replies to the snippet's message (this export is untrained: any reply)
    message = re.search(r'"content": "(.*?)"', code).group(1)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        ids = student.generate(**inputs, max_new_tokens=64, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert len(ids) == 64 or ids[-1] == tokenizer.eos_token_id
    assert proc.stdout == tokenizer.decode(ids, skip_special_tokens=True) + "\n"
