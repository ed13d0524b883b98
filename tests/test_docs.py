"""Docs that cannot drift: every repository path the docs quote exists, and the README's Layout is the package tree.

A *quoted path* is a word that names a file or folder of this repository:
- in Markdown (``README.md``, ``docs/*.md``, ``docs/results/README.md``) and in the docstrings of the package and
  the scripts, each whitespace-separated word inside backticks (a command's words included), and each relative
  Markdown link or image target;
- in the docstrings, also each bare word that starts with a top-level folder (``tests/ops/test_plan.py``);
- in a recipe's header (its opening comment block), each word.

A word is a path when it starts with a top-level folder of the repository followed by ``/`` (``configs/``,
``scripts/x.py``) or ends in the extension of a tracked file (``.py``, ``.md``, ``.json``, ...), so that
``shared/ANCHORS.md`` counts while ``logits/chosen`` (a metric key) and ``ab/`` (a staging folder) do not. Trailing
punctuation and a pytest node id (``::test_x``) are dropped; a word with a placeholder (``<commit>``, ``...``, ``…``)
is a pattern, not a path; ``{a,b}`` is expanded and ``*`` must match something.

A path exists when a tracked file or folder is it or ends with it (``ops/plan.py`` names
``trl_fused_cpo/ops/plan.py``; ``kernel/`` in ``docs/results/README.md`` names ``docs/results/kernel/``), or when a
link target resolves from the quoting file's folder. A path quoted *at a commit* names a tree of the past and is not
checked: ``file @ 3692b76`` inside the backticks, or ``file`` followed by ``at`` / ``@`` and a commit; a list of
backticked paths joined by commas, ``and`` or a table's ``|`` shares the commit its last member carries
(``a``, ``b``, ``c @ 3692b76``). Files a user or a run creates are listed in ``NOT_REPOSITORY_FILES``, each with why.
"""

from __future__ import annotations

import ast
import fnmatch
import itertools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = out.split()
    except (OSError, subprocess.CalledProcessError):  # a copy without git (the GPU machine): the files on disk
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [f for f in files if (ROOT / f).exists()]  # a file deleted but not yet staged is gone


TRACKED = _tracked()
FOLDERS = {"/".join(f.split("/")[:i]) + "/" for f in TRACKED for i in range(1, f.count("/") + 1)}
TOP_LEVEL = {f.split("/")[0] for f in TRACKED if "/" in f}
EXTENSIONS = {Path(f).suffix for f in TRACKED if Path(f).suffix}
NAMES = [*TRACKED, *FOLDERS]

# Names the docs give to files outside the repository: what a user writes or a run makes, not what the tree holds.
NOT_REPOSITORY_FILES = {
    "train.jsonl": "a data folder's training split, which the user writes (README.md, docs/benchmarks.md)",
    "test.jsonl": "a data folder's evaluation split, which the user writes (README.md, docs/benchmarks.md)",
    "data/train.jsonl": "what scripts/make_random_checkpoint.py writes into its output folder",
    "data/test.jsonl": "what scripts/make_random_checkpoint.py writes into its output folder",
    "my_pairs.jsonl": "README.md's example of the user's own data file",
    "recipe.yaml": "the launcher's help text's example of the user's own recipe (cli.make_parser)",
}

MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs/results/README.md"]
PYTHON = sorted([*(ROOT / "trl_fused_cpo").rglob("*.py"), *(ROOT / "scripts").glob("*.py")])
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))

COMMIT = r"`?[0-9a-f]{7,40}\b"
BACKTICKED = re.compile(r"(?<!`)(``?)(?!`)((?:(?!\n\s*\n)[^`])+?)\1(?!`)")
FENCED = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
AT_COMMIT_INSIDE = re.compile(rf"\s(?:@|at)\s+{COMMIT}")
# What may follow a path before the commit its list shares: more backticked words, joined by ", ", "and" or "|",
# then the commit, outside the backticks or inside the list's last member.
_JOIN = r"\s*(?:,|and|\||\()?\s*"
AT_COMMIT_AFTER = re.compile(
    rf"^(?:{_JOIN}`[^`]+`)*?{_JOIN}(?:(?:@|at)\s+{COMMIT}|`[^`]*\s(?:@|at)\s+[0-9a-f]{{7,40}}`)"
)
PLACEHOLDER = re.compile(r"[<>]|\.\.\.|…")
TRAILING = ".,;:)('\"[]"


