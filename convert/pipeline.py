"""The whole job as one call: resolve, select, swap, transfer, finetune, measure, export.

`convert(teacher, tokenizer, recipe=..., output=...)` accepts a model already in memory or any
model spec. Work in progress lives in a work folder beside the output; rerunning the same job
resumes from it, and it is removed once the export is in place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..modeling.modeling_linearize import LinearizeForCausalLM
from . import data as data_lib
from .export import check_output, default_model_card, export
from .plan import describe, plan_layers
from .recipes import Recipe, Stage
from .sources import load_model, resolve
from ..modeling.families import text_config
from .swap import check_supported, linearize_model, new_parameters
from .train import StageResult, attention_transfer, lora_finetune, measure_layer_errors

logger = logging.getLogger(__name__)

MEASURE_TOKENS = 8192  # stage-1 budget of the all-linear pass that `measured` placement ranks layers with
MEASURE_ROWS_TOKENS = 2048  # tokens its per-layer errors are measured on


@dataclass
class ConversionReport:
    """What a conversion did and what it measured; rendered as the CLI's table and report.json."""

    model: str
    resolved: str
    recipe: str
    attention: dict[str, Any]
    plan: str
    layer_types: list[str]
    perplexity: dict[str, float] = field(default_factory=dict)  # teacher, zero_shot, student
    heldout_tokens: int = 0
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    layer_errors: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    output: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(metric, value) rows for the before/after table."""
        ppl = self.perplexity
        rows = [("model", f"{self.model} -> {self.resolved}"), ("layer plan (L linear, S softmax)", self.plan)]
        for key, label in (("teacher", "teacher"), ("zero_shot", "student, no training"), ("student", "student")):
            if key in ppl:
                ratio = f" ({ppl[key] / ppl['teacher']:.3f}x teacher)" if key != "teacher" and "teacher" in ppl else ""
                rows.append((f"held-out perplexity, {label}", f"{ppl[key]:.3f}{ratio}"))
        for name, stage in self.stages.items():
            loss = f", final loss {stage['final_loss']:.4g}" if stage.get("final_loss") is not None else ""
            rows.append((f"{name} tokens", f"{stage['tokens']:,} in {stage['seconds']:.0f} s{loss}"))
        rows.append(("total time", f"{self.seconds:.0f} s"))
        return rows

    def markdown(self) -> str:
        lines = ["| metric | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in self.rows()]
        return "\n".join(lines) + "\n"


def apply_overrides(recipe: Recipe, overrides: dict[str, Any]) -> Recipe:
    """Recipe with dotted-key overrides (e.g. {'transfer.tokens': 0}) applied; None values are ignored."""
    from .recipes import parse_recipe

    data = recipe.to_dict()
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, leaf = key.rpartition(".")
        target = data
        for part in section.split(".") if section else []:
            target = target[part]
        if leaf not in target:
            raise ValueError(f"unknown recipe key {key!r}")
        target[leaf] = value
    return parse_recipe(data)


def _spec(model: str) -> str:
    """What a model spec resolves to, recorded the way `convert` records its teacher."""
    source = resolve(model)
    return source.spec if source.kind in ("embedded", "hub") else str(Path(source.location).resolve())


def _fingerprint(recipe: Recipe, model: str) -> str:
    text = json.dumps({"recipe": recipe.to_dict(), "model": model}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stage_data(stage: Stage, tokenizer: PreTrainedTokenizerBase, seed: int) -> list[torch.Tensor]:
    """Packed, shuffled [N, L] token rows for each of the stage's lengths (one tensor per length).

    Offline corpora are read whole, so rows are drawn from all their documents; a hub dataset is
    streamed only as far as the budget needs.
    """
    texts = data_lib.load_texts(stage.dataset, stage.split, stage.text_field, stage.dataset_config)
    longest = max(stage.seq_lens)
    pool = None if data_lib.is_offline(stage.dataset) else max(stage.tokens, longest)
    stream = data_lib.token_stream(texts, tokenizer, pool)
    generator = torch.Generator().manual_seed(seed)
    phases = []
    for length in stage.seq_lens:
        rows = data_lib.cut(stream, length)
        rows = rows[torch.randperm(rows.shape[0], generator=generator)]
        need = math.ceil(stage.tokens / len(stage.seq_lens) / length)
        phases.append(rows[: max(1, need)])
    return phases


def _heldout_ppl(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, recipe: Recipe) -> float:
    from ..eval.perplexity import perplexity

    seq_len = recipe.eval.heldout_seq_len
    result = perplexity(
        model,
        tokenizer,
        data_lib.heldout_text(),
        seq_len=seq_len,
        stride=seq_len,
        max_tokens=recipe.eval.heldout_tokens,
        batch_size=4,
        progress=not os.environ.get("LINEARIZE_NO_PROGRESS"),
    )
    return float(result["ppl"])


def _default_dtype(recipe: Recipe, device: torch.device) -> torch.dtype:
    if recipe.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, recipe.dtype)


def plot_losses(results: list[StageResult], path: Path) -> Path | None:
    """Loss against tokens for each stage that ran, one panel per stage, as a PNG."""
    curves = [r for r in results if r.curve]
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, result in zip(axes[0], curves):
        tokens, losses = zip(*result.curve)
        ax.plot(tokens, losses, marker="o", markersize=3)
        ax.set_title(f"{result.name} loss")
        ax.set_xlabel("tokens")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:g}k"))
        ax.set_ylabel("MSE (sum over layers)" if result.name == "transfer" else "loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class WorkDir:
    """The resumable state of one run: fingerprint, measured numbers, stage checkpoints."""

    def __init__(self, path: Path, fingerprint: str, overwrite: bool, writer: bool = True):
        self.path = path
        self.writer = writer  # False: another process (the main one) prepared the folder and owns run.json
        meta = path / "run.json"
        if not writer:
            self.meta, self.state = meta, json.loads(meta.read_text())
            return
        if meta.is_file():
            saved = json.loads(meta.read_text())
            if saved.get("fingerprint") != fingerprint:
                # A run that failed before its first checkpoint (e.g. a typo in a flag) holds nothing to resume.
                if not overwrite and any(path.glob("*.safetensors")):
                    raise FileExistsError(
                        f"work folder {str(path)!r} holds a different run: rerun that run's command to resume it, "
                        "or pass --overwrite to discard it"
                    )
                shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self.state = json.loads(meta.read_text()) if meta.is_file() else {"fingerprint": fingerprint}
        self.save()

    def get(self, key: str) -> Any:
        return self.state.get(key)

    def put(self, key: str, value: Any) -> None:
        self.state[key] = value
        self.save()

    def save(self) -> None:
        if not self.writer:
            return
        tmp = self.meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.meta)


def convert(
    teacher: PreTrainedModel | str,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    recipe: Recipe | None = None,
    output: str | Path | None = None,
    overwrite: bool = False,
    work_dir: str | Path | None = None,
    accelerator: Accelerator | None = None,
    measure: bool = True,
) -> tuple[LinearizeForCausalLM, ConversionReport]:
    """Linearize `teacher` by `recipe`; export to `output` when given. Returns (student, report)."""
    started = time.perf_counter()
    recipe = recipe or Recipe()
    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(recipe.seed)
    if output is not None:
        output = Path(output).expanduser().resolve()
        check_output(output, overwrite)
    # A model in memory is named by where it was loaded from, not by the recipe's (default) model.
    by_spec = isinstance(teacher, str)
    if by_spec:
        # Record what the teacher resolves to (not a short name), so eval can find it again from anywhere.
        spec = _spec(teacher)
    else:
        spec = getattr(teacher.config, "_name_or_path", "") or "in-memory model"
    if isinstance(teacher, str):
        teacher, tokenizer, resolved = load_model(teacher, dtype=_default_dtype(recipe, accelerator.device))
    else:
        resolved = getattr(teacher.config, "_name_or_path", "") or "in-memory model"
        if tokenizer is None:
            raise ValueError("pass the teacher's tokenizer along with a model in memory")
    check_supported(teacher.config)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    work = None
    main = accelerator.is_main_process
    if output is not None:
        wd = Path(work_dir) if work_dir else output.parent / f".{output.name}.work"
        # Only the main process creates, checks or discards the work folder; the others read it after.
        if main:
            work = WorkDir(wd, _fingerprint(recipe, spec), overwrite)
        accelerator.wait_for_everyone()
        if not main:
            work = WorkDir(wd, _fingerprint(recipe, spec), overwrite, writer=False)
    work_path = None if work is None else work.path
    n_layers = text_config(teacher.config).num_hidden_layers
    settings = recipe.linear_attention()

    layer_errors = {} if work is None else {int(k): v for k, v in (work.get("layer_errors") or {}).items()}
    measured_student = None
    linear = recipe.layers.linear_layers
    # A recipe's kept plan serves its own model only (a model in memory cannot be told apart: measure it).
    own_model = by_spec and recipe.layers.measured and _spec(recipe.model) == spec
    if recipe.layers.placement == "measured" and not linear and own_model:
        linear = recipe.layers.measured
        logger.info("using the recipe's measured plan for %s", spec)
    if recipe.layers.placement == "measured" and not linear and not layer_errors:
        logger.info("measuring every layer as linear with a short attention transfer")
        all_linear = plan_layers(n_layers, linear_layers=list(range(n_layers)))
        # Layers are ranked with the feature maps on RoPE'd q/k, as the teacher sees them: that ranking
        # measured better for students of either kind (README, "Length").
        measure_settings = {**settings, "rope_features": True}
        measured_student = linearize_model(teacher, all_linear, measure_settings, spec)
        stage = dataclasses.replace(
            recipe.transfer,
            tokens=min(MEASURE_TOKENS, recipe.transfer.tokens or MEASURE_TOKENS),
            seq_len=recipe.transfer.seq_lens[0],
        )
        rows = _stage_data(stage, tokenizer, recipe.seed)[0]
        attention_transfer(measured_student, rows, stage, accelerator, None)
        layer_errors = measure_layer_errors(measured_student, rows[: max(1, MEASURE_ROWS_TOKENS // rows.shape[1])])
        if measure_settings != settings:
            measured_student = None  # its maps were fit to other inputs: no use as a starting point
        if work is not None:
            work.put("layer_errors", layer_errors)
    errors_list = [layer_errors.get(i, 0.0) for i in range(n_layers)] if layer_errors else None
    types = plan_layers(
        n_layers,
        recipe.layers.ratio,
        recipe.layers.placement,
        linear,
        recipe.layers.keep_softmax,
        errors_list,
    )
    logger.info("layer plan %s", describe(types))
    student = linearize_model(teacher, types, settings, spec)

    report = ConversionReport(
        model=spec,
        resolved=resolved,
        recipe=recipe.name,
        attention=settings,
        plan=describe(types),
        layer_types=types,
        layer_errors={str(k): v for k, v in sorted(layer_errors.items())},
        heldout_tokens=recipe.eval.heldout_tokens,
        output=None if output is None else str(output),
    )
    ppl = {} if work is None else dict(work.get("perplexity") or {})
    if measure and main and "teacher" not in ppl:
        ppl["teacher"] = _heldout_ppl(teacher, tokenizer, recipe)
        ppl["zero_shot"] = _heldout_ppl(student, tokenizer, recipe)
        if work is not None:
            work.put("perplexity", ppl)
    if measured_student is not None:
        # The measuring pass already trained every layer's new parameters: start stage 1 from them.
        trained = new_parameters(measured_student)
        with torch.no_grad():
            for name, p in new_parameters(student).items():
                p.copy_(trained[name])
        del measured_student

    results = []
    if recipe.transfer.tokens > 0:
        rows = _stage_data(recipe.transfer, tokenizer, recipe.seed)
        results.append(attention_transfer(student, rows, recipe.transfer, accelerator, work_path))
    if recipe.finetune.tokens > 0:
        rows = _stage_data(recipe.finetune, tokenizer, recipe.seed + 1)
        student_teacher = teacher if recipe.finetune.loss == "kl" else None
        results.append(lora_finetune(student, student_teacher, rows, recipe.finetune, accelerator, work_path))
    student.eval()
    for result in results:
        report.stages[result.name] = {
            "tokens": result.tokens,
            "steps": result.steps,
            "seconds": result.seconds,
            "final_loss": result.final_loss,
            "resumed_from": result.resumed_from,
        }
        if result.layer_errors:
            report.stages[result.name]["layer_mse"] = {str(k): v for k, v in result.layer_errors.items()}
    if measure and main:
        ppl["student"] = _heldout_ppl(student, tokenizer, recipe)
    report.perplexity = ppl
    report.seconds = time.perf_counter() - started
    accelerator.wait_for_everyone()

    if output is not None and main:
        card = default_model_card(student) + "\n## Conversion report\n\n" + report.markdown()

        def write_report(folder: Path) -> None:
            (folder / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
            plot_losses(results, folder / "loss.png")

        export(student, tokenizer, output, overwrite=True, model_card=card, extras=write_report)
        if work is not None:
            shutil.rmtree(work.path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return student, report
