"""Conversion memory benchmark: peak RSS of a real `linearize` run on a random Llama, against its weight bytes.

    python -m linearize.eval.memory                  # hidden 1024, 16 layers (~218M parameters, 0.87 GB fp32)
    python -m linearize.eval.memory --hidden 576 --layers 30 --low-memory
    python -m linearize.eval.memory --processes 2 --fsdp   # 2 CPU processes (gloo), weights sharded

The teacher is a randomly initialized Llama with the embedded model's tokenizer, written to a temporary
folder; the conversion runs in its own process (as a user runs it), so its peak RSS is the whole job's:
loading, the measuring and training stages, the perplexities and the export. With `--processes`,
the figures are the main process's, and the table adds the weight bytes each process held while
each stage trained.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def random_teacher(folder: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random Llama (MHA, tied embeddings, MLP 2x hidden) saved with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ..convert.sources import materialize, resolve

    tokenizer = AutoTokenizer.from_pretrained(materialize(resolve("embedded:smollm2-135m-instruct")))
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linearize.eval.memory", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048, help="transfer and finetune token budgets")
    p.add_argument("--low-memory", action="store_true", help="pass --low-memory to the conversion")
    p.add_argument("--processes", type=int, default=1, help="run the conversion as this many CPU processes (gloo)")
    p.add_argument("--fsdp", action="store_true", help="pass --fsdp: shard the weights over the processes")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.processes < 1 or (args.fsdp and args.processes < 2):
        p.error("--processes takes 1 or more, and --fsdp needs 2 or more: e.g. --processes 2 --fsdp")
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory(prefix="linearize-memory-") as tmp:
        teacher = random_teacher(Path(tmp) / "teacher", args.hidden, args.layers)
        output = Path(tmp) / "student"
        launch = [sys.executable, "-m", "linearize"]
        if args.processes > 1:
            launch = [
                sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(args.processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "linearize",
            ]  # fmt: skip
        command = [
            *launch, "--model", str(teacher), "--output", str(output),
            "--ratio", "3:1", "--placement", "spread", "--transfer-tokens", str(args.tokens),
            "--finetune-tokens", str(args.tokens), "--max-new-tokens", "0", "--quiet",
            *(["--low-memory"] if args.low_memory else []), *(["--fsdp"] if args.fsdp else []),
        ]  # fmt: skip
        subprocess.run(command, check=True, env={**os.environ, "LINEARIZE_NO_PROGRESS": "1"})
        report = json.loads((output / "report.json").read_text())
    memory = report["memory"]
    held = {name: stage["weight_bytes_per_process"] for name, stage in report["stages"].items()}
    run = f"{args.processes} processes{', FSDP' if args.fsdp else ''}" if args.processes > 1 else "1 process"
    table = Table(title=f"conversion memory: random Llama, hidden {args.hidden}, {args.layers} layers, {run}")
    columns = ["weights", f"peak ({memory['kind']})", "peak / weights", *(f"{name}: weights per process" for name in held), "time"]
    for column in columns:
        table.add_column(column)
    table.add_row(
        f"{memory['weight_bytes'] / 1e9:.2f} GB",
        f"{memory['peak_bytes'] / 1e9:.2f} GB",
        f"{memory['peak_over_weights']:.2f}x",
        *(f"{value / 1e9:.3f} GB" for value in held.values()),
        f"{report['seconds']:.0f} s",
    )
    Console().print(table)
    if args.json:
        figures = {"hidden": args.hidden, "layers": args.layers, "processes": args.processes, "fsdp": args.fsdp}
        seconds = {"seconds": report["seconds"], "stage_seconds": {name: stage["seconds"] for name, stage in report["stages"].items()}}
        Path(args.json).write_text(json.dumps({**figures, **memory, **seconds, "weight_bytes_per_process": held}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
