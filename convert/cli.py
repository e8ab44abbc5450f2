"""`linearize` (the convert verb): flags -> recipe -> `convert`, rendered as tables.

    linearize --model llama --ratio 3:1 --attention gla --output out/smollm2
    linearize --recipe llama-3.1-8b-gla --dry-run

Library code only logs; this module renders. The other verbs live in `linearize.eval.cli`;
`linearize.cli` dispatches between them and turns errors into one line and an exit code.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

from .. import __version__
from ..options import DTYPE_HELP, ListOption, Parser, dtype_name, parse_list, split_list
from .plan import PLACEMENTS

EXAMPLES = """examples:
  linearize --model llama --ratio 3:1                       # embedded SmolLM2-135M, GLA, recipe smollm2-gla
  linearize --model smollm2 --attention performer --recipe smollm2-performer --output out/perf
  linearize --model meta-llama/Llama-3.2-1B --recipe llama-3.2-1b-gla --output out/llama1b
  linearize --model ./my-model --linear-layers 0,1,2,4 --transfer-tokens 100000 --finetune-tokens 0
  accelerate launch --multi_gpu --num_processes 2 --num_machines 1 -m linearize --model llama --output out/ddp
  accelerate launch --multi_gpu --num_processes 2 --num_machines 1 -m linearize --model llama --fsdp --output out/fsdp
  linearize eval out/smollm2 --limit 200        linearize bench out/smollm2 --contexts 1024,4096
