"""Fail when installing the package changed a release that was in the environment before it.

Usage: check_no_downgrade.py BEFORE AFTER NAME...   (BEFORE, AFTER: `pip freeze` outputs)

The latest lane installs the newest torch, triton, transformers, ... by themselves, freezes, installs the package,
freezes again: each NAME must be installed in both and at the same version (pip would otherwise have downgraded or
replaced it to satisfy the package's bounds). Standard library only.
"""

from __future__ import annotations

import re
import sys


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(path: str) -> dict[str, str]:
    versions = {}
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if "==" in line and not line.startswith(("#", "-e")):
            name, version = line.split("==", 1)
            versions[canonical(name)] = version
    return versions


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = read_freeze(argv[0]), read_freeze(argv[1])
    bad = []
    for name in map(canonical, argv[2:]):
        old, new = before.get(name), after.get(name)
        if old is None:
            bad.append(f"{name}: not installed before the package (the lane installs it first)")
        elif old != new:
            bad.append(f"{name}: {old} before the package's install, {new or 'removed'} after")
        else:
            print(f"kept {name}=={old}")
    for line in bad:
        print(f"CI: installing the package changed {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
