"""Save a random-init Llama-3-shaped checkpoint, a matching tokenizer and synthetic preference data to a folder.

No hub is reachable on the project's machines, so the real recipes are exercised on a local stand-in with the
real shapes (speed and memory do not depend on the weights' values):

    python scripts/make_random_checkpoint.py --model llama3.2-1b --out /tmp/llama3.2-1b
    accelerate launch --config_file configs/single_gpu.yaml scripts/train_cpo.py \\
        --config recipes/llama3_2/1B_full_cpo_single_device.yaml \\
        --model_name_or_path /tmp/llama3.2-1b --dataset_name /tmp/llama3.2-1b/preferences.jsonl --max_steps 3

Shapes, tokenizer and data are scripts/benchmark_bc.py's, from scripts/bench_common.py (``--model toy`` gives a
CPU-sized one).
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
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = bc.build_model(args.model, device, args.seed)
    model.save_pretrained(out)
    bc.tokenizer_for(args.model).save_pretrained(out)
    rows = bc.rows_for(args.model, args.rows, args.seed)
    (out / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(
        f"wrote {args.model} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params), tokenizer and "
        f"{len(rows)} pairs to {out}"
    )
    return out


if __name__ == "__main__":
    main()
