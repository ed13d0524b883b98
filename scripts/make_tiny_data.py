"""Write trl_fused_cpo/data/tiny_preferences.jsonl: the toy preference pairs the demo and the tests train on.

Each prompt asks for words of one category; the chosen completion lists words of it, the rejected one words of
another. Deterministic (seeded): re-running it reproduces the shipped file byte for byte.

    python scripts/make_tiny_data.py
"""

from __future__ import annotations

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


def main() -> None:
    rng = random.Random(1234)
    rows = [dict(split="train", **p) for p in make_pairs(512, rng)] + [
        dict(split="test", **p) for p in make_pairs(64, rng)
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} pairs to {OUT}")


if __name__ == "__main__":
    main()
