"""Session-wide test setup: Triton kernels run in its interpreter on CPU tensors (no test here uses a GPU).

Set before any test module imports a kernel module: Triton picks the interpreter when a kernel is
decorated, i.e. at import.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Subprocesses started with `python -m` from the repository root must not find its kernels/ folder
# as the top-level `kernels` package that transformers imports.
os.environ.setdefault("PYTHONSAFEPATH", "1")


# --- conversion pipeline fixtures (tests/cli/test_cli.py, test_resume.py, test_distributed.py, ...) ---
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_fields(**overrides) -> dict:
    """The one tiny decoder shape the suite builds its random models from: hidden 32, 4 heads over 2 KV
    heads (GQA), head dim 8, vocab 128, 2 layers; any field can be overridden (a config class's keywords)."""
    fields = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    fields.update(overrides)
    return fields


def _tiny_tokenizer():
    """A 400-token byte-level BPE trained in ~0.1 s on the embedded corpus (no GGUF dequantization)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from linearize.convert.data import train_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=TINY_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([train_text()[:100_000]], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return _tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A random LlamaForCausalLM (hidden 32, 4 layers, 4 heads, 2 KV heads) saved with its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer
    config = LlamaConfig(
        **tiny_fields(
            vocab_size=len(tok),
            num_hidden_layers=4,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=True,
        )
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny GPT-2 (an architecture linearize does not convert) saved with a tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_tokenizer
    config = GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=2, n_head=2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    GPT2LMHeadModel(config).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _linearize_env(**extra: str) -> dict[str, str]:
    """Environment for CLI subprocesses: no progress bars, one thread, offline."""
    env = dict(os.environ)
    env.update(
        LINEARIZE_NO_PROGRESS="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TQDM_DISABLE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def cli_env() -> dict[str, str]:
    """The environment `run_linearize` uses, for tests that start the CLI themselves (Popen, accelerate)."""
    return _linearize_env()


@pytest.fixture
def run_linearize():
    """run_linearize(args, cwd, timeout=...) -> CompletedProcess of `python -m linearize ARGS`."""

    def run(args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "linearize", *map(str, args)],
            cwd=cwd,
            env=_linearize_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


# --- hybrid model fixtures (tests/modeling/test_modeling.py and its neighbours, test_export.py, test_performer.py) ---


@pytest.fixture
def one_torch_thread():
    """Tiny models run ~10x faster on one intra-op thread than on two busy, shared cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def embedded_teacher():
    """(model, tokenizer, location) of the embedded SmolLM2-135M-Instruct, fp32, eval mode; loaded once.

    Shared by every test in the session: never modify it (linearize_model copies, it does not mutate).
    """
    from linearize.convert.sources import load_model

    model, tokenizer, location = load_model("embedded:smollm2-135m-instruct")
    return model.eval(), tokenizer, location


def make_tiny_linearize(layer_types, linear_attention=None, *, seed: int = 0, **overrides):
    """A random LinearizeForCausalLM: hidden 32, 4 heads / 2 KV heads (GQA), vocab 128, fp32, eval mode."""
    import torch

    from linearize.modeling.configuration_linearize import LinearizeConfig
    from linearize.modeling.modeling_linearize import LinearizeForCausalLM

    fields = tiny_fields(
        num_hidden_layers=len(layer_types),
        max_position_embeddings=2048,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        layer_types=list(layer_types),
        linear_attention=dict(linear_attention or {}),
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    return LinearizeForCausalLM(LinearizeConfig(**fields)).float().eval()


@pytest.fixture
def tiny_linearize():
    """Factory: tiny_linearize(layer_types, linear_attention=None, seed=0, **config overrides)."""
    return make_tiny_linearize


@pytest.fixture
def linearize_main(capfd, monkeypatch):
    """linearize_main(*argv) -> (exit code, stdout, stderr) of `linearize ARGV` run in this process."""
    import logging

    from transformers.utils import logging as hf_logging

    from linearize.cli import main

    monkeypatch.setenv("LINEARIZE_NO_PROGRESS", "1")  # restored afterwards (--quiet sets it)
    hf_logging.disable_progress_bar()
    root, ours = logging.getLogger(), logging.getLogger("linearize")
    handlers, level = list(root.handlers), ours.level

    def run(*argv):
        capfd.readouterr()
        try:
            code = main([str(a) for a in argv])
        finally:
            for handler in root.handlers[:]:
                if handler not in handlers:
                    root.removeHandler(handler)
            ours.setLevel(level)
        out, err = capfd.readouterr()
        return code, out, err

    yield run
    hf_logging.enable_progress_bar()


# --- the user's side: code run as a user would run it (tests/cli/test_user_path.py, tests/convert/test_export.py) ---
import re  # noqa: E402
import textwrap  # noqa: E402

import yaml  # noqa: E402

BLOCK_LINEARIZE = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("linearize", "triton"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    """
)
PROMPT = "Do you wish to run the custom code"


def clean_env(home: Path) -> dict[str, str]:
    """A user's environment: no linearize on the path, nothing cached, no hub."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HF_HOME": str(home / "hf"),
        "HF_MODULES_CACHE": str(home / "hf_modules"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }


def run_isolated(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """Run `code` as a user would, with linearize unimportable and standard input closed (a prompt would fail)."""
    script = cwd / "user_script.py"
    script.write_text(BLOCK_LINEARIZE + code)
    return subprocess.run(
        [sys.executable, "-I", str(script), *args],
        cwd=cwd,
        env=clean_env(cwd),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def front_matter(card: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", card, re.DOTALL)
    assert match, "no front matter"
    return yaml.safe_load(match.group(1))


def snippet(card: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", card, re.DOTALL)
    assert len(blocks) == 1, "the card has one usage snippet"
    return blocks[0]