def _is_path(word: str) -> bool:
    head = word.split("/", 1)[0]
    return ("/" in word and head in TOP_LEVEL) or Path(word.rstrip("/")).suffix in EXTENSIONS


def _candidate(word: str) -> str | None:
    """The path a word names, or None: trailing punctuation and a pytest node id dropped, a flag's value kept."""
    word = word.split("::", 1)[0].split("=")[-1].strip(TRAILING)
    if not word or PLACEHOLDER.search(word) or word.startswith(("-", "/", "~")) or not _is_path(word):
        return None
    return word


def _expand(path: str) -> list[str]:
    """``configs/{fsdp2,deepspeed_zero3}.yaml`` is two paths."""
    parts = re.split(r"\{([^}]*)\}", path)
    fixed, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    return [
        "".join(itertools.chain(*zip(fixed[:-1], pick, strict=True), [fixed[-1]]))
        for pick in itertools.product(*choices)
    ]


def _exists(path: str, quoted_in: Path) -> bool:
    beside = (quoted_in.parent / path).resolve()
    if beside.is_relative_to(ROOT) and beside.relative_to(ROOT).as_posix() + ("/" if beside.is_dir() else "") in NAMES:
        return True
    patterns = (path, "*/" + path, path + "/", "*/" + path + "/")  # a folder may be quoted without its slash
    return any(fnmatch.fnmatchcase(name, pattern) for name in NAMES for pattern in patterns)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _quoted_spans(text: str):
    """(offset, words) of each fenced code block, each backticked span and each relative link target."""
    for match in FENCED.finditer(text):
        yield match.start(), match.group(0).split()[1:-1]
    text = FENCED.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # offsets kept, fences out of the way
    for match in BACKTICKED.finditer(text):
        inside = match.group(2)
        if AT_COMMIT_INSIDE.search(inside) or AT_COMMIT_AFTER.match(text[match.end() :].replace("\n", " ")):
            continue
        yield match.start(), inside.split()
    for match in LINK.finditer(text):
        target = match.group(1).split("#", 1)[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            yield match.start(), [target]


def _missing(text: str, quoted_in: Path, spans) -> list[str]:
    where = quoted_in.relative_to(ROOT).as_posix()
    missing = []
    for offset, words in spans:
        for word in words:
            path = _candidate(word)
            if path is None or path in NOT_REPOSITORY_FILES:
                continue
            if not all(_exists(p, quoted_in) for p in _expand(path)):
                missing.append(
                    (_line(text, offset), f"{where}:{_line(text, offset)}: `{path}` is not in the repository")
                )
    return [problem for _, problem in sorted(missing)]


def _docstrings(path: Path):
    """(text, first line) of the module, class and function docstrings of a Python file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    yield first.value.value, first.lineno


def _recipe_header(path: Path) -> str:
    return path.read_text().split("\n\n", 1)[0]


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_quoted_in_markdown_exist(doc):
    text = doc.read_text()
    missing = _missing(text, doc, _quoted_spans(text))
    assert not missing, "quoted paths that do not exist (fix the path, or quote it 'at <commit>'):\n" + "\n".join(
        missing
    )


@pytest.mark.parametrize("source", PYTHON, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_quoted_in_docstrings_exist(source):
    missing = []
    for doc, first_line in _docstrings(source):
        spans = list(_quoted_spans(doc))
        bare = [(m.start(), [m.group(0)]) for m in re.finditer(r"(?<![\w`/.])[\w.]+/[\w./{},*-]*", doc)]
        spans += [(offset, words) for offset, words in bare if words[0].split("/", 1)[0] in TOP_LEVEL]
        for problem in _missing(doc, source, spans):
            where, line, rest = problem.split(":", 2)
            missing.append(f"{where}:{first_line + int(line) - 1}:{rest}")
    assert not missing, "quoted paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_in_recipe_headers_exist(recipe):
    header = _recipe_header(recipe)
    spans = [(m.start(), [m.group(0)]) for m in re.finditer(r"\S+", header)]
    missing = _missing(header, recipe, spans)
    assert not missing, "paths in the recipe header that do not exist:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------------------- the README's Layout


def _layout_blocks() -> dict[str, str]:
    """The README's Layout tree: folder → the text written beside it.

    A line whose first word ends in ``/`` and that is indented by at most 8 spaces opens a folder, nested two
    spaces a level (``  ops/`` under ``trl_fused_cpo/``); every other line continues the folder above it.
    """
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    tree = section.split("```", 2)[1]
    blocks: dict[str, str] = {}
    stack: list[str] = []
    for line in tree.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        first, _, rest = line.strip().partition(" ")
        if first.endswith("/") and indent <= 8:
            stack = [*stack[: indent // 2], first]
            folder = "".join(stack)
            blocks[folder] = blocks.get(folder, "") + " " + rest
        elif stack:
            blocks["".join(stack)] += " " + line
    return blocks


PACKAGE_MODULES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "trl_fused_cpo").rglob("*.py"))


def _words(text: str) -> set[str]:
    return set(re.findall(r"[\w.]+\.py\b", text))


def test_readme_layout_names_every_package_module():
    blocks = _layout_blocks()
    unnamed = [
        module
        for module in PACKAGE_MODULES
        if Path(module).name not in _words(blocks.get(Path(module).parent.as_posix() + "/", ""))
    ]
    assert not unnamed, (
        "package modules missing from README.md's Layout (name each in its folder's entry, with what it holds):\n"
        + "\n".join(unnamed)
    )


def test_readme_layout_names_only_modules_that_exist():
    blocks = _layout_blocks()
    named = {
        folder + word for folder, text in blocks.items() if folder.startswith("trl_fused_cpo/") for word in _words(text)
    }
    stale = sorted(named - set(PACKAGE_MODULES))
    assert not stale, "README.md's Layout names modules that are not in the package:\n" + "\n".join(stale)
    assert {"trl_fused_cpo/", "trl_fused_cpo/ops/", "trl_fused_cpo/ops/kernels/"} <= set(blocks)


# -------------------------------------------------------------------------------------------- the test's own rules


def test_the_rules_catch_drift_and_pass_what_they_should(tmp_path):
    doc = ROOT / "docs" / "drift.md"  # never written: the rules read text, and resolve against this folder
    text = "\n".join(
        [
            "Peers as in `shared/ANCHORS.md`.",  # 1: not in the repository
            "`kernels/sequence.py`, `ops/plan.py`, `configs/{fsdp2,deepspeed_zero3}.yaml`, `logits/chosen`.",
            "(`kernel_long/v8_run1.json`, `v7_run3.json`,",  # 3-4: one list, at one commit
            "`v8_run2.json @ 3692b76`); `probe.py` at `8efdfae`.",
            "`bash scripts/gpu_run.sh kernel-ab`, `scripts/gone.py --flag`, `tests/gpu/test_triton_cuda.py::test_x`.",
            "![plot](results/kernel/time_vs_B.png) ![gone](results/nope.png) `git show <commit>:docs/x.md`",
            "`configs/{fsdp2,nope}.yaml`",
        ]
    )
    missing = _missing(text, doc, _quoted_spans(text))
    assert missing == [
        "docs/drift.md:1: `shared/ANCHORS.md` is not in the repository",
        "docs/drift.md:5: `scripts/gone.py` is not in the repository",
        "docs/drift.md:6: `results/nope.png` is not in the repository",
        "docs/drift.md:7: `configs/{fsdp2,nope}.yaml` is not in the repository",
    ]


def test_fused_config_parameters_docstring_names_every_field():
    """TRL's configs document each field in a ``Parameters:`` section: its type, its default, what it does."""
    from dataclasses import MISSING, fields

    from trl.experimental.cpo import CPOConfig

    from trl_fused_cpo.config import FusedCPOConfig

    assert "\n    Parameters:\n" in FusedCPOConfig.__doc__, "FusedCPOConfig's docstring has no 'Parameters:' section"
    doc = FusedCPOConfig.__doc__.split("Parameters:", 1)[1]
    upstream = {f.name for f in fields(CPOConfig)}
    problems = []
    for f in fields(FusedCPOConfig):
        if f.name in upstream:
            continue
        entry = re.search(rf"^\s+{f.name} \(`[^)]*`, \*optional\*, defaults to `([^`]*)`\):$", doc, re.M)
        default = None if f.default is MISSING else f.default
        if entry is None:
            problems.append(f"{f.name}: no '{f.name} (`type`, *optional*, defaults to `...`):' entry")
        elif entry.group(1) != (f'"{default}"' if isinstance(default, str) else repr(default)):
            problems.append(f"{f.name}: documented default `{entry.group(1)}`, field default {default!r}")
    assert not problems, "FusedCPOConfig's Parameters docstring:\n" + "\n".join(problems)
