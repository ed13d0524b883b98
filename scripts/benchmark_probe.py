"""The construction probe's cost (support.check_model_runs_exactly) at a model's shape, random init: one JSON to --out.

    python scripts/benchmark_probe.py --shape llama3-8b --device cuda --dtype bfloat16 --out probe.json
    python scripts/benchmark_probe.py --shape toy --device cpu --dtype float32 --out probe_cpu.json

Times the probe per layout and attention implementation (the first call, which pays any compile, and the median of
the next ``--repeats``), and how far each check lands from its tolerance on an exact model (the headroom).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fused_cpo import support

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500_000.0),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256),
}  # fmt: skip


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--implementations", default="sdpa,flex_attention")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    return parser


def build(shape: str, device: str, dtype: torch.dtype, implementation: str) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, pad_token_id=0)
    config._attn_implementation = implementation
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: an fp32 8B first would need 32 GB more
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).to(dtype)
    finally:
        torch.set_default_dtype(default)


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows = []
    for implementation in args.implementations.split(","):
        model = build(args.shape, args.device, dtype, implementation)
        for layout in ("padded", "padding_free", "prefix_shared"):
            probe = functools.partial(
                support.check_model_runs_exactly, model, layout, pad_token_id=0, implementation=implementation
            )
            first = timed(probe)
            rest = [timed(probe) for _ in range(args.repeats)]
            rows.append(dict(implementation=implementation, layout=layout, first_s=first,
                             median_s=statistics.median(rest), repeats=args.repeats))  # fmt: skip
            print(
                f"{implementation:15s} {layout:14s} first {first * 1e3:8.1f} ms  median {rows[-1]['median_s'] * 1e3:8.1f} ms"
            )
        del model
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = dict(shape=args.shape, device=device_name, dtype=args.dtype, torch=torch.__version__,
                  probe_pairs=support.PROBE_PAIRS, rows=rows)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
