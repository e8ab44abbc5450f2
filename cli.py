"""The `linearize` command: the convert verb by default, or `eval`, `bench`, `ppl`, `recall`, `frontier`.

Errors a user can fix become one line on stderr and exit code 2; Ctrl-C during a stage exits 130
with the progress saved. Nothing heavy is imported before the arguments are parsed, so `--help`,
`--version` and argument errors answer at once.
"""

from __future__ import annotations

import sys

from .options import fail

SUBCOMMANDS = ("eval", "bench", "ppl", "recall", "frontier")


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:
        from .eval import cli as eval_cli

        verb, rest = argv[0], argv[1:]
        if verb == "bench" and "--kernels" in rest:
            from .eval.kernel_bench import kernel_bench_main

            return kernel_bench_main([a for a in rest if a != "--kernels"])
        if verb == "frontier":
            from .eval.frontier import frontier_main

            return frontier_main(rest)
        verbs = {
            "eval": eval_cli.eval_main,
            "bench": eval_cli.bench_main,
            "ppl": eval_cli.ppl_main,
            "recall": eval_cli.recall_main,
        }
        return verbs[verb](rest)
    from .convert.cli import convert_main

    return convert_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _dispatch(argv)
    except RuntimeError as err:
        train = sys.modules.get("linearize.convert.train")  # these errors only exist once training has started
        if train is None or not isinstance(err, (train.StageInterrupted, train.NonFiniteLoss)):
            raise
        if isinstance(err, train.StageInterrupted):
            print(f"linearize: {err}", file=sys.stderr)
            return 130
        return fail("linearize", str(err))
    except (ValueError, OSError) as err:  # OSError: also a hub id that cannot be fetched
        return fail("linearize", str(err))


if __name__ == "__main__":
    raise SystemExit(main())
