"""Export: a self-contained Hugging Face folder that loads anywhere with `trust_remote_code=True`.

The folder holds config.json (with `auto_map` for AutoConfig, AutoModel and AutoModelForCausalLM),
safetensors weights, the tokenizer, the model card (`card.py`) and the remote code. Transformers' loader follows only flat, same-folder relative imports, so the
modeling and kernel files are written side by side and `from ..kernels.x import` becomes
`from .x import`. The folder is assembled in a staging directory and moved into place in one step.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from ..modeling.modeling_linearize import LinearizeForCausalLM
from .budget import weight_bytes
from .card import model_card as card_text
from .card import model_id_for, teacher_facts

logger = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
REMOTE_CODE = [
    ("modeling", "configuration_linearize.py"),
    ("modeling", "families.py"),
    ("modeling", "modeling_linearize.py"),
    ("modeling", "cache_linearize.py"),
    ("modeling", "decoding_linearize.py"),
    ("modeling", "cpu_layout_linearize.py"),
    ("kernels", "ops.py"),
    ("kernels", "gla_torch.py"),
    ("kernels", "delta_torch.py"),
    ("kernels", "feature_maps.py"),
    ("kernels", "window_torch.py"),
    ("kernels", "gla_triton.py"),
    ("kernels", "delta_triton.py"),
    ("kernels", "feature_maps_triton.py"),
]
AUTO_MAP = {
    "AutoConfig": "configuration_linearize.LinearizeConfig",
    "AutoModel": "modeling_linearize.LinearizeModel",
    "AutoModelForCausalLM": "modeling_linearize.LinearizeForCausalLM",
}
EXPORT_EXTRA_BYTES = 64 * 2**20  # tokenizer, remote code, card, report and plot beside the weights
CROSS_PACKAGE_IMPORT = re.compile(r"^from \.\.\w+\.(\w+) import", flags=re.MULTILINE)


def check_output(path: Path, overwrite: bool) -> None:
    """Refuse to replace a user's folder unless asked to."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise FileExistsError(f"output {str(path)!r} already exists: pass --overwrite or choose another --output")


def check_space(output: Path, weights: int) -> None:
    """Refuse an export of `weights` bytes the disk cannot hold, before writing: a full disk fails inside
    the serializer instead, with an I/O error that names neither the cause's size nor the fix."""
    ancestor = output.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    needed, free = weights + EXPORT_EXTRA_BYTES, shutil.disk_usage(ancestor).free
    if needed > free:
        raise OSError(
            f"the export needs about {needed / 2**30:.2f} GiB and {str(ancestor)!r} has {free / 2**30:.2f} GiB free: "
            "free some space or choose another --output"
        )


def write_remote_code(folder: Path) -> None:
    """Copy the declared modeling and kernel sources flat into `folder`, imports made same-folder; a missing one fails."""
    for package, name in REMOTE_CODE:
        source = PACKAGE_ROOT / package / name
        if not source.is_file():
            raise FileNotFoundError(f"the export needs {str(source)!r}, which is missing: reinstall linearize")
        text = CROSS_PACKAGE_IMPORT.sub(r"from .\1 import", source.read_text())
        (folder / name).write_text(text)


def export(
    model: LinearizeForCausalLM,
    tokenizer: PreTrainedTokenizerBase | None,
    output: str | os.PathLike,
    overwrite: bool = False,
    model_card: str | None = None,
    extras: Callable[[Path], None] | None = None,
) -> Path:
    """Write the student to `output` atomically and return the folder; `extras` adds files to the staging folder."""
    output = Path(output).expanduser().resolve()
    check_output(output, overwrite)
    check_space(output, weight_bytes(model))
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.staging-"))
    try:
        model.config.auto_map = dict(AUTO_MAP)
        model.config.architectures = ["LinearizeForCausalLM"]
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        write_remote_code(staging)
        if model_card is None:
            chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
            facts = teacher_facts(model.config.linearize_teacher or "", chat)
            model_card = card_text(model.config, facts, model_id_for(output))
        (staging / "README.md").write_text(model_card)
        if extras is not None:
            extras(staging)
        _replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported to %s", output)
    return output


def _replace(staging: Path, output: Path) -> None:
    """Swap the staged folder into place; an old folder is removed only after the new one is there."""
    if not output.exists():
        os.replace(staging, output)
        return
    retired = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.old-"))
    os.replace(output, retired / "old")
    os.replace(staging, output)
    shutil.rmtree(retired, ignore_errors=True)
