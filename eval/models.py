"""Loading the models the evaluations compare: a converted student folder and its teacher."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

TEACHER_KEY = "linearize_teacher"


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
        kind = torch.device(device).type
    except RuntimeError:
        kind = device
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but CUDA is not available here: use --device cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unsupported --device {device!r}: use cpu or cuda")


def is_model_dir(spec: str | Path) -> bool:
    return Path(spec).expanduser().is_dir() and (Path(spec).expanduser() / "config.json").is_file()


def load(
    spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32, with_tokenizer: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None, str]:
    """(model, tokenizer or None, location) for a model folder, or anything the converter resolves.

    Folders load directly (remote code trusted: our exports carry their modeling files), so eval works
    on any HF folder; `.gguf` files, short names and hub ids go through `linearize.convert.sources`,
    which also caches dequantized GGUF teachers as safetensors and returns that folder.
    """
    if is_model_dir(spec):
        location = str(Path(spec).expanduser())
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, trust_remote_code=True)
        tokenizer = _tokenizer(location) if with_tokenizer else None
    else:
        from linearize.convert.sources import load_model

        model, tokenizer, location = load_model(spec, dtype=dtype, trust_remote_code=True)
    model.to(device).eval()
    return model, tokenizer, location


def _tokenizer(location: str) -> PreTrainedTokenizerBase | None:
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=True)
    except (OSError, ValueError):
        log.warning("no tokenizer in %s; text inputs will not work with it", location)
        return None
