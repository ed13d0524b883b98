"""Save a random-init Llama-3-shaped checkpoint, a matching tokenizer and synthetic preference data to a folder.

No hub is reachable on the project's machines, so the real recipes are exercised on a local stand-in with the
real shapes (speed and memory do not depend on the weights' values):

    python scripts/make_random_checkpoint.py --model llama3.2-1b --out /tmp/llama3.2-1b
    accelerate launch --config_file configs/single_gpu.yaml scripts/train_cpo.py \\
        --config recipes/llama3_2/1B_full_cpo_single_device.yaml \\
        --model_name_or_path /tmp/llama3.2-1b --dataset_name /tmp/llama3.2-1b/preferences.jsonl --max_steps 3

Shapes, tokenizer and data are scripts/benchmark_e2e.py's, from scripts/bench_common.py (``--model toy`` gives a
CPU-sized one). ``--test-rows N`` also writes ``data/train.jsonl`` and ``data/test.jsonl`` (pass the folder as
``--dataset_name``: the recipe's evaluation runs too). ``--layers N`` keeps N decoder layers at the full width (the
70B QLoRA recipe's memory, measured at two depths, extrapolates to 80 layers); ``--worst-case`` writes every prompt
and completion at its maximum length (the batch a recipe's micro-batch must survive).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench_common as bc
import torch


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(bc.MODELS), default="llama3.2-1b")
    p.add_argument("--out", required=True, help="folder to write (model, tokenizer, preferences.jsonl)")
    p.add_argument("--rows", type=int, default=256, help="synthetic preference pairs to write")
    p.add_argument(
        "--test-rows", type=int, default=0, help="also write data/{train,test}.jsonl with this many test rows"
    )
    p.add_argument("--layers", type=int, default=None, help="decoder layers to keep (default: the model's own)")
    p.add_argument("--worst-case", action="store_true", help="every prompt and completion at its maximum length")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = bc.build_model(args.model, device, args.seed, num_layers=args.layers)
    model.save_pretrained(out)
    bc.tokenizer_for(args.model).save_pretrained(out)
    rows = bc.rows_for(args.model, args.rows + args.test_rows, args.seed, worst_case=args.worst_case)
    write_jsonl(out / "preferences.jsonl", rows[: args.rows])
    if args.test_rows:
        write_jsonl(out / "data" / "train.jsonl", rows[: args.rows])
        write_jsonl(out / "data" / "test.jsonl", rows[args.rows :])
    print(
        f"wrote {args.model} ({model.config.num_hidden_layers} layers, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params), tokenizer and {args.rows} pairs"
        + (f" (+ data/ with {args.test_rows} test pairs)" if args.test_rows else "")
        + f" to {out}"
    )
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
