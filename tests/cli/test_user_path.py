"""The user's path: an export loads through AutoConfig, AutoModel, AutoModelForCausalLM and AutoTokenizer in a
process where `linearize` cannot be imported, and its model card is Hub-ready and its snippet runs as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROMPT, front_matter, make_tiny_linearize, run_isolated, snippet

from linearize.convert.card import markers, model_card, teacher_facts, update_section
from linearize.convert.export import export

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIN, FULL = "linear_attention", "full_attention"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A tiny GLA 2:1 export with a chat-template tokenizer: (student, tokenizer, folder)."""
    from conftest import _tiny_tokenizer

    tokenizer = _tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    student = make_tiny_linearize(
        [LIN, FULL, LIN], {"kind": "gla", "window": 4, "sink": 2, "chunk_size": 16}, vocab_size=len(tokenizer)
    )
    folder = export(student, tokenizer, tmp_path_factory.mktemp("export") / "tiny-gla")
    return student, tokenizer, folder


AUTO_CLASSES = """
import json, sys, torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

folder, ids = sys.argv[1], json.loads(sys.argv[2])
config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
backbone = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
lm = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
trusted = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
untrusted = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
x = torch.tensor(ids)
mask = torch.ones_like(x)
mask[1, :3] = 0  # left padding in the second row
with torch.no_grad():
    out = backbone(input_ids=x, attention_mask=mask, output_hidden_states=True, use_cache=True)
    full = lm(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    # the backbone's cache carries on: the last token after the rest equals the last token of the whole
    head = backbone(input_ids=x[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
    step = backbone(input_ids=x[:, -1:], attention_mask=mask, past_key_values=head.past_key_values, use_cache=True)
print("RESULT " + json.dumps({
    "config": type(config).__name__,
    "backbone": [c.__name__ for c in type(backbone).__mro__[:4]],
    "lm": type(lm).__name__,
    "hidden": out.last_hidden_state.tolist(),
    "n_hidden_states": len(out.hidden_states),
    "cache_layers": [type(layer).__name__ for layer in out.past_key_values.layers],
    "lm_hidden": full.tolist(),
    "step_gap": (step.last_hidden_state[:, -1] - out.last_hidden_state[:, -1]).abs().max().item(),
    "tokenizers": [type(trusted).__name__, type(untrusted).__name__],
    "same_ids": trusted("hello world")["input_ids"] == untrusted("hello world")["input_ids"],
    "loaded": sorted(m for m in sys.modules if m.partition(".")[0] == "linearize"),
}))
"""


def test_auto_classes_load_the_export_without_linearize(tiny_export, tmp_path):
    """AutoConfig, AutoModel (the backbone), AutoModelForCausalLM and AutoTokenizer all load, with no prompt."""
    student, tokenizer, folder = tiny_export
    ids = torch.randint(3, len(tokenizer), (2, 11), generator=torch.Generator().manual_seed(1)).tolist()
    proc = run_isolated(AUTO_CLASSES, tmp_path, str(folder), json.dumps(ids))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert PROMPT not in proc.stdout + proc.stderr
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["loaded"] == []
    assert result["config"] == "LinearizeConfig" and result["lm"] == "LinearizeForCausalLM"
    assert result["backbone"][0] == "LinearizeModel" and "LlamaModel" in result["backbone"]
    assert result["cache_layers"][0] != result["cache_layers"][1]  # a linear layer's state, a softmax layer's KV
    assert result["n_hidden_states"] == 4  # embeddings + 3 layers, as LlamaModel returns them
    # the backbone's last hidden state is the one the LM head reads (independently: the in-memory student's)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = student(torch.tensor(ids), attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(torch.tensor(result["hidden"]), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(result["lm_hidden"]), expected, rtol=1e-5, atol=1e-5)
    assert result["step_gap"] < 1e-4
    assert result["same_ids"]


