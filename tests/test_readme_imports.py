"""The README's Python snippets import without TRL's ``TRLExperimentalWarning``.

``trl.experimental`` warns when it is first imported unless ``TRL_EXPERIMENTAL_SILENCE`` is set; ``import
trl_fused_cpo`` sets it, so the snippets import the package first. Each snippet's imports run in a fresh interpreter
(the warning fires once per process) without the variable set.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _snippet_imports() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    imports = ["\n".join(line for line in b.splitlines() if line.startswith(("import ", "from "))) for b in blocks]
    return [i for i in imports if "trl" in i]


def test_the_readme_has_snippets_that_import_trl():
    assert any("trl.experimental" in snippet for snippet in _snippet_imports())


@pytest.mark.slow  # one fresh interpreter a snippet: 5-10 s of imports each on 2 shared cores
@pytest.mark.parametrize("snippet", _snippet_imports())
def test_readme_snippet_imports_do_not_warn(snippet, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRL_EXPERIMENTAL_SILENCE"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="default")
    proc = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRLExperimentalWarning" not in proc.stderr, proc.stderr[-3000:]
