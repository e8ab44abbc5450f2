"""The conversion pipeline: resolve a teacher, select layers, swap, transfer, finetune, export.

    from linearize.convert import convert, load_recipe
    student, report = convert(teacher, tokenizer, recipe=load_recipe("smollm2-gla"), output="out/x")
"""

from .export import export
from .pipeline import ConversionReport, convert
from .recipes import Recipe, load_recipe
from .swap import linearize_model

__all__ = ["ConversionReport", "Recipe", "convert", "export", "linearize_model", "load_recipe"]
