"""`linearize eval`, `linearize bench`, `linearize ppl` and `linearize recall`: argument parsing and rich rendering.

Each entry point takes argv without the subcommand and returns an exit code: 0 on success, 2 on a
bad input (printed as one line naming the fix). Every argument, the models included, is checked
before any model loads or any benchmark runs.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
from collections.abc import Callable
from typing import Any

from . import CONTROLS
from ..options import DTYPE_HELP, ListOption, Parser, dtype_name, fail, split_list

log = logging.getLogger(__name__)


def _console() -> Any:
    from rich.console import Console

    return Console()


def _bandwidth_note(sampled: list[float] | None) -> str:
    """The read bandwidth a bench sampled between decode rounds, as the CLI's summary line shows it."""
    if sampled is None:
        return "no decode rounds, so no bandwidth samples"
    low, high = sampled
    return f"read bandwidth {low:.1f}-{high:.1f} GB/s between rounds (each point's bound pairs its rounds with them)"


def _run(parser: argparse.ArgumentParser, argv: list[str] | None, body: Callable[[argparse.Namespace], int]) -> int:
    """Parse, run, and turn the library's input errors into `error: ...` + exit code 2."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("lm-eval", "lm_eval", "httpx", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        return body(args)
    except (ValueError, OSError) as err:  # OSError: also a model or hub id that cannot be found
        return fail(parser.prog, str(err))


def _check_models(args: argparse.Namespace, model: str, converted: bool = True) -> str | None:
    """Check --device/--dtype, MODEL and the teacher before any work: returns the teacher spec, or None when skipped.

    `converted`: MODEL is a converted folder, whose config records its teacher.
    """
    from linearize.convert.sources import check_model

    from .models import resolve_device_dtype, student_config, teacher_spec

    resolve_device_dtype(args.device, args.dtype)
    if converted:
        student_config(model)
    check_model(model, args.trust_remote_code)
    if args.skip_teacher or not (converted or args.teacher):
        return None
    teacher = teacher_spec(model, args.teacher) if converted else args.teacher
    check_model(teacher, args.trust_remote_code)
    return teacher


def _git_hash_quietly() -> str | None:
    """lm-eval records the current folder's git commit; outside a checkout git would print `fatal: ...`."""
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL, text=True).strip()
    except (subprocess.CalledProcessError, OSError):
        return None


def _quiet_lm_eval() -> None:
    """Route lm-eval's git lookup through `_git_hash_quietly` (its own lets git's stderr through)."""
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = _git_hash_quietly


