"""The package's shape, checked: imports point one way (no cycle, lazy imports included), no function outgrows a
screen (60 lines of code; Triton kernel bodies excepted: a kernel is one unit the compiler sees whole), and both
backends export ``ops/backend.py``'s interface."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trl_fused_cpo"
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports, at module level or inside functions (a lazy import still ties two files),
    except under ``if TYPE_CHECKING:``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert "trl_fused_cpo.ops.function" in graph["trl_fused_cpo.loss"]  # the graph is really read
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_op_layers_point_down():
    """Nothing under ops/ imports the public layer (loss, trainer, config), and the kernels import no schedule."""
    graph = _graph()
    upper = {"trl_fused_cpo.loss", "trl_fused_cpo.trainer", "trl_fused_cpo.config", "trl_fused_cpo.distributed"}
    schedules = {f"trl_fused_cpo.ops.{m}" for m in ("function", "schedule", "chunks", "slabs", "backend")}
    for module, imports in graph.items():
        if module.startswith("trl_fused_cpo.ops"):
            assert not imports & upper, f"{module} imports {imports & upper}"
        if module.startswith("trl_fused_cpo.ops.kernels"):
            assert not imports & schedules, f"{module} imports {imports & schedules}"


def _code_lines(node: ast.FunctionDef) -> int:
    """Lines from the ``def`` to the end, less the docstring (documentation is not length)."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_triton_kernel(node):
                lines = _code_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)


def test_both_backends_export_the_interface_with_the_same_signatures():
    """``ops/backend.py`` names the interface once; each backend module exports every name, with the torch spec's
    signature (parameter names, order, defaults), and nothing else public that the schedules could start to use."""
    pytest.importorskip("triton")
    from trl_fused_cpo.ops import kernels, torch_backend
    from trl_fused_cpo.ops.backend import BACKEND_FUNCTIONS

    assert sorted(kernels.__all__) == sorted(BACKEND_FUNCTIONS)
    for name in BACKEND_FUNCTIONS:
        spec = inspect.signature(getattr(torch_backend, name))
        assert inspect.signature(getattr(kernels, name)) == spec, f"kernels.{name} differs from torch_backend.{name}"
    torch_public = {n for n, v in vars(torch_backend).items() if inspect.isfunction(v) and not n.startswith("_")}
    own = {n for n in torch_public if getattr(torch_backend, n).__module__ == torch_backend.__name__}
    assert own == set(BACKEND_FUNCTIONS), f"torch_backend's own public functions {sorted(own ^ set(BACKEND_FUNCTIONS))}"