"""

def _lengths(text: str) -> int | list[int]:
    """'512' -> 512; '512,2048' -> [512, 2048] (a length curriculum)."""
    try:
        values = [int(v) for v in split_list(text)]
    except ValueError:
        values = []
    if not values or any(v < 2 for v in values):
        raise ValueError(f"bad --seq-len {text!r}: give a length such as 512 or lengths such as 512,4096")
    return values[0] if len(values) == 1 else values


def convert_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="linearize",
        description="Convert a softmax-attention LLM into a hybrid linear-attention model, recover its quality "
        "by attention transfer and LoRA, and export a transformers model. Other verbs: "
        "`linearize eval DIR`, `linearize bench DIR`, `linearize ppl MODEL`, `linearize recall DIR`, `linearize frontier DIR... --output OUT` (each has --help).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"linearize {__version__}")
    src = p.add_argument_group("what to convert")
    src.add_argument("--model", help="hub id (org/name), local model folder, .gguf file, or a short name (llama, smollm2)")
    src.add_argument("--recipe", help="shipped recipe name (e.g. smollm2-gla) or a YAML file; flags override its fields")
    src.add_argument("--output", "-o", help="export folder (default: out/<recipe or model>)")
    src.add_argument("--overwrite", action="store_true", help="replace an existing output folder / discard a stale work folder")
    src.add_argument("--work-dir", help="where checkpoints live while running (default: .<output>.work beside the output)")
    plan = p.add_argument_group("layer plan")
    plan.add_argument("--ratio", help="linear:softmax layers, e.g. 3:1, 1:1, 1:0 (all linear)")
    plan.add_argument("--linear-layers", action=ListOption, help="explicit comma-separated layer indices to make linear, e.g. 0,1,2,4")
    plan.add_argument(
        "--placement",
        choices=PLACEMENTS,
        help="where the softmax layers go: spread evenly, top, measured (worst transfer error), kl (largest drop "
        "in KL to the teacher when restored) or retrieval (the teacher's long-range retrieval layers)",
    )
    plan.add_argument(
        "--convert-sliding",
        action="store_true",
        help="let the ratio convert sliding-window layers too (by default it counts the global layers and keeps sliding ones softmax)",
    )
    plan.add_argument("--keep-softmax", action=ListOption, help="comma-separated layers that always keep softmax, e.g. 0,1 ('' for none)")
    plan.add_argument(
        "--scores-from",
        metavar="DIR",
        help="rank the layers by an earlier export's scores for this placement (same teacher and attention settings) "
        "instead of measuring them again: one kl or measured pass serves every ratio",
    )
    att = p.add_argument_group("linear attention")
    att.add_argument("--attention", choices=["gla", "performer", "deltanet"], help="kind of linear attention")
    att.add_argument("--feature-map", choices=["hedgehog", "elu", "identity", "taylor", "performer"])
    att.add_argument("--feature-dim", type=int, help="hedgehog width per half, or Performer random features")
    att.add_argument(
        "--gate", choices=["lowrank", "key", "retnet", "none"], help="decay gate (retnet: fixed multi-scale, no weights)"
    )
    att.add_argument("--conv-size", type=int, help="deltanet: short causal convolution over q/k/v (0 = none)")
    att.add_argument("--window", type=int, help="softmax window (tokens) mixed into each linear layer; 0 disables")
    att.add_argument(
        "--rope-features",
        choices=["on", "off"],
        help="on: feature maps see RoPE'd q/k; off: q/k before RoPE, a position-free state that holds up at length",
    )
    att.add_argument("--sink", type=int, help="first tokens that always stay in the softmax window (attention sinks)")
    att.add_argument(
        "--window-logit", type=float, help="each head's starting mix toward the window (2.0: 0.88 on the window; 0: even)"
    )
    tr = p.add_argument_group("training")
    tr.add_argument("--transfer-tokens", type=int, help="stage 1 (attention transfer) token budget; 0 skips it")
    tr.add_argument("--finetune-tokens", type=int, help="stage 2 (LoRA) token budget; 0 skips it")
    tr.add_argument("--transfer-lr", type=float)
    tr.add_argument("--finetune-lr", type=float)
    tr.add_argument("--finetune-loss", choices=["kl", "ce"], help="KL to the teacher's logits or next-token CE")
    tr.add_argument("--lora-rank", type=int)
    tr.add_argument("--lora-layers", choices=["linear", "all"], help="LoRA on the swapped layers only, or on every layer")
    tr.add_argument("--lora-targets", action=ListOption, help="comma-separated projection names, e.g. q_proj,k_proj,v_proj,o_proj")
    tr.add_argument(
        "--seq-len",
        action=ListOption,
        help="training sequence length (both stages), or a curriculum such as 512,2048,4096 (equal token shares)",
    )
    tr.add_argument("--batch-size", type=int, help="sequences per step per process (both stages)")
    tr.add_argument("--dataset", help="'embedded', 'embedded-long' (adds long public-domain plays), local .txt/.jsonl/.parquet file or folder, or a hub dataset name")
    tr.add_argument("--dataset-config", help="hub dataset config name")
    tr.add_argument("--split", help="hub dataset split to train on (default: train)")
    tr.add_argument("--text-field", help="text column of jsonl/parquet/hub data (default: text)")
    tr.add_argument("--checkpoint-every", type=int, help="optimizer steps between checkpoints")
    tr.add_argument("--dtype", type=dtype_name, help=f"{DTYPE_HELP}; auto: float32 on CPU, bfloat16 on GPU")
    tr.add_argument("--seed", type=int)
    tr.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the weights over the processes while training (FSDP2); under a multi-process launch, "
        "e.g. accelerate launch --multi_gpu --num_processes 2 -m linearize --fsdp (accelerate's --use_fsdp on GPUs turns it on too)",
    )
    out = p.add_argument_group("report")
    out.add_argument("--heldout-tokens", type=int, help="tokens of the held-out slice scored for perplexity")
    out.add_argument(
        "--contexts",
        action=ListOption,
        help="context lengths of the run's perplexity-against-context table, comma-separated (default 512,2048,4096)",
    )
    out.add_argument("--no-measure", action="store_true", help="skip the held-out perplexity before/after")
    out.add_argument("--prompt", default="The Python programming language", help="prompt for the sample generation")
    out.add_argument("--max-new-tokens", type=int, default=40, help="length of the sample generation (0 skips it)")
    out.add_argument("--quiet", action="store_true", help="no progress bars or info logs")
    out.add_argument(
        "--verbose", action="store_true", help="also print the effective recipe as YAML (always written to OUTPUT/recipe.yaml)"
    )
    out.add_argument(
        "--low-memory",
        action="store_true",
        help="CPU: return freed memory to the OS at once: a lower peak RSS, a slower run (docs/scale.md has both measured); "
        "on by itself when ~5x the weights would exceed half the free RAM",
    )
    out.add_argument(
        "--dry-run",
        action="store_true",
        help="print the effective recipe, layer plan, parameter counts and estimated memory and time; load and write nothing",
    )
    return p


def _csv(text: str | None, flag: str, cast=str, example: str = "0,1,2") -> list | None:
    """A list flag, or None when not given; an empty list is left for the recipe to judge."""
    return None if text is None else parse_list(text, flag, cast, example, allow_empty=True)


def recipe_from_args(args: argparse.Namespace):
    """The recipe the flags describe: --recipe or the model's default recipe, with flags on top."""
    from ..modeling.configuration_linearize import POSITIVE_FEATURE_MAPS
    from .pipeline import apply_overrides, default_recipe, scores_from
    from .recipes import load_recipe

    if args.recipe is None and args.model is None:
        raise ValueError("nothing to convert: pass --model (e.g. --model llama) or --recipe")
    recipe = load_recipe(args.recipe) if args.recipe else default_recipe(args.model)
    # A recipe's measured plan belongs to its ratio, placement and scores: asking for others re-plans.
    replan = (
        bool(args.scores_from)
        or args.ratio not in (None, recipe.layers.ratio)
        or args.placement not in (None, recipe.layers.placement)
        or args.model not in (None, recipe.model, recipe.name, *recipe.aliases)
    )
    overrides = {
        "model": args.model,
        "dtype": args.dtype,
        "seed": args.seed,
        "layers.ratio": args.ratio,
        "layers.placement": args.placement,
        "layers.linear_layers": _csv(args.linear_layers, "--linear-layers", int),
        "layers.measured": [] if replan and recipe.layers.measured else None,
        "layers.keep_softmax": _csv(args.keep_softmax, "--keep-softmax", int),
        "layers.sliding": "convert" if args.convert_sliding else None,
        "attention.kind": args.attention,
        "attention.feature_map": args.feature_map,
        "attention.feature_dim": args.feature_dim,
        "attention.gate": args.gate,
        "attention.conv_size": args.conv_size,
        "attention.window": args.window,
        "attention.sink": args.sink,
        "attention.window_logit": args.window_logit,
        "attention.rope_features": None if args.rope_features is None else args.rope_features == "on",
        "transfer.tokens": args.transfer_tokens,
        "transfer.lr": args.transfer_lr,
        "finetune.tokens": args.finetune_tokens,
        "finetune.lr": args.finetune_lr,
        "finetune.loss": args.finetune_loss,
        "finetune.lora_rank": args.lora_rank,
        "finetune.lora_targets": _csv(args.lora_targets, "--lora-targets", example="q_proj,v_proj"),
        "finetune.lora_layers": args.lora_layers,
        "eval.heldout_tokens": args.heldout_tokens,
        "eval.contexts": _csv(args.contexts, "--contexts", int, example="512,2048,4096"),
    }
    # Switching kind away from the recipe's: the new kind's own defaults, unless given. The delta rule
    # keeps GLA's normalized state where its features are positive (see `LinearAttention._delta`): with
    # Hedgehog, its best measured form (docs/results.md, "Attention kinds"), the default.
    defaults = {"performer": ("performer", "none"), "gla": ("hedgehog", "lowrank"), "deltanet": ("hedgehog", "lowrank")}
    if args.attention and recipe.attention.kind != args.attention:
        feature_map, gate = defaults[args.attention]
        feature_map = args.feature_map or feature_map
        overrides["attention.feature_map"] = feature_map
        overrides["attention.gate"] = args.gate or gate
        overrides["attention.normalize"] = args.attention != "deltanet" or feature_map in POSITIVE_FEATURE_MAPS
    for stage in ("transfer", "finetune"):
        for flag, key in (
            ("seq_len", "seq_len"),
            ("batch_size", "batch_size"),
            ("dataset", "dataset"),
            ("dataset_config", "dataset_config"),
            ("split", "split"),
            ("text_field", "text_field"),
            ("checkpoint_every", "checkpoint_every"),
        ):
            value = getattr(args, flag)
            overrides[f"{stage}.{key}"] = _lengths(value) if flag == "seq_len" and value is not None else value
    recipe = apply_overrides(recipe, overrides)
    if args.scores_from:
        recipe = apply_overrides(recipe, {"layers.scores": scores_from(args.scores_from, recipe)})
    return recipe


