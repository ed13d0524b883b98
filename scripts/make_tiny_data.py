"""Write trl_fused_cpo/data/tiny_preferences.jsonl: the toy preference pairs the demo and the tests train on.

Each prompt asks for words of one category; the chosen completion lists words of it, the rejected one words of
another. Deterministic (seeded): re-running it reproduces the shipped file byte for byte.

    python scripts/make_tiny_data.py                  # rewrites the shipped file
    python scripts/make_tiny_data.py --out /tmp/x.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from trl_fused_cpo.toy import CATEGORIES

OUT = Path(__file__).resolve().parents[1] / "trl_fused_cpo" / "data" / "tiny_preferences.jsonl"
LEADS = ["name some", "please list", "give me a few", "list some", "name a few"]


def make_pairs(n: int, rng: random.Random) -> list[dict[str, str]]:
    cats = list(CATEGORIES)
    pairs = []
    for _ in range(n):
        cat, other = rng.sample(cats, 2)
        k = rng.randint(2, 8)
        pairs.append(
            {
                "prompt": f"{rng.choice(LEADS)} {cat} :",
                "chosen": " " + " ".join(rng.choices(CATEGORIES[cat], k=k)),
                "rejected": " " + " ".join(rng.choices(CATEGORIES[other], k=rng.randint(2, 8))),
            }
        )
    return pairs


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default: the shipped file)")
    args = parser.parse_args(argv)
    rng = random.Random(1234)
    rows = [dict(split="train", **pair) for pair in make_pairs(512, rng)]
    rows += [dict(split="test", **pair) for pair in make_pairs(64, rng)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} pairs to {args.out}")
    return args.out


if __name__ == "__main__":
    main()