def _common(parser: argparse.ArgumentParser) -> None:
    """--device, --dtype, --trust-remote-code and --threads: one spelling and one meaning on every verb."""
    parser.add_argument(
        "--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        type=dtype_name,
        help=f"{DTYPE_HELP} (default auto: bfloat16 on cuda, float32 on cpu)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a teacher or model that is not a linearize export run its own modeling code "
        "(linearize exports always load with it)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def eval_parser() -> argparse.ArgumentParser:
    from .tasks import DEFAULT_TASKS, TASKS

    p = Parser(
        prog="linearize eval",
        description="Benchmark a converted model and its teacher with lm-eval (offline stock tasks); "
        "writes eval.json, eval.md and the README.md table into DIR.",
    )
    p.add_argument("dir", help="converted model folder (the --output of `linearize`)")
    p.add_argument("--teacher", default=None, help="teacher model (default: the one recorded in DIR/config.json)")
    p.add_argument(
        "--tasks",
        action=ListOption,
        default=None,
        help=f"comma-separated, from {', '.join(TASKS)} (default: {','.join(DEFAULT_TASKS)})",
    )
    p.add_argument("--limit", type=int, default=None, help="examples per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--skip-teacher", action="store_true", help="evaluate only the student")
    p.add_argument("--skip-context", action="store_true", help="no perplexity-against-context table")
    _context_args(p)
    _common(p)
    return p


def eval_main(argv: list[str] | None = None) -> int:
    """`linearize eval DIR [--teacher MODEL] [--tasks a,b] [--limit N] [--device D] [--dtype T] [--skip-teacher]`."""

    def body(args: argparse.Namespace) -> int:
        from .perplexity import render_context_table
        from .quality import evaluate, render_table

        from .tasks import resolve_task_names

        if args.limit is not None and args.limit < 1:
            raise ValueError(f"bad --limit {args.limit}: give a positive number of examples")
        tasks = resolve_task_names(None if args.tasks is None else split_list(args.tasks))
        contexts, texts = (None, None) if args.skip_context else _context_settings(args)
        teacher = _check_models(args, args.dir)
        _quiet_lm_eval()
        report = evaluate(
            args.dir,
            teacher=teacher,
            tasks=tasks,
            limit=args.limit,
            batch_size=args.batch_size,
            device=args.device,
            skip_teacher=args.skip_teacher,
            contexts=contexts,
            texts=texts,
            context_tokens=args.context_tokens,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
        )
        console = _console()
        console.print(render_table(report["rows"], report["summary"]))
        for name, rows in (report["context"] or {}).get("contexts", {}).items():
            console.print(render_context_table(rows, f"perplexity against context: {name}"))
        console.print(
            f"wrote {report['paths']['json']}, {report['paths']['md']} and the table in {report['paths']['readme']}"
        )
        return 0

    return _run(eval_parser(), argv, body)


def bench_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="linearize bench",
        description="Prefill time, decode tokens/s, peak memory and cache size of a converted model vs its "
        "teacher; writes bench.json and bench.png into DIR.",
    )
    p.add_argument("dir", help="converted model folder")
    p.add_argument("--teacher", default=None, help="teacher model (default: the one recorded in DIR/config.json)")
    p.add_argument(
        "--contexts",
        action=ListOption,
        default="1024,4096,16384",
        help="context lengths, comma-separated (default 1024,4096,16384)",
    )
    p.add_argument("--batch-sizes", action=ListOption, default="1,8", help="batch sizes, comma-separated (default 1,8)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy decode steps per point (default 32)")
    p.add_argument("--skip-teacher", action="store_true", help="bench only the student")
    p.add_argument(
        "--scoring-lengths",
        action=ListOption,
        default="128,512",
        help="prompt lengths of the batched-prefill (scoring) rows at each batch size, comma-separated; "
        "'none' skips them (default 128,512)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode the student through torch.compile (its compile_decoding), and the teacher too when it is "
        "a linearize export (--teacher OTHER_EXPORT compares two exports alike); any other teacher runs as loaded",
    )
    _common(p)
    return p


def bench_main(argv: list[str] | None = None) -> int:
    """`linearize bench DIR [--teacher MODEL] [--contexts 1024,4096,16384] [--batch-sizes 1,8] [--decode-tokens N]
    [--scoring-lengths 128,512] [--compile]`."""

    def body(args: argparse.Namespace) -> int:
        from .bench import parse_int_list, render_scoring_table, render_table, run_bench

        contexts = parse_int_list(args.contexts, "contexts")
        batch_sizes = parse_int_list(args.batch_sizes, "batch-sizes")
        scoring = [] if args.scoring_lengths == "none" else parse_int_list(args.scoring_lengths, "scoring-lengths")
        if args.decode_tokens < 0:
            raise ValueError(f"bad --decode-tokens {args.decode_tokens}: give 0 or more greedy decode steps")
        teacher = _check_models(args, args.dir)
        report = run_bench(
            args.dir,
            teacher=teacher,
            contexts=contexts,
            batch_sizes=batch_sizes,
            decode_tokens=args.decode_tokens,
            device=args.device,
            skip_teacher=args.skip_teacher,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
            compile_student=args.compile,
            scoring_lengths=scoring,
        )
        console = _console()
        console.print(render_table(report["rows"]))
        if report["scoring"]:
            console.print(render_scoring_table(report["scoring"]))
        console.print(
            f"{report['device']}, {report['dtype']}, student decoding {report['student_decoding']}, "
            + (f"teacher decoding {report['teacher_decoding']}, " if report["teacher_decoding"] else "")
            + f"decode rounds {report['schedule']}, "
            f"{_bandwidth_note(report['read_bandwidth_range_gb_s'])}; "
            f"wrote {report['paths']['json']} and {report['paths']['png']}"
        )
        return 0

    return _run(bench_parser(), argv, body)


