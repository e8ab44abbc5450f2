"""The whole job as one call: check, load, select, swap, transfer, finetune, measure, export.

`convert(teacher, tokenizer, recipe=..., output=...)` accepts a model already in memory or any
model spec; each stage is one function below, and `convert` at the bottom runs them in order. Work
in progress lives in a work folder beside the output; rerunning the same job resumes from it, and
it is removed once the export is in place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..modeling.configuration_linearize import LINEAR, LINEAR_ATTENTION_DEFAULTS
from ..modeling.modeling_linearize import LinearizeForCausalLM
from . import data as data_lib
from .budget import body_parameter_count, parameter_count, peak_rss_bytes, weight_bytes
from .card import conversion_markdown, heldout_contexts_markdown, model_card, model_id_for, teacher_facts, update_section
from .export import check_output, check_space, export
from .measure import compare_contexts, perplexity_by_context, shared_tokens, usable_contexts
from .parallel import sharding_requested
from .plan import MEASURE_ROWS_TOKENS, MEASURE_TOKENS, SCORED, SLIDING, describe, plan_layers, sliding_plan
from .recipes import Recipe, Stage, generic_recipe, recipe_to_yaml, shipped_recipe_for
from .retrieval import haystack_text, retrieval_scores
from .sources import check_weights, load_config, load_model, resolve
from .swap import check_supported, linearize_model, new_parameters
from .train import StageResult, attention_transfer, lora_finetune, measure_kl_gains, measure_layer_errors

logger = logging.getLogger(__name__)

SCORE_OF = {"measured": "layer_errors", "kl": "kl_gains", "retrieval": "retrieval_scores"}  # placement: its ranking
SCORE_KINDS = tuple(SCORE_OF.values())  # the per-layer rankings a work folder keeps
QUALITY_LIMIT = 1.5  # student over teacher perplexity at the held-out length past which the run says it failed


@dataclass
class ConversionReport:
    """What a conversion did and what it measured; rendered as the CLI's table and report.json."""

    model: str
    resolved: str
    recipe: str  # its name
    recipe_yaml: str  # the recipe as run: `linearize --recipe` on it repeats the run
    attention: dict[str, Any]
    plan: str
    layer_types: list[str]
    perplexity: dict[str, float] = field(default_factory=dict)  # teacher, zero_shot, student
    heldout_tokens: int = 0
    heldout_seq_len: int = 0
    contexts: list[dict[str, Any]] = field(default_factory=list)  # perplexity against context, teacher and student
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    layer_errors: dict[str, float] = field(default_factory=dict)  # measured placement's ranking
    kl_gains: dict[str, float] = field(default_factory=dict)  # kl placement's ranking
    retrieval_scores: dict[str, float] = field(default_factory=dict)  # retrieval placement's ranking
    memory: dict[str, Any] = field(default_factory=dict)  # peak bytes against the teacher's weight bytes
    seconds: float = 0.0
    output: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def quality_warning(self) -> str | None:
        """One line when the trained student is far from its teacher at the held-out length, with the likely fix."""
        ppl = self.perplexity
        if "student" not in ppl or not ppl.get("teacher"):
            return None
        ratio = ppl["student"] / ppl["teacher"]
        if ratio <= QUALITY_LIMIT:
            return None
        return (
            f"FAILED: the student's perplexity is {ratio:.2f}x the teacher's at {self.heldout_seq_len} tokens (limit "
            f"{QUALITY_LIMIT}x); likely fix: keep more layers softmax (--ratio 1:1), or train longer "
            "(--transfer-tokens, --finetune-tokens)"
        )

    def rows(self) -> list[tuple[str, str]]:
        """(metric, value) rows for the before/after table."""
        ppl = self.perplexity
        rows = [("model", f"{self.model} -> {self.resolved}"), ("layer plan (L linear, S softmax, W sliding window)", self.plan)]
        for label, ranking, fmt in (("retrieval score", self.retrieval_scores, ".2f"), ("KL drop when restored", self.kl_gains, ".3g")):
            if ranking:
                score = {int(i): v for i, v in ranking.items()}
                kept = sorted((i for i, kind in enumerate(self.layer_types) if kind not in (LINEAR, SLIDING)), key=lambda i: -score[i])
                rows.append((f"softmax layers by {label}", ", ".join(f"{i} ({score[i]:{fmt}})" for i in kept)))
        for key, label in (("teacher", "teacher"), ("zero_shot", "student, no training"), ("student", "student")):
            if key in ppl:
                ratio = f" ({ppl[key] / ppl['teacher']:.3f}x teacher)" if key != "teacher" and "teacher" in ppl else ""
                rows.append((f"held-out perplexity, {label}", f"{ppl[key]:.3f}{ratio}"))
        if self.contexts:
            ratios = ", ".join(f"{r['context']}: {r['ratio']:.3f}x" for r in self.contexts if r["ratio"] is not None)
            rows.append(("student / teacher by context", ratios))
        warning = self.quality_warning()
        if warning:
            rows.append(("quality check", warning))
        for name, stage in self.stages.items():
            loss = f", final loss {stage['final_loss']:.4g}" if stage.get("final_loss") is not None else ""
            rows.append((f"{name} tokens", f"{stage['tokens']:,} in {stage['seconds']:.0f} s{loss}"))
        if self.memory:
            memory = self.memory
            rows.append(
                (
                    f"peak memory ({memory['kind']})",
                    f"{memory['peak_bytes'] / 2**30:.2f} GiB ({memory['peak_over_weights']:.2f}x the weights' "
                    f"{memory['weight_bytes'] / 2**30:.2f} GiB)",
                )
            )
        rows.append(("total time", f"{self.seconds:.0f} s"))
        return rows


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


