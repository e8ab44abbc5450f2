"""The spellings every verb shares: its parser's one-line errors, lists, dtypes.

Imports nothing heavy, so `--help` and argument errors answer before torch loads.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_HELP = "auto, float32, bfloat16 or float16 (bf16, fp16, fp32 also accepted)"
NEGATIVE_VALUE = re.compile(r"^-[\d.]")  # a flag's value, not a flag: -1, -1e-4, -.5, -1,2


class _ListUsage(argparse.HelpFormatter):
    """Shows a list flag as `--flag A,B` in the usage line, not argparse's `--flag A [A ...]`."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, ListOption):
            return self._metavar_formatter(action, default_metavar)(1)[0]
        return super()._format_args(action, default_metavar)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals are one line on stderr (`PROG: error: ...`), exit code 2."""

    def __init__(self, *args, formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter, **kwargs) -> None:
        formatter = type("Formatter", (_ListUsage, formatter_class), {})
        super().__init__(*args, formatter_class=formatter, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """Reads `--flag -1` and `--flag -1e-4,2` as the value -1 and -1e-4,2: argparse alone takes a value
        that starts with '-' and is no plain number for another flag, and says the flag has no argument."""
        args = list(sys.argv[1:] if args is None else args)
        takes_value = {o for a in self._actions if a.option_strings and a.nargs != 0 for o in a.option_strings}
        joined: list[str] = []
        for arg in args:
            if joined and joined[-1] in takes_value and NEGATIVE_VALUE.match(arg):
                joined[-1] = f"{joined[-1]}={arg}"
            else:
                joined.append(arg)
        return super().parse_known_args(joined, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}: see {self.prog} --help\n")


class DtypeError(argparse.ArgumentTypeError, ValueError):
    """An unknown dtype: argparse shows its message as is; library callers catch a ValueError."""


def dtype_name(text: str, what: str | None = None) -> str:
    """A dtype as torch names it (`bf16` -> `bfloat16`): the argparse type of every verb's --dtype, and the recipe's key.

    `what` names the setting in the error; argparse names the flag itself.
    """
    name = DTYPE_ALIASES.get(str(text).strip().lower(), str(text).strip().lower())
    if name not in DTYPES:
        raise DtypeError(f"{what} must be {DTYPE_HELP}, got {text!r}" if what else f"{text!r} is not a dtype: use {DTYPE_HELP}")
    return name


def split_list(text: str) -> list[str]:
    """'a,b', 'a, b' and 'a b' -> ['a', 'b']: commas as lm-eval writes lists, spaces accepted too."""
    return [item for item in re.split(r"[,\s]+", text) if item]


class ListOption(argparse.Action):
    """A list flag in any verb: `a,b`, `'a, b'`, `a, b` and `a b` all store the string 'a,b'."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        kwargs.setdefault("nargs", "+")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, ",".join(split_list(" ".join(values))))


def parse_list(
    text: str, flag: str, cast: Callable[[str], T] = str, example: str = "0,1,2", allow_empty: bool = False
) -> list[T]:
    """A list flag's items, cast; a well-formed list (non-empty unless allowed) or a one-line error naming its form."""
    try:
        values = [cast(item) for item in split_list(text)]
    except ValueError:
        raise ValueError(f"malformed list {text!r} for {flag}: use comma-separated values, e.g. {example}") from None
    if not values and not allow_empty:
        raise ValueError(f"{flag} is empty: give comma-separated values, e.g. {example}")
    return values


def fail(prog: str, message: str) -> int:
    """Print a refusal as its one line and return the exit code for it."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2