def _context_settings(args: argparse.Namespace) -> tuple[list[int], dict[str, str]]:
    """Validated --contexts and --context-tokens, and the named held-out --texts, before any model loads."""
    from linearize.convert.data import eval_text

    from .bench import parse_int_list
    from .perplexity import DEFAULT_CONTEXTS

    contexts = list(DEFAULT_CONTEXTS) if args.contexts is None else parse_int_list(args.contexts, "contexts")
    if args.context_tokens < 2:
        raise ValueError(f"bad --context-tokens {args.context_tokens}: give at least the longest context, e.g. 8192")
    names = split_list(args.texts)
    if not names:
        raise ValueError("--texts is empty: name held-out texts such as pydoc,britannica")
    return contexts, {name: eval_text(name) for name in names}


def _context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--contexts",
        action=ListOption,
        default=None,
        help="context lengths for perplexity against context, comma-separated; lengths past the model's "
        "max_position_embeddings are dropped (default: 512 to 8192, doubling: perplexity.DEFAULT_CONTEXTS)",
    )
    p.add_argument(
        "--texts",
        action=ListOption,
        default="pydoc,britannica",
        help="held-out texts for the context table, comma-separated (default %(default)s)",
    )
    p.add_argument(
        "--context-tokens", type=int, default=16384, help="tokens scored per text and length (default %(default)s)"
    )


def ppl_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="linearize ppl",
        description="Perplexity against context length (512 ... 8K) of a model, and of its teacher when it is a "
        "converted folder or --teacher is given, on held-out text; with --seq-len, one sliding-window "
        "perplexity on text files, a dataset, or the held-out slice.",
    )
    p.add_argument("model", help="model folder, .gguf file, hub id or short name")
    p.add_argument("--teacher", default=None, help="compare with this model (default: the teacher a converted folder records)")
    p.add_argument("--skip-teacher", action="store_true", help="score only MODEL")
    _context_args(p)
    p.add_argument("--plot", default=None, help="PNG of the curves (default: MODEL/context.png for a converted folder)")
    p.add_argument(
        "--control",
        choices=CONTROLS,
        default=None,
        help="also score MODEL with a control: state-off zeroes every linear layer's state, leaving the window and "
        "sinks, and shows what the state carries",
    )
    p.add_argument("--seq-len", type=int, default=None, help="one sliding-window perplexity with this window instead")
    p.add_argument("--stride", type=int, default=256, help="with --seq-len: tokens each window moves on")
    p.add_argument(
        "--text-file",
        action=ListOption,
        default="",
        help="with --seq-len: .txt/.md files, or .jsonl/.parquet with --text-field, comma-separated",
    )
    p.add_argument("--dataset", default=None, help="with --seq-len: dataset name for datasets.load_dataset")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--split", default="test")
    p.add_argument(
        "--text-field", default="text", help="text column of .jsonl/.parquet files and datasets (default: text)"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="with --seq-len: score at most this many tokens")
    p.add_argument("--batch-size", type=int, default=4)
    _common(p)
    return p