def scores_from(folder: str | Path, recipe: Recipe) -> list[float]:
    """An earlier export's ranking for `recipe`'s placement, one score per layer, for `layers.scores`.

    A ranking depends on the teacher and the linear attention's settings, not on the ratio, so an export
    of the same teacher with the same settings lends its scores to any ratio; anything else is refused.
    """
    kind = SCORE_OF.get(recipe.layers.placement)
    if kind is None:
        raise ValueError(
            f"--scores-from reuses a scored placement's ranking, and this run's placement is {recipe.layers.placement!r}: "
            f"add --placement {' or '.join(SCORED)}"
        )
    path = Path(folder).expanduser()
    report_path = path / "report.json" if path.is_dir() else path
    if not report_path.is_file():
        raise FileNotFoundError(f"--scores-from {folder}: no report.json there: pass a folder that `linearize` converted")
    try:
        report = json.loads(report_path.read_text())
        source, attention, n_layers = report["model"], report["attention"], len(report["layer_types"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"--scores-from {folder}: its report.json is not a conversion report ({err}): convert it again") from None
    scores = report.get(kind) or {}
    if not scores:
        raise ValueError(
            f"--scores-from {folder}: it holds no {kind}: pass an export converted with --placement {recipe.layers.placement}"
        )
    spec = _spec(recipe.model)
    if source != spec:
        raise ValueError(f"--scores-from {folder}: it was converted from {source}, not {spec}: pass an export of this model")
    settings = recipe.linear_attention()
    attention = {**LINEAR_ATTENTION_DEFAULTS, **attention}  # a setting newer than the export: it ran the default
    differ = sorted(k for k in {*settings, *attention} if settings.get(k) != attention.get(k))
    if differ:
        raise ValueError(
            f"--scores-from {folder}: it ranked its layers with other attention settings ({', '.join(differ)}): "
            "convert with its settings, or drop --scores-from to measure the ranking again"
        )
    return [float(scores.get(str(i), 0.0)) for i in range(n_layers)]


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
        if need > 2 * rows.shape[0]:
            logger.warning(
                "%s holds %d rows of %d tokens but the budget takes %d: it will be seen %.0f times over; "
                "pass a larger --dataset", stage.dataset, rows.shape[0], length, need, need / rows.shape[0],
            )
        phases.append(rows[: max(1, need)])
    return phases


def _heldout_tokens(
    tokenizer: PreTrainedTokenizerBase, recipe: Recipe, model: PreTrainedModel
) -> tuple[list[int], list[int], int]:
    """The held-out stream every measurement scores, its context lengths (eval.contexts and the headline
    window), and the headline window: heldout_seq_len, shortened to what the text and the model allow.

    The stream is cut to a whole number of the longest windows, so each length scores the same tokens.
    """
    ids = tokenizer(data_lib.heldout_text(), verbose=False)["input_ids"][: recipe.eval.heldout_tokens + 1]
    limit = getattr(model.config, "max_position_embeddings", None) or recipe.eval.heldout_seq_len
    seq_len = min(recipe.eval.heldout_seq_len, len(ids) - 1, limit)
    lengths = usable_contexts([*recipe.eval.contexts, seq_len], len(ids), limit)
    return shared_tokens(ids, lengths), lengths, seq_len


def _score_contexts(model: PreTrainedModel, ids: list[int], lengths: list[int]) -> list[dict[str, float | int]]:
    # batch 1: one window's logits at a time, so the vocabulary-wide tensors stay small
    return perplexity_by_context(model, None, ids, lengths, progress=not os.environ.get("LINEARIZE_NO_PROGRESS"))


def default_recipe(model: str | PreTrainedModel) -> Recipe:
    """The shipped recipe of a known model, else the generic method with budgets sized for its body and this machine."""
    if isinstance(model, str):
        shipped = shipped_recipe_for(model)
        if shipped is not None:
            return shipped
        n_params = parameter_count(load_config(model), body_only=True)
        spec = model
    else:
        n_params = body_parameter_count(model)
        spec = getattr(model.config, "_name_or_path", "") or "in-memory model"
    return generic_recipe(spec, n_params, torch.cuda.is_available())


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


def check_output_writable(output: Path, overwrite: bool) -> None:
    """Refuse an existing output (without --overwrite) or one that cannot be created, before anything is written."""
    check_output(output, overwrite)
    ancestor = output.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(f"{str(ancestor)!r} is a file")
        tempfile.TemporaryDirectory(dir=ancestor).cleanup()  # a probe: the export and work folder go here
    except OSError as err:
        reason = err.strerror or str(err)
        raise PermissionError(f"cannot write --output {str(output)!r} ({str(ancestor)!r}: {reason}): choose another --output") from None


def loaded_weight_bytes(teacher: PreTrainedModel | str, config: PretrainedConfig, recipe: Recipe, device: torch.device) -> int:
    """Bytes the teacher's weights take once `load_teacher` has them, known before it runs: the export's bulk."""
    if isinstance(teacher, str):
        return parameter_count(config) * recipe.torch_dtype(device).itemsize
    return weight_bytes(teacher, None if recipe.dtype == "auto" else recipe.torch_dtype(device))  # as `load_teacher` casts


def check_inputs(
    teacher: PreTrainedModel | str, recipe: Recipe, output: Path | None, overwrite: bool, device: torch.device
) -> None:
    """Stage 0: refuse, in one line naming the fix, anything that would fail later; nothing loads or is written.

    The recipe checked its own values when parsed; here it meets the model's config (family, layer
    indices, the export's size against the output's disk) and the files (weights readable, output writable).
    """
    if output is not None:
        check_output_writable(output, overwrite)
    scoring = recipe.layers.placement in SCORED and not recipe.layers.linear_layers  # it reads the transfer data
    for stage in (recipe.transfer, recipe.finetune):
        if stage.tokens or (scoring and stage is recipe.transfer):
            data_lib.check_dataset(stage.dataset)
    if isinstance(teacher, str):
        source = resolve(teacher)
        config = load_config(teacher)  # a GGUF's from its metadata: nothing is dequantized here
        if source.kind == "local":
            check_weights(source.location)
    else:
        config = teacher.config
    check_supported(config)
    n_layers = config.get_text_config().num_hidden_layers
    layers = recipe.layers
    if layers.scores is not None and len(layers.scores) != n_layers:
        raise ValueError(
            f"recipe key 'layers.scores' holds {len(layers.scores)} scores but the model has {n_layers} layers: "
            "take them from an export of this model (--scores-from DIR)"
        )
    plan_layers(n_layers, layers.ratio, layers.placement_before_scoring, layers.linear_layers, layers.keep_softmax, layers.scores, *sliding_plan(config, layers))
    if output is not None:
        check_space(output, loaded_weight_bytes(teacher, config, recipe, device))  # the student keeps these and adds a few


def load_teacher(
    teacher: PreTrainedModel | str, tokenizer: PreTrainedTokenizerBase | None, recipe: Recipe, accelerator: Accelerator
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str, str]:
    """(teacher on the accelerator's device, frozen; tokenizer; spec as recorded; where it was loaded from)."""
    if isinstance(teacher, str):
        spec = _spec(teacher)  # what it resolves to (not a short name), so eval finds it again from anywhere
        teacher, tokenizer, resolved = load_model(teacher, recipe.torch_dtype(accelerator.device), device=accelerator.device)
    else:
        if tokenizer is None:
            raise ValueError("pass the teacher's tokenizer along with a model in memory")
        spec = resolved = getattr(teacher.config, "_name_or_path", "") or "in-memory model"
        # Where a loaded teacher would be: on the accelerator's device, in the recipe's dtype unless `auto`
        # (then the model's own). Module.to moves in place: the student takes these weights anyway.
        teacher.to(accelerator.device, dtype=None if recipe.dtype == "auto" else recipe.torch_dtype(accelerator.device))
    teacher.eval().requires_grad_(False)
    return teacher, tokenizer, spec, resolved


def open_work_dir(
    output: Path | None, work_dir: str | Path | None, recipe: Recipe, spec: str, overwrite: bool, accelerator: Accelerator
) -> WorkDir | None:
    """The run's resumable state beside the output; only the main process creates, checks or discards it."""
    if output is None:
        return None
    path = Path(work_dir) if work_dir else output.parent / f".{output.name}.work"
    work = WorkDir(path, _fingerprint(recipe, spec), overwrite) if accelerator.is_main_process else None
    accelerator.wait_for_everyone()
    return work or WorkDir(path, _fingerprint(recipe, spec), overwrite, writer=False)


@dataclass
class Selection:
    """What stage 1 decided: the plan, the per-layer scores it was ranked by, and parameters already trained."""

    types: list[str]
    layer_errors: dict[int, float] = field(default_factory=dict)  # measured: relative transfer error
    kl_gains: dict[int, float] = field(default_factory=dict)  # kl: drop in KL to the teacher when restored
    retrieval_scores: dict[int, float] = field(default_factory=dict)  # retrieval: attention on far facts
    trained: dict[str, torch.Tensor] | None = None  # the measuring pass's new parameters, when they fit


def select_layers(
    teacher: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    recipe: Recipe,
    own_model: bool,
    work: WorkDir | None,
    accelerator: Accelerator,
    shard: bool = False,
) -> Selection:
    """Stage 1: the layer plan, from the recipe, or scored on the teacher by a scored placement.

    `measured` trains every layer as linear on a short transfer and keeps softmax where the error is
    largest; `kl` trains the same all-linear student and keeps softmax where restoring one layer lowers
    the KL to the teacher most; `retrieval` keeps softmax where the teacher's heads fetch a fact from
    beyond the window.
    A recipe's kept plan serves its own model without scoring.
    """
    n_layers = teacher.config.get_text_config().num_hidden_layers
    settings = recipe.linear_attention()
    layers = recipe.layers
    saved = {} if work is None else work.get("layer_scores") or {}
    selection = Selection(types=[], **{k: {int(i): v for i, v in saved.get(k, {}).items()} for k in SCORE_KINDS})
    linear = layers.linear_layers
    if layers.placement in SCORED and not linear and own_model and layers.measured:
        linear = layers.measured
        logger.info("using the recipe's kept %s plan", layers.placement)
    kind = SCORE_OF.get(layers.placement)
    if kind and layers.scores is not None and not linear and not getattr(selection, kind):
        setattr(selection, kind, dict(enumerate(layers.scores)))
        logger.info("ranking the layers by the recipe's %s scores instead of measuring them", layers.placement)
    if layers.placement in ("measured", "kl") and not linear and not getattr(selection, kind):
        logger.info("training every layer as linear with a short attention transfer, to rank the layers")
        # `measured` ranks with the feature maps on RoPE'd q/k, as the teacher sees them: that ranking measured
        # better for students of either kind. `kl` ranks the student's own layers.
        measure_settings = {**settings, "rope_features": True} if layers.placement == "measured" else settings
        every = linearize_model(teacher, plan_layers(n_layers, linear_layers=list(range(n_layers))), measure_settings)
        stage = dataclasses.replace(
            recipe.transfer,
            tokens=min(MEASURE_TOKENS, recipe.transfer.tokens or MEASURE_TOKENS),
            seq_len=recipe.transfer.seq_lens[0],
        )
        rows = _stage_data(stage, tokenizer, recipe.seed)[0]
        attention_transfer(every, rows, stage, accelerator, None, shard)
        scored_rows = rows[: max(1, MEASURE_ROWS_TOKENS // rows.shape[1])]
        if layers.placement == "measured":
            selection.layer_errors = measure_layer_errors(every, scored_rows)
        else:
            selection.kl_gains = measure_kl_gains(every, scored_rows)
        if measure_settings == settings:  # its maps fit the student's inputs: a head start for stage 1
            selection.trained = {name: p.detach() for name, p in new_parameters(every).items()}
    if layers.placement == "retrieval" and not linear and not selection.retrieval_scores:
        logger.info("scoring the teacher's layers by their attention on far-back facts")
        stage = recipe.transfer
        texts = data_lib.load_texts(stage.dataset, stage.split, stage.text_field, stage.dataset_config)
        selection.retrieval_scores = retrieval_scores(teacher, tokenizer, settings, haystack_text(texts), recipe.seed)
    if work is not None:
        work.put("layer_scores", {k: getattr(selection, k) for k in SCORE_KINDS if getattr(selection, k)})
    scores = getattr(selection, kind) if kind else {}
    ranked = [scores.get(i, 0.0) for i in range(n_layers)] if scores else None
    # retrieval on a context too short to reach past the window: nothing to rank by (retrieval_scores warned)
    placement = "spread" if layers.placement == "retrieval" and not scores else layers.placement
    selection.types = plan_layers(n_layers, layers.ratio, placement, linear, layers.keep_softmax, ranked, *sliding_plan(teacher.config, layers))
    logger.info("layer plan %s", describe(selection.types))
    return selection


def train_student(
    student: LinearizeForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    recipe: Recipe,
    accelerator: Accelerator,
    work: WorkDir | None,
    shard: bool = False,
) -> list[StageResult]:
    """Stages 2 and 3: attention transfer, then LoRA fine-tuning (each skipped at 0 tokens, resumed from the work
    folder); `shard`: the weights are sharded over the processes while each trains (FSDP2)."""
    work_path = None if work is None else work.path
    results = []
    if recipe.transfer.tokens > 0:
        rows = _stage_data(recipe.transfer, tokenizer, recipe.seed)
        results.append(attention_transfer(student, rows, recipe.transfer, accelerator, work_path, shard))
    if recipe.finetune.tokens > 0:
        rows = _stage_data(recipe.finetune, tokenizer, recipe.seed + 1)
        results.append(lora_finetune(student, rows, recipe.finetune, accelerator, work_path, shard))
    student.eval()
    return results


def effective_recipe(recipe: Recipe, types: list[str]) -> Recipe:
    """The recipe as run: a scored plan is kept in it, so `--recipe` on its YAML repeats the run without scoring."""
    if recipe.layers.placement not in SCORED or recipe.layers.linear_layers:
        return recipe
    linear = [i for i, kind in enumerate(types) if kind == LINEAR]
    return dataclasses.replace(recipe, layers=dataclasses.replace(recipe.layers, measured=linear))


def memory_figures(weights: int, device: torch.device) -> dict[str, float]:
    """Peak memory of the run against the teacher's weight bytes (RSS on a CPU, allocated bytes on a GPU)."""
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    return {"peak_bytes": peak, "weight_bytes": weights, "peak_over_weights": peak / weights, "kind": "cuda" if device.type == "cuda" else "rss"}


def write_export(
    student: LinearizeForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    output: Path,
    report: ConversionReport,
    results: list[StageResult],
    work: WorkDir | None,
) -> None:
    """Stage 4: the export folder, written atomically with its report, recipe and loss plot; the work folder goes after."""
    facts = teacher_facts(report.model, bool(getattr(tokenizer, "chat_template", None)))
    card = model_card(student.config, facts, model_id_for(output), report.recipe)

    def write_report(folder: Path) -> None:
        (folder / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
        (folder / "recipe.yaml").write_text(report.recipe_yaml)
        plot_losses(results, folder / "loss.png")
        update_section(folder, "conversion", conversion_markdown(report.to_dict()))
        if report.contexts:
            update_section(folder, "perplexity", heldout_contexts_markdown(report.contexts))

    export(student, tokenizer, output, overwrite=True, model_card=card, extras=write_report)
    if work is not None:
        shutil.rmtree(work.path, ignore_errors=True)


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
    shard: bool | None = None,
) -> tuple[LinearizeForCausalLM, ConversionReport]:
    """Linearize `teacher` by `recipe` (default: `default_recipe(teacher)`); export to `output` when given.

    Returns (student, report). Inputs are checked before anything loads; then the teacher loads, the
    layers are chosen, the student is built on the teacher's own weights, trained, measured and exported.
    `shard` (default: whether the launch was `accelerate launch --use_fsdp`) shards the weights over the
    processes while the stages train (FSDP2, `parallel.py`).
    """
    started = time.perf_counter()
    recipe = recipe or default_recipe(teacher)
    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(recipe.seed)
    output = None if output is None else Path(output).expanduser().resolve()
    check_inputs(teacher, recipe, output, overwrite, accelerator.device)
    by_spec = isinstance(teacher, str)
    teacher, tokenizer, spec, resolved = load_teacher(teacher, tokenizer, recipe, accelerator)
    work = open_work_dir(output, work_dir, recipe, spec, overwrite, accelerator)
    own_model = by_spec and _spec(recipe.model) == spec  # a model in memory cannot be told apart: it is measured
    shard = sharding_requested(shard)
    selection = select_layers(teacher, tokenizer, recipe, own_model, work, accelerator, shard)
    types = selection.types
    settings = recipe.linear_attention()
    student = linearize_model(teacher, types, settings, spec)
    if selection.trained is not None:
        with torch.no_grad():
            for name, p in new_parameters(student).items():
                p.copy_(selection.trained[name])

    main = accelerator.is_main_process
    report = ConversionReport(
        model=spec,
        resolved=resolved,
        recipe=recipe.name,
        recipe_yaml=recipe_to_yaml(effective_recipe(recipe, types)),
        attention=settings,
        plan=describe(types),
        layer_types=types,
        layer_errors={str(k): v for k, v in sorted(selection.layer_errors.items())},
        kl_gains={str(k): v for k, v in sorted(selection.kl_gains.items())},
        retrieval_scores={str(k): v for k, v in sorted(selection.retrieval_scores.items())},
        heldout_tokens=recipe.eval.heldout_tokens,
        heldout_seq_len=recipe.eval.heldout_seq_len,
        output=None if output is None else str(output),
    )
    ppl = {} if work is None else dict(work.get("perplexity") or {})
    teacher_rows = None if work is None else work.get("teacher_contexts")
    if measure and main:
        ids, lengths, seq_len = _heldout_tokens(tokenizer, recipe, teacher)
        report.heldout_seq_len = seq_len
        if "teacher" not in ppl or teacher_rows is None:
            teacher_rows = _score_contexts(teacher, ids, lengths)
            ppl["teacher"] = next(r["ppl"] for r in teacher_rows if r["context"] == seq_len)
            ppl["zero_shot"] = _score_contexts(student, ids, [seq_len])[0]["ppl"]
            if work is not None:
                work.put("perplexity", ppl)
                work.put("teacher_contexts", teacher_rows)
    weights = weight_bytes(teacher)
    del teacher  # the student holds the weights now: a sharded stage can then release all but its shard
    results = train_student(student, tokenizer, recipe, accelerator, work, shard)
    for result in results:
        report.stages[result.name] = {
            "tokens": result.tokens,
            "steps": result.steps,
            "seconds": result.seconds,
            "final_loss": result.final_loss,
            "resumed_from": result.resumed_from,
            "weight_bytes_per_process": result.weight_bytes_per_process,
        }
        if result.layer_errors:
            report.stages[result.name]["layer_mse"] = {str(k): v for k, v in result.layer_errors.items()}
    if measure and main:
        student_rows = _score_contexts(student, ids, lengths)
        ppl["student"] = next(r["ppl"] for r in student_rows if r["context"] == seq_len)
        report.contexts = compare_contexts(student_rows, teacher_rows)
        report.heldout_tokens = student_rows[0]["tokens"]
    report.perplexity = ppl
    warning = report.quality_warning()
    if warning:
        logger.warning(warning)
    report.memory = memory_figures(weights, accelerator.device)
    report.seconds = time.perf_counter() - started
    accelerator.wait_for_everyone()
    if output is not None and main:
        write_export(student, tokenizer, output, report, results, work)
    accelerator.wait_for_everyone()
    return student, report
