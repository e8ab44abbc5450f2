"""The conversion pipeline: resolve a teacher, select layers, swap, transfer, finetune, export.

    from linearize.convert import convert, load_recipe
    student, report = convert(teacher, tokenizer, recipe=load_recipe("smollm2-gla"), output="out/x")

The names below load on first use, so that `linearize --help` and the argument checks answer before torch loads.
"""

from importlib import import_module

_HOMES = {
    "export": ".export",
    "ConversionReport": ".pipeline",
    "convert": ".pipeline",
    "Recipe": ".recipes",
    "load_recipe": ".recipes",
    "linearize_model": ".swap",
}

__all__ = ["ConversionReport", "Recipe", "convert", "export", "linearize_model", "load_recipe"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOMES[name], __name__), name)
