"""Evaluation: perplexity against context, recall, lm-eval scores and benchmarks of a converted model."""

CONTROLS = ("state-off",)  # `linearize ppl --control`: here so the CLI's parser needs no torch
