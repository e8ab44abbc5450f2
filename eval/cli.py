"""`linearize eval`, `linearize bench` and `linearize ppl`: argument parsing and rich rendering.

Each entry point takes argv without the subcommand and returns an exit code: 0 on success, 2 on a
bad input (printed as one line naming the fix).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def _console() -> Any:
    from rich.console import Console

    return Console()


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
    except (ValueError, FileNotFoundError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def eval_parser() -> argparse.ArgumentParser:
    from .tasks import DEFAULT_TASKS, TASKS

    p = argparse.ArgumentParser(
        prog="linearize eval",
        description="Benchmark a converted model and its teacher with lm-eval (offline stock tasks); "
        "writes eval.json, eval.md and the README.md table into DIR.",
    )
    p.add_argument("dir", help="converted model folder (the --output of `linearize`)")
    p.add_argument("--teacher", default=None, help="teacher model (default: the one recorded in DIR/config.json)")
    p.add_argument(
        "--tasks", nargs="+", default=None, help=f"from {', '.join(TASKS)} (default: {' '.join(DEFAULT_TASKS)})"
    )
    p.add_argument("--limit", type=int, default=None, help="examples per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--skip-teacher", action="store_true", help="evaluate only the student")
    _common(p)
    return p


def eval_main(argv: list[str] | None = None) -> int:
    """`linearize eval DIR [--teacher MODEL] [--tasks ...] [--limit N] [--batch-size N] [--device] [--skip-teacher]`."""

    def body(args: argparse.Namespace) -> int:
        from .quality import evaluate, render_table

        if args.limit is not None and args.limit < 1:
            raise ValueError(f"bad --limit {args.limit}: give a positive number of examples")
        report = evaluate(
            args.dir,
            teacher=args.teacher,
            tasks=args.tasks,
            limit=args.limit,
            batch_size=args.batch_size,
            device=args.device,
            skip_teacher=args.skip_teacher,
        )
        console = _console()
        console.print(render_table(report["rows"], report["summary"]))
        console.print(
            f"wrote {report['paths']['json']}, {report['paths']['md']} and the table in {report['paths']['readme']}"
        )
        return 0

    return _run(eval_parser(), argv, body)


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="linearize bench",
        description="Prefill time, decode tokens/s, peak memory and cache size of a converted model vs its "
        "teacher; writes bench.json and bench.png into DIR.",
    )
    p.add_argument("dir", help="converted model folder")
    p.add_argument("--teacher", default=None, help="teacher model (default: the one recorded in DIR/config.json)")
    p.add_argument(
        "--contexts", default="1024,4096,16384", help="context lengths, comma-separated (default 1024,4096,16384)"
    )
    p.add_argument("--batch-sizes", default="1,8", help="batch sizes, comma-separated (default 1,8)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy decode steps per point (default 32)")
    p.add_argument("--skip-teacher", action="store_true", help="bench only the student")
    _common(p)
    return p


def bench_main(argv: list[str] | None = None) -> int:
    """`linearize bench DIR [--teacher MODEL] [--contexts 1024,4096,16384] [--batch-sizes 1,8] [--decode-tokens N]`."""

    def body(args: argparse.Namespace) -> int:
        from .bench import parse_int_list, render_table, run_bench

        contexts = parse_int_list(args.contexts, "contexts")
        batch_sizes = parse_int_list(args.batch_sizes, "batch-sizes")
        report = run_bench(
            args.dir,
            teacher=args.teacher,
            contexts=contexts,
            batch_sizes=batch_sizes,
            decode_tokens=args.decode_tokens,
            device=args.device,
            skip_teacher=args.skip_teacher,
        )
        console = _console()
        console.print(render_table(report["rows"]))
        console.print(f"{report['device']}; wrote {report['paths']['json']} and {report['paths']['png']}")
        return 0

    return _run(bench_parser(), argv, body)


def ppl_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="linearize ppl",
        description="Sliding-window perplexity of a model on text files, a dataset, or (default) the "
        "fixed held-out slice of the embedded corpus.",
    )
    p.add_argument("model", help="model folder, .gguf file, hub id or short name")
    p.add_argument("--text-file", nargs="+", default=[], help=".txt/.md files, or .jsonl/.parquet with --column")
    p.add_argument("--dataset", default=None, help="dataset name for datasets.load_dataset (hub id or local folder)")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--split", default="test")
    p.add_argument("--column", default="text", help="text column of .jsonl/.parquet files and datasets")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    p.add_argument("--batch-size", type=int, default=4)
    _common(p)
    return p


def ppl_main(argv: list[str] | None = None) -> int:
    """`linearize ppl MODEL [--text-file ...] [--dataset ...]`: prints perplexity, NLL and token count."""

    def body(args: argparse.Namespace) -> int:
        from rich.table import Table

        from .models import check_device, load
        from .perplexity import load_text, perplexity, windows

        windows(2, args.seq_len, args.stride)  # fail on bad --seq-len/--stride before loading anything
        check_device(args.device)
        text = load_text(args.text_file, args.dataset, args.dataset_config, args.split, args.column)
        model, tokenizer, location = load(args.model, device=args.device)
        if tokenizer is None:
            raise FileNotFoundError(f"{location!r} has no tokenizer: save one next to the model")
        res = perplexity(
            model, tokenizer, text, args.seq_len, args.stride, args.max_tokens, args.batch_size, progress=True
        )
        table = Table(title=f"perplexity of {args.model}")
        for col in ("ppl", "nll (nats/token)", "tokens", "seq_len / stride"):
            table.add_column(col, justify="right")
        table.add_row(f"{res['ppl']:.3f}", f"{res['nll']:.4f}", str(res["tokens"]), f"{args.seq_len} / {args.stride}")
        _console().print(table)
        return 0

    return _run(ppl_parser(), argv, body)
