"""Every supported family converts, exports, reloads without linearize, and keeps the transformers contract.

Tiny random teachers (hidden 32, 4 layers, vocab 128) of each family, with what makes the family
differ switched on: fused or per-head q/k/v, partial rotary, q/k norms (per head or flat), scaled
attention (Gemma's query_pre_attn_scalar, Granite's multipliers), sliding-window softmax layers.
The README's support matrix comes from this file's results (`python -m pytest tests/modeling/test_families.py -v`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)
from linearize.modeling.cache_linearize import LinearizeCacheLayer

from linearize.convert.export import export
from linearize.convert.budget import weight_bytes
from linearize.convert.swap import linearize_model, new_parameters
from linearize.convert.measure import final_hidden_states, head_logits
from linearize.convert.train import next_token_loss
from linearize.modeling.modes import teacher_attention
from linearize.modeling.modeling_linearize import LinearAttention, LinearizeForCausalLM
from conftest import tiny_fields

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIN, FULL = "linear_attention", "full_attention"
VOCAB, LAYERS, PROMPT, NEW = 128, 4, 21, 12
SETTINGS = {"window": 4, "sink": 2, "chunk_size": 16}
SLIDING = ["sliding_attention", FULL, "sliding_attention", FULL]


def _common(**extra):
    fields = tiny_fields(
        vocab_size=VOCAB,
        num_hidden_layers=LAYERS,
        max_position_embeddings=256,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    fields.update(extra)
    return fields


def _gemma3_multimodal():
    text = Gemma3TextConfig(**_common(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, layer_types=SLIDING))
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4, image_token_index=5)
    return Gemma3ForConditionalGeneration(config)


NEOX = dict(_common(), rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
NEOX.pop("num_key_value_heads")
TEACHERS = {
    "llama": lambda: AutoModelForCausalLM.from_config(LlamaConfig(**_common(attention_bias=True))),
    "mistral": lambda: AutoModelForCausalLM.from_config(MistralConfig(**_common(sliding_window=8))),
    "qwen2": lambda: AutoModelForCausalLM.from_config(Qwen2Config(**_common())),
    "qwen3": lambda: AutoModelForCausalLM.from_config(Qwen3Config(**_common(head_dim=16))),
    "gemma3_text": lambda: AutoModelForCausalLM.from_config(
        Gemma3TextConfig(**_common(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, layer_types=SLIDING))
    ),
    "gemma3": _gemma3_multimodal,
    "phi3": lambda: AutoModelForCausalLM.from_config(
        Phi3Config(**_common(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))
    ),
    "olmo2": lambda: AutoModelForCausalLM.from_config(Olmo2Config(**_common())),
    "granite": lambda: AutoModelForCausalLM.from_config(
        GraniteConfig(**_common(attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0))
    ),
    "gpt_neox": lambda: AutoModelForCausalLM.from_config(GPTNeoXConfig(**NEOX)),
}
FAMILY_NAMES = list(TEACHERS)


@torch.no_grad()
def make_teacher(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    teacher = TEACHERS[name]().float().eval()
    for pname, p in teacher.named_parameters():  # biases and norms off their trivial init, so reusing them is tested
        if pname.endswith(".bias"):
            p.normal_(0, 0.3)
        elif "norm" in pname:
            p.uniform_(0.5, 1.5)
    return teacher


@torch.no_grad()
def randomize(student: LinearizeForCausalLM) -> LinearizeForCausalLM:
    """Linear layers off their near-softmax start, so every check exercises the linear path."""
    gen = torch.Generator().manual_seed(3)
    for module in student.modules():
        if isinstance(module, LinearAttention):
            module.window_factor.copy_(torch.randn(module.window_factor.shape, generator=gen))
            if module.gate is not None:
                module.gate.up.weight.copy_(torch.randn(module.gate.up.weight.shape, generator=gen))
            if hasattr(module, "write_strength"):
                module.write_strength.proj.weight.copy_(torch.randn(module.write_strength.proj.weight.shape, generator=gen))
    return student


_STUDENTS: dict[str, LinearizeForCausalLM] = {}


def student_of(name: str) -> LinearizeForCausalLM:
    """Layers 0 and 2 linear (a sliding layer in Gemma), 1 and 3 the teacher's softmax."""
    if name not in _STUDENTS:
        _STUDENTS[name] = randomize(linearize_model(make_teacher(name), [LIN, FULL, LIN, FULL], SETTINGS)).eval()
    return _STUDENTS[name]


