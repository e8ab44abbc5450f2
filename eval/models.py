"""Loading the models the evaluations compare: a converted student folder and its teacher."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..convert.recipes import auto_dtype

log = logging.getLogger(__name__)

TEACHER_KEY = "linearize_teacher"
# `--dtype` names, as torch and lm-eval's `dtype=` model argument spell them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def student_config(student_dir: str | Path) -> dict[str, Any]:
    """The student's config.json; a missing folder or file is a one-line error naming the fix."""
    path = Path(student_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist: pass the --output folder of a conversion")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: pass a folder written by save_pretrained")
    return json.loads(cfg.read_text())


def teacher_spec(student_dir: str | Path, teacher: str | None) -> str:
    """`--teacher` if given, else the teacher the student's config records."""
    recorded = student_config(student_dir).get(TEACHER_KEY)
    if teacher:
        return teacher
    if not recorded:
        raise ValueError(
            f"{str(student_dir)!r} records no teacher ({TEACHER_KEY} in config.json): pass --teacher MODEL"
        )
    return str(recorded)


def check_device(device: str) -> None:
    """Fail early, with the fix, on a device this machine does not have."""
    try:
        kind, index = torch.device(device).type, torch.device(device).index
    except RuntimeError:
        kind, index = device, None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but CUDA is not available here: use --device cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unsupported --device {device!r}: use auto, cpu or cuda")
    if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"--device {device} but this machine has {count} CUDA device(s): use cuda:0 to {count - 1}")


def resolve_device_dtype(device: str = "auto", dtype: str | torch.dtype = "auto") -> tuple[str, torch.dtype]:
    """The concrete (device, dtype) for `--device` / `--dtype`, failing early on a device this machine lacks.

    "auto" picks the GPU when there is one, and bfloat16 there (half the memory of fp32, the precision
    models are served in on GPUs), but float32 on CPU, where bf16 matmuls are slower than fp32.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device)
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}: use auto, {', '.join(DTYPES)}")
        return device, dtype
    if dtype == "auto":
        return device, auto_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported --dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    return device, DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16", the spelling of lm-eval's `dtype=` model argument and of the reports."""
    return str(dtype).removeprefix("torch.")


def is_model_dir(spec: str | Path) -> bool:
    return Path(spec).expanduser().is_dir() and (Path(spec).expanduser() / "config.json").is_file()


def is_linearize_export(spec: str | Path) -> bool:
    """A folder written by linearize (config.json model_type "linearize"), whose modeling code ships with it."""
    if not is_model_dir(spec):
        return False
    try:
        return json.loads((Path(spec).expanduser() / "config.json").read_text()).get("model_type") == "linearize"
    except (OSError, ValueError, AttributeError):
        return False


def remote_code_ok(spec: str | Path, trust_remote_code: bool = False) -> bool:
    """Whether loading `spec` may run code from its folder or hub repo.

    Our own exports need it (their modeling files are the model) and we wrote that code; any other
    model, a hub teacher above all, runs foreign code only when the user asked (`--trust-remote-code`).
    """
    return trust_remote_code or is_linearize_export(spec)


def load(
    spec: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None, str]:
    """(model, tokenizer or None, location) for a model folder, or anything the converter resolves.

    Folders load directly, so eval works on any HF folder; `.gguf` files, short names and hub ids go
    through `linearize.convert.sources`, which also caches dequantized GGUF teachers as safetensors
    and returns that folder. Remote code runs for linearize exports, otherwise only with
    `trust_remote_code` (see `remote_code_ok`). `device` and `dtype` are concrete: see
    `resolve_device_dtype`.
    """
    trust = remote_code_ok(spec, trust_remote_code)
    if is_model_dir(spec):
        location = str(Path(spec).expanduser())
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, trust_remote_code=trust)
        tokenizer = _tokenizer(location, trust) if with_tokenizer else None
    else:
        from linearize.convert.sources import load_model

        model, tokenizer, location = load_model(spec, dtype=dtype, trust_remote_code=trust)
    model.to(device).eval()
    return model, tokenizer, location


def _tokenizer(location: str, trust_remote_code: bool) -> PreTrainedTokenizerBase | None:
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        log.warning("no tokenizer in %s; text inputs will not work with it", location)
        return None