def default_output(recipe) -> str:
    """out/<shipped recipe's name>, or out/<model's name>-<kind> for the generic and flag-built recipes."""
    if recipe.name in ("custom", "generic"):
        model = recipe.model.removeprefix("embedded:").rstrip("/")
        name = f"{os.path.basename(model).removesuffix('.gguf')}-{recipe.attention.kind}"
    else:
        name = recipe.name
    return os.path.join("out", re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-"))


def _render_report(report, console) -> None:
    from rich.table import Table

    table = Table(title="linearize: before / after", show_lines=False)
    table.add_column("metric")
    table.add_column("value")
    for metric, value in report.rows():
        table.add_row(metric, value)
    console.print(table)


def _sample(output: str, prompt: str, max_new_tokens: int) -> str:
    """Reload the export exactly as a user would and generate from it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(output, trust_remote_code=True)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(ids[0], skip_special_tokens=True)


def _render_dry_run(estimate: dict, console) -> None:
    from rich.table import Table

    table = Table(title="linearize --dry-run: nothing loaded, nothing written")
    table.add_column("item")
    table.add_column("value")
    for item, value in estimate["rows"]:
        table.add_row(item, value)
    console.print(table)


def convert_main(argv: list[str]) -> int:
    args = convert_parser().parse_args(argv)
    from rich.console import Console

    console = Console(stderr=False)
    if args.quiet:
        os.environ["LINEARIZE_NO_PROGRESS"] = "1"
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    logging.getLogger("linearize").setLevel(logging.WARNING if args.quiet else logging.INFO)
    import torch
    import transformers
    from accelerate import Accelerator

    from .pipeline import check_inputs, convert
    from .recipes import recipe_to_yaml
    from .sources import resolve

    if args.quiet:
        transformers.utils.logging.disable_progress_bar()
    torch.set_flush_denormal(True)
    recipe = recipe_from_args(args)
    source = resolve(recipe.model)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    main = accelerator.is_main_process
    if args.fsdp and accelerator.num_processes == 1:
        raise ValueError(
            "--fsdp shards the weights over several processes, and this is one: "
            "launch it with accelerate launch --multi_gpu --num_processes N -m linearize ..."
        )
    output = args.output or default_output(recipe)
    # Every check runs before anything is printed or loaded: a refusal is the run's only line.
    checked_output = None if args.dry_run else Path(output).expanduser().resolve()
    check_inputs(recipe.model, recipe, checked_output, args.overwrite, accelerator.device)
    if main:
        asked = args.model or recipe.model
        console.print(f"[bold]model[/bold] {asked} resolves to {source.spec} ({source.kind}: {source.location})")
        if args.verbose or args.dry_run:
            console.print(f"[bold]recipe[/bold] {recipe.name}: {recipe.description or 'from flags'} (effective, as YAML):")
            console.print(recipe_to_yaml(recipe), markup=False, highlight=False, soft_wrap=True)  # uncropped
        else:
            console.print(f"[bold]recipe[/bold] {recipe.name} (--verbose prints it; the export keeps it as recipe.yaml)")
    if args.dry_run:
        from .dry_run import dry_run

        if main:
            _render_dry_run(dry_run(recipe, accelerator.device, low_memory=args.low_memory or None), console)
        return 0
    if not torch.cuda.is_available():
        from .budget import needs_low_memory, parameter_count, return_freed_memory
        from .sources import load_config

        weights = parameter_count(load_config(recipe.model)) * recipe.torch_dtype(accelerator.device).itemsize
        if args.low_memory or needs_low_memory(weights):
            logging.getLogger("linearize").info("low memory: freed memory goes back to the OS at once (slower)")
            return_freed_memory()
    _, report = convert(
        recipe.model,
        recipe=recipe,
        output=output,
        overwrite=args.overwrite,
        work_dir=args.work_dir,
        accelerator=accelerator,
        measure=not args.no_measure,
        shard=args.fsdp or None,
    )
    if main:
        _render_report(report, console)
        console.print(f"[bold]exported[/bold] {report.output} (report.json, recipe.yaml, loss.png, model card inside)")
        if args.max_new_tokens > 0:
            console.print("[bold]sample[/bold] (reloaded with trust_remote_code):")
            console.print(_sample(report.output, args.prompt, args.max_new_tokens))
    return 0