def test_export_auto_map_names_the_backbone(tiny_export):
    config = json.loads((tiny_export[2] / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_linearize.LinearizeConfig",
        "AutoModel": "modeling_linearize.LinearizeModel",
        "AutoModelForCausalLM": "modeling_linearize.LinearizeForCausalLM",
    }


def test_model_card_snippet_runs_as_written(tiny_export, tmp_path):
    """Copied from the card as it stands, the snippet generates, with standard input closed and no linearize."""
    _, _, folder = tiny_export
    card = (folder / "README.md").read_text()
    code = snippet(card)
    assert code.count("trust_remote_code=True") == 2 and "apply_chat_template" in code
    assert re.search(r'model_id = "(.*)"', code).group(1) == str(folder)  # outside the working folder: absolute
    proc = run_isolated(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert PROMPT not in proc.stdout + proc.stderr
    assert proc.stdout.strip(), "the snippet printed no generation"


def test_python_started_in_the_checkout_root_imports_transformers():
    """`make convert` writes out/ in the checkout, so a user runs the card's snippet there: the root's kernels/
    folder must not stand in for the hub `kernels` package transformers imports (it hands over to it)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    code = "import transformers.integrations.hub_kernels, kernels; print(kernels.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).resolve() != root / "kernels" / "__init__.py"


def test_model_card_front_matter_and_title(tiny_llama_dir, tmp_path):
    """A local teacher whose card declares base_model and license: both carried over, the title names it,
    and no local path appears outside the snippet's model id."""
    teacher = tmp_path / "My-Teacher-1B"
    teacher.mkdir()
    for item in tiny_llama_dir.iterdir():
        (teacher / item.name).write_bytes(item.read_bytes())
    (teacher / "README.md").write_text("---\nlicense: mit\nbase_model: someorg/My-Teacher-1B\n---\n# card\n")
    facts = teacher_facts(str(teacher), chat_template=False)
    assert facts == {"name": "My-Teacher-1B", "hub_id": "someorg/My-Teacher-1B", "license": "mit", "chat": False}
    student = make_tiny_linearize([LIN, FULL, LIN, LIN], {"kind": "gla"}, linearize_teacher=str(teacher))
    card = model_card(student.config, facts, "out/my-teacher-gla", recipe="generic")
    meta = front_matter(card)
    assert meta["base_model"] == "someorg/My-Teacher-1B" and meta["license"] == "mit"
    assert meta["pipeline_tag"] == "text-generation" and meta["library_name"] == "transformers"
    assert {"linearize", "linear-attention", "gla"} <= set(meta["tags"])
    title = next(line for line in card.splitlines() if line.startswith("# "))
    assert title == "# My-Teacher-1B, linearized (GLA, 3 of 4 layers linear)"
    assert str(tmp_path) not in card
    code = snippet(card)
    assert 'tokenizer("The Python programming language"' in code and "apply_chat_template" not in code
    unknown = teacher_facts(str(tiny_llama_dir), chat_template=True)
    assert unknown["hub_id"] is None and unknown["license"] is None and unknown["chat"]
    assert "base_model" not in front_matter(model_card(student.config, unknown, "x"))


def test_embedded_teacher_facts_come_from_the_gguf():
    """The embedded teacher: its hub id from the table, its license from the GGUF's metadata."""
    facts = teacher_facts("embedded:smollm2-135m-instruct", chat_template=True)
    assert facts["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert facts["name"] == "SmolLM2-135M-Instruct" and facts["license"] == "apache-2.0"


def test_card_sections_replace_their_own_block(tmp_path):
    (tmp_path / "README.md").write_text("# card\n\n## Results\n")
    update_section(tmp_path, "perplexity", "ppl one")
    update_section(tmp_path, "bench", "bench one")
    update_section(tmp_path, "perplexity", "ppl two")
    text = (tmp_path / "README.md").read_text()
    assert "ppl one" not in text and text.count("ppl two") == 1 and "bench one" in text
    for section in ("perplexity", "bench"):
        begin, end = markers(section)
        assert text.count(begin) == 1 and text.count(end) == 1
    assert text.index("ppl two") < text.index("bench one")  # each block stays where it was first put
    assert text.startswith("# card\n\n## Results\n\n### Perplexity against context\n")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary card left behind"


def test_bench_markdown_for_the_card():
    from linearize.eval.bench import markdown_table

    row = {
        "context": 1024, "batch": 1, "status": "ok", "student_prefill_s": 0.5, "prefill_speedup": 1.25,
        "student_decode_tok_s": 40.0, "decode_speedup": 2.5, "student_cache_bytes": 3 * 2**20, "cache_ratio": 0.25,
        "peak_mem_ratio": 0.9,
    }  # fmt: skip
    report = {
        "rows": [row], "device": "cpu (2 threads)", "dtype": "float32", "student_decoding": "eager",
        "decode_tokens": 32, "teacher": "embedded:smollm2-135m-instruct", "contexts": [1024], "batch_sizes": [1],
    }  # fmt: skip
    md = markdown_table(report)
    assert "| 1024 | 1 | 0.50 | 1.25 | 40.0 | 2.50 | 3.0 | 0.250 | 0.90 |" in md
    assert "--contexts 1024 --batch-sizes 1" in md


def test_conversion_section_from_the_report():
    from linearize.convert.card import conversion_markdown

    report = {
        "perplexity": {"teacher": 10.0, "zero_shot": 12.5, "student": 10.2},
        "heldout_tokens": 16384, "heldout_seq_len": 2048,
        "stages": {"transfer": {"tokens": 40960, "seconds": 512.4, "final_loss": 0.38}},
        "layer_types": [LIN, FULL, LIN, FULL], "retrieval_scores": {"0": 0.1, "1": 0.2, "2": 0.3, "3": 0.9},
        "memory": {"kind": "rss", "peak_bytes": 5 * 2**30, "weight_bytes": 2**29, "peak_over_weights": 10.0},
        "seconds": 900.2, "resolved": "/root/.cache/linearize/private-path",
    }  # fmt: skip
    md = conversion_markdown(report)
    assert "| student before training | 12.500 | 1.250 |" in md and "| student | 10.200 | 1.020 |" in md
    assert "16,384 tokens" in md and "2,048-token windows" in md
    assert "| transfer | 40,960 | 512 s | 0.38 |" in md
    assert "retrieval score): 3 (0.90), 1 (0.20)." in md
    assert "5.00 GiB, 10.00x the weights' 0.50 GiB" in md and "Total time: 900 s." in md
    assert "/root" not in md


@pytest.mark.parametrize(("student", "flagged"), [(14.9, False), (15.1, True), (74.5, True)])
def test_a_student_far_from_its_teacher_fails_in_one_table_row(student, flagged):
    from linearize.convert.pipeline import ConversionReport

    report = ConversionReport(
        model="m", resolved="m", recipe="generic", recipe_yaml="", attention={}, plan="LLLS", layer_types=[LIN] * 3 + [FULL],
        perplexity={"teacher": 10.0, "zero_shot": 20.0, "student": student}, heldout_seq_len=2048,
    )  # fmt: skip
    checks = [value for metric, value in report.rows() if metric == "quality check"]
    if not flagged:
        assert checks == []
        return
    (line,) = checks
    assert line.startswith(f"FAILED: the student's perplexity is {student / 10:.2f}x the teacher's at 2048 tokens (limit 1.5x)")
    assert "--ratio 1:1" in line and "\n" not in line


def test_ppl_puts_its_table_in_the_card(tiny_export, tmp_path):
    """`linearize ppl` on an export fills the card's perplexity block, and a second run replaces it."""
    import shutil

    from linearize.eval.cli import ppl_main

    folder = tmp_path / "export"
    shutil.copytree(tiny_export[2], folder)
    for contexts in ("16,32", "16"):
        assert ppl_main([str(folder), "--skip-teacher", "--contexts", contexts, "--context-tokens", "64", "--texts", "pydoc"]) == 0
    card = (folder / "README.md").read_text()
    begin, end = markers("perplexity")
    block = card[card.index(begin) : card.index(end)]
    assert card.count(begin) == 1 and "| 16 | 64 | - |" in block and "| 32 |" not in block
    assert (folder / "context.json").is_file()


def test_ppl_state_off_control_adds_its_columns(tiny_export, tmp_path):
    """`linearize ppl --control state-off` scores the student again without its state, in the JSON and the card."""
    import shutil

    from linearize.eval.cli import ppl_main

    folder = tmp_path / "export"
    shutil.copytree(tiny_export[2], folder)
    argv = [str(folder), "--skip-teacher", "--contexts", "8,32", "--context-tokens", "64", "--texts", "pydoc", "--control", "state-off"]
    assert ppl_main(argv) == 0
    rows = json.loads((folder / "context.json").read_text())["contexts"]["pydoc"]
    assert [r["context"] for r in rows] == [8, 32] and all(r["state_off"] > 0 for r in rows)
    assert rows[1]["state_off"] != rows[1]["student"]  # past the 4-token window the state counts
    block = (folder / "README.md").read_text()
    assert "| state off ppl | state off / teacher | state carries |" in block
    carries = 100 * (rows[1]["state_off"] / rows[1]["student"] - 1)
    assert f"| {rows[1]['state_off']:.2f} | - | {carries:+.1f}% |" in block


def test_ppl_state_off_control_is_refused_before_loading(linearize_main, tiny_llama_dir):
    """A model with no linear layers is refused from its config, in one line, before anything loads."""
    code, _, err = linearize_main("ppl", str(tiny_llama_dir), "--control", "state-off")
    assert code == 2 and "--control state-off needs a converted model with linear layers: this one has none" in err
    assert len(err.strip().splitlines()) == 1