def _sliding_ppl(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .models import load, resolve_device_dtype
    from ..convert.measure import perplexity, windows
    from .perplexity import load_text

    windows(2, args.seq_len, args.stride)  # fail on bad --seq-len/--stride before loading anything
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    _check_models(args, args.model, converted=False)
    text = load_text(split_list(args.text_file), args.dataset, args.dataset_config, args.split, args.text_field)
    model, tokenizer, location = load(args.model, device=device, dtype=dtype, trust_remote_code=args.trust_remote_code)
    if tokenizer is None:
        raise FileNotFoundError(f"{location!r} has no tokenizer: save one next to the model")
    res = perplexity(model, tokenizer, text, args.seq_len, args.stride, args.max_tokens, args.batch_size, progress=True)
    table = Table(title=f"perplexity of {args.model}")
    for col in ("ppl", "nll (nats/token)", "tokens", "seq_len / stride"):
        table.add_column(col, justify="right")
    table.add_row(f"{res['ppl']:.3f}", f"{res['nll']:.4f}", str(res["tokens"]), f"{args.seq_len} / {args.stride}")
    _console().print(table)
    return 0


def ppl_main(argv: list[str] | None = None) -> int:
    """`linearize ppl MODEL [--teacher M] [--contexts ...] [--texts ...]`, or `--seq-len N` for one number."""

    def body(args: argparse.Namespace) -> int:
        import json
        from pathlib import Path

        from .models import is_model_dir, resolve_device_dtype, student_config
        from .perplexity import context_report, plot_contexts, render_context_table

        if args.seq_len is not None:
            return _sliding_ppl(args)
        contexts, texts = _context_settings(args)
        device, dtype = resolve_device_dtype(args.device, args.dtype)  # a bad --device fails before any load
        converted = is_model_dir(args.model) and "linearize_teacher" in student_config(args.model)
        if args.control == "state-off":  # refused from the config, before any model loads
            from ..modeling.modes import check_state_off

            settings = student_config(args.model).get("linear_attention") if converted else None
            mixless = settings and (settings.get("feature_map") == "performer" or not settings.get("window"))
            check_state_off(bool(settings), [settings.get("kind", "gla")] if mixless else [])
        teacher = _check_models(args, args.model, converted)
        report = context_report(
            args.model,
            teacher,
            texts,
            contexts,
            args.context_tokens,
            device,
            args.batch_size,
            progress=True,
            dtype=dtype,
            trust_remote_code=args.trust_remote_code,
            controls=[args.control] if args.control else [],
        )
        console = _console()
        for name, rows in report["contexts"].items():
            console.print(render_context_table(rows, f"perplexity against context: {name}"))
        plot = args.plot or (str(Path(args.model) / "context.png") if converted else None)
        if plot:
            plot_contexts(report["contexts"], plot)
            if converted:
                from linearize.convert.card import update_section

                from .perplexity import context_markdown_report

                (Path(args.model) / "context.json").write_text(json.dumps(report, indent=1))
                update_section(args.model, "perplexity", context_markdown_report(report))
            console.print(f"wrote {plot}")
        return 0

    return _run(ppl_parser(), argv, body)


def recall_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="linearize recall",
        description="Long-context recall (passkey, needle-in-a-haystack, variable tracking) of a converted model "
        "and its teacher over a grid of context lengths and needle depths, as lm-eval tasks; writes "
        "recall.json, recall.md, recall.png and the README.md table into DIR.",
    )
    p.add_argument("dir", help="converted model folder (the --output of `linearize`)")
    p.add_argument("--teacher", default=None, help="teacher model (default: the one recorded in DIR/config.json)")
    p.add_argument(
        "--lengths", action=ListOption, default="1024,2048,4096,8192", help="context lengths in tokens (default %(default)s)"
    )
    p.add_argument(
        "--depths",
        action=ListOption,
        default="0,25,50,75,100",
        help="needle depths, percent of the haystack (default %(default)s)",
    )
    p.add_argument("--samples", type=int, default=1, help="documents per task, length and depth (default 1)")
    p.add_argument(
        "--tasks",
        action=ListOption,
        default="passkey,niah_single,niah_multikey,variable_tracking",
        help="comma-separated (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated documents (default 0)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--skip-teacher", action="store_true", help="evaluate only the student")
    _common(p)
    return p


def recall_main(argv: list[str] | None = None) -> int:
    """`linearize recall DIR [--teacher M] [--lengths ...] [--depths ...] [--samples N] [--tasks ...]`."""

    def body(args: argparse.Namespace) -> int:
        from .bench import parse_int_list
        from .recall import parse_depths, parse_tasks, render_table, run_recall

        lengths = parse_int_list(args.lengths, "lengths")
        depths, tasks = parse_depths(args.depths), parse_tasks(args.tasks)
        if args.samples < 1:
            raise ValueError(f"bad --samples {args.samples}: give at least 1 document per cell")
        teacher = _check_models(args, args.dir)
        _quiet_lm_eval()
        report = run_recall(
            args.dir,
            teacher=teacher,
            lengths=lengths,
            depths=depths,
            samples=args.samples,
            tasks=tasks,
            device=args.device,
            batch_size=args.batch_size,
            skip_teacher=args.skip_teacher,
            seed=args.seed,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
        )
        console = _console()
        console.print(render_table(report))
        dropped = report["settings"]["dropped_lengths"]
        if dropped:
            console.print(f"dropped lengths {dropped}: beyond the models' context")
        paths = report["paths"]
        console.print(f"wrote {paths['json']}, {paths['md']}, {paths['png']} and the table in {paths['readme']}")
        return 0

    return _run(recall_parser(), argv, body)