def ids_of(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(6, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    rows = [ids_of(1, PROMPT, seed=1)[0], ids_of(1, PROMPT - 7, seed=2)[0]]
    ids = torch.zeros(2, PROMPT, dtype=torch.long)
    mask = torch.zeros(2, PROMPT, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, PROMPT - len(row) :], mask[i, PROMPT - len(row) :] = row, 1
    return ids, mask


def recomputed(model, ids: torch.Tensor, steps: int) -> list[int]:
    seq = ids
    for _ in range(steps):
        seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return seq[0, ids.shape[1] :].tolist()


# ----------------------------------------------------------------------------------------------
# families


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_student_is_built_on_the_teachers_own_tensors(name):
    teacher = make_teacher(name)
    student = linearize_model(teacher, [LIN, FULL, LIN, FULL], SETTINGS)
    teacher_storage = {p.untyped_storage().data_ptr() for p in teacher.parameters()}
    new = set(new_parameters(student).values())
    for pname, p in student.named_parameters():
        assert not p.is_meta, pname
        assert (p.untyped_storage().data_ptr() in teacher_storage) != (p in new), pname  # shared, or new
    both = weight_bytes(torch.nn.ModuleList([teacher, student]))
    assert both == weight_bytes(teacher) + sum(p.numel() * p.element_size() for p in new)  # one set of weights


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_teacher_attention_turns_the_student_into_its_teacher(name):
    teacher, student = make_teacher(name), student_of(name)
    ids, mask = left_padded()
    with teacher_attention(student):
        restored = student(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(restored, teacher(ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(student(ids, attention_mask=mask, use_cache=False).logits, restored, atol=1e-3)


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_chunked_loss_logits_are_the_familys_own(name):
    """Stage 2 makes logits from final hidden states a chunk at a time: scaling and soft-capping included."""
    student = student_of(name)
    ids = ids_of(2, 9)
    with final_hidden_states(student) as hidden:
        logits = student(ids, use_cache=False).logits
    torch.testing.assert_close(head_logits(student, hidden[0]), logits.float(), rtol=1e-5, atol=1e-5)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(next_token_loss(student, hidden[0], labels=ids, chunk=5), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_every_layer_softmax_gives_the_teacher_exactly(name):
    teacher = make_teacher(name)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = linearize_model(teacher, [FULL] * LAYERS).eval()
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())  # the teacher is untouched
    ids, mask = left_padded()
    torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(
        student(ids, attention_mask=mask).logits, teacher(ids, attention_mask=mask).logits, rtol=0, atol=0
    )


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_cached_greedy_equals_recomputation(name):
    student = student_of(name)
    ids = ids_of(1, PROMPT, seed=4)
    out = student.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert out[0, PROMPT:].tolist() == recomputed(student, ids, NEW)


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_linear_state_stays_constant(name):
    student = student_of(name)
    sizes = []
    for new in (5, 60):
        out = student.generate(ids_of(1, 9), max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
        layers = out.cache.layers
        assert type(layers[0]) is LinearizeCacheLayer and type(layers[2]) is LinearizeCacheLayer
        sizes.append(sum(t.numel() for t in layers[0].recurrent_states.values() if t is not None))
        assert layers[3].keys.shape[2] == 9 + new - 1  # a full softmax layer's KV grows
    assert sizes[0] == sizes[1] > 0


def test_every_familys_export_loads_where_linearize_cannot_be_imported(tmp_path):
    """Each family's export loads and generates its student's 6 greedy tokens, all in one process (one start-up)."""
    cases, expected = [], {}
    for name in FAMILY_NAMES:
        student = student_of(name)
        folder = export(student, None, tmp_path / name)
        ids = ids_of(1, PROMPT, seed=5)
        with torch.no_grad():
            tokens = student.generate(ids, max_new_tokens=6, do_sample=False)[0, PROMPT:].tolist()
        cases.append((folder, ids))
        expected[str(folder)] = {"tokens": tokens, "missing": [], "unexpected": [], "linearize_loaded": False}
    assert load_without_linearize(cases, tmp_path) == expected


def load_without_linearize(cases: list[tuple[Path, torch.Tensor]], tmp_path) -> dict:
    """Load each folder of `cases` and generate 6 tokens from its ids, in one process where linearize and triton
    cannot be imported: {folder: what it gave}."""
    script, inputs = tmp_path / "load.py", tmp_path / "cases.json"
    script.write_text(LOADER)
    inputs.write_text(json.dumps([[str(folder), ids[0].tolist()] for folder, ids in cases]))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-I", str(script), str(inputs)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOADER = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("linearize", "triton"):
                raise ImportError(f"{name} is blocked")

    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModelForCausalLM

    results = {}
    for folder, ids in json.load(open(sys.argv[1])):
        model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
        ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.eval().generate(ids, max_new_tokens=6, do_sample=False)
        results[folder] = {
            "tokens": out[0, ids.shape[1]:].tolist(),
            "missing": sorted(info["missing_keys"]),
            "unexpected": sorted(info["unexpected_keys"]),
            "linearize_loaded": any(m.startswith("linearize") for m in sys.modules),
        }
    print(json.dumps(results))
    """
)


KINDS = {
    "deltanet": {"kind": "deltanet", "feature_map": "identity", "normalize": False, "conv_size": 4, **SETTINGS},
    "deltanet-normalized": {"kind": "deltanet", "feature_map": "hedgehog", "normalize": True, **SETTINGS},
    "gla-taylor-retnet": {"feature_map": "taylor", "feature_dim": 4, "gate": "retnet", **SETTINGS},
}


def test_other_kinds_export_and_generate_alike(tmp_path):
    """The delta rule (both forms) and the Taylor map / RetNet gate: cached = uncached greedy, and each export
    reproduces it where linearize cannot be imported."""
    cases, expected = [], {}
    for kind, settings in KINDS.items():
        student = randomize(linearize_model(make_teacher("llama"), [LIN, FULL, LIN, FULL], settings)).eval()
        ids = ids_of(1, PROMPT, seed=11)
        with torch.no_grad():
            tokens = student.generate(ids, max_new_tokens=6, do_sample=False)[0, PROMPT:].tolist()
        assert tokens == recomputed(student, ids, 6), kind
        folder = export(student, None, tmp_path / kind)
        cases.append((folder, ids))
        expected[str(folder)] = {"tokens": tokens, "missing": [], "unexpected": [], "linearize_loaded": False}
    assert load_without_linearize(cases, tmp_path) == expected


def test_gemma3_multimodal_teacher_gives_its_text_decoder():
    student = student_of("gemma3")
    assert student.config.base_model_type == "gemma3_text"
    assert next(c for c in type(student).__mro__ if c.__module__.startswith("transformers.models.")).__name__ == "Gemma3ForCausalLM"
    assert student.config.layer_types == [LIN, FULL, LIN, FULL]  # layer 2 was sliding: now linear
    assert student.base_model.config.layer_types == SLIDING  # the family model keeps its own types


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: __import__("transformers").GPT2Config(n_layer=2, n_embd=32, n_head=4), r"'gpt2' \(its attention layout\)"),
        (lambda: __import__("transformers").T5Config(num_layers=1, d_model=32), r"'t5' \(encoder-decoder models\)"),
        (lambda: __import__("transformers").DeepseekV3Config(num_hidden_layers=1), r"latent attention"),
    ],
    ids=["gpt2", "t5", "deepseek_v3"],
)
def test_unsupported_families_get_one_line_naming_why(config, message):
    from linearize.convert.swap import check_supported

    with pytest.raises(ValueError, match=message) as info:
        check_supported(config())
    assert "\n" not in str(info.value) and "gemma3_text" in str(info.value)


# ----------------------------------------------------------------------------------------------
# the transformers contract, on a hybrid of each shape (Llama: plain; Gemma 3: sliding + scaled)

CONTRACT = ["llama", "gemma3_text"]


@pytest.mark.parametrize("name", CONTRACT)
@torch.no_grad()
def test_cache_and_past_key_values_keywords(name):
    student = student_of(name)
    ids = ids_of(1, 30, seed=6)
    full = student(ids, use_cache=False).logits
    for keyword in ("cache", "past_key_values"):
        cache = DynamicCache(config=student.config)
        student(ids[:, :20], **{keyword: cache}, use_cache=True)
        step = student(ids[:, 20:], **{keyword: cache}, use_cache=True).logits
        torch.testing.assert_close(step, full[:, 20:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONTRACT)
@torch.no_grad()
def test_hidden_states_attentions_return_dict_and_loss(name):
    student = copy.deepcopy(student_of(name))
    student.set_attn_implementation("eager")
    ids = ids_of(2, 17, seed=7)
    out = student(ids, output_hidden_states=True, output_attentions=True, labels=ids)
    assert len(out.hidden_states) == LAYERS + 1 and all(h.shape == (2, 17, 32) for h in out.hidden_states)
    # softmax layers return their weights, linear layers None (they have no attention matrix)
    assert out.attentions[0] is None and out.attentions[2] is None
    assert out.attentions[1].shape == (2, 4, 17, 17) and out.attentions[3].shape == (2, 4, 17, 17)
    shifted = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, shifted, rtol=1e-5, atol=1e-5)
    as_tuple = student(ids, return_dict=False, labels=ids)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], out.loss)


@pytest.mark.parametrize("name", CONTRACT)
@torch.no_grad()
def test_sampling_beam_search_and_several_sequences(name):
    student = student_of(name)
    ids = ids_of(1, PROMPT, seed=8)
    torch.manual_seed(0)
    first = student.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=3)
    torch.manual_seed(0)
    again = student.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=3)
    assert first.shape == (3, PROMPT + 8) and torch.equal(first, again)
    beams = student.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)  # fmt: skip
    assert beams.sequences.shape == (2, PROMPT + 6)
    # the best beam's score is its own log-probability, recomputed without a cache
    best = beams.sequences[:1]
    logits = student(best, use_cache=False).logits[0, PROMPT - 1 : -1].log_softmax(-1)
    logprob = logits.gather(-1, best[0, PROMPT:, None]).sum()
    torch.testing.assert_close(beams.sequences_scores[0], logprob / 6, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CONTRACT)
@torch.no_grad()
def test_left_padded_batch_equals_rows_alone(name):
    student = student_of(name)
    ids, mask = left_padded()
    batch = student.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for row in range(2):
        alone = ids[row : row + 1, mask[row].bool()]
        single = student.generate(alone, max_new_tokens=8, do_sample=False)
        assert batch[row, PROMPT:].tolist() == single[0, alone.shape[1] :].tolist()


def test_assisted_decoding_is_refused_with_the_reason():
    student = student_of("llama")
    with pytest.raises(ValueError, match="cannot do: generate without assistant_model"):
        student.generate(ids_of(1, 9), assistant_model=copy.deepcopy(student), max_new_tokens=3)
    with pytest.raises(ValueError, match="roll the cache back"):
        student.generate(ids_of(1, 9), prompt_lookup_num_tokens=3, max_new_tokens=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loads_in_half_precision_and_with_a_device_map(dtype, tmp_path):
    student = student_of("llama")
    folder = export(student, None, tmp_path / "model")
    ids = ids_of(1, PROMPT, seed=9)
    with torch.no_grad():
        reference = student(ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype, device_map="auto")
    assert next(loaded.parameters()).dtype == dtype
    with torch.no_grad():
        logits = loaded(ids).logits.float()
        out = loaded.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.isfinite(logits).all() and out.shape == (1, PROMPT + 4)
    # as close to fp32 as half precision allows: a few hundredths on average over logits of size ~3
    error = (logits - reference).abs()
    assert error.mean() < 0.03 and error.max() < 0.5, (error.mean(), error.max())


def test_device_map_offloads_whole_decoder_layers(tmp_path):
    """A memory cap splits the model by the family's no-split decoder layers: the first on CPU, the rest on disk."""
    student = student_of("llama")
    folder = export(student, None, tmp_path / "model")
    ids = ids_of(1, PROMPT, seed=10)
    with torch.no_grad():
        expected = student.generate(ids, max_new_tokens=4, do_sample=False)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, device_map="auto", max_memory={"cpu": 40_000}, offload_folder=tmp_path / "offload"
    )
    placed = set(loaded.hf_device_map.values())
    assert "disk" in placed and placed & {"cpu", 0, "cpu:0"} or placed == {"disk"}, loaded.hf_device_map
    assert all(not key.endswith("self_attn") for key in loaded.hf_device_map)  # no layer is split
    with torch.no_grad():
        assert torch.equal(loaded.generate(ids, max_new_tokens=4, do_sample=False), expected)


def test_export_below_the_transformers_it_needs_says_so(tmp_path):
    folder = export(student_of("llama"), None, tmp_path / "model")
    script = (
        "import sys, transformers; transformers.__version__ = '5.0.0'\n"
        "from transformers import AutoModelForCausalLM\n"
        "AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}  # fmt: skip
    proc = subprocess.run([sys.executable, "-I", "-c", script, str(folder)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ImportError: this model needs transformers >= 5.24 (found 5.0.0)" in proc.stderr, proc.stderr[-2000:]
