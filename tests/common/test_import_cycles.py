"""No two `agentgym` modules import each other, directly or through others (function-level imports included:
a lazy import that closes a cycle still ties the two modules together; `if TYPE_CHECKING:` blocks do not count)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The folders the `agentgym` namespace is spread over (pyproject's [tool.hatch.build] dev-mode-dirs).
SOURCE_DIRS = ("common", "services/envs", "services/rollout", "services/inference", "trainer", "operators")


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for source in SOURCE_DIRS:
        for path in (ROOT / source / "agentgym").rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(ROOT / source).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            # `from package import name` imports the submodule `package.name` when there is one: that is no
            # use of the package's own `__init__` (a parent package is imported before its modules anyway).
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                names.add(submodule if submodule in modules else base)
    return names


@functools.cache  # parsed once for all the tests here
def _graph() -> dict[str, set[str]]:
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {owner(name) for name in _imported(module, path, modules) if name.startswith("agentgym")}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def test_the_graph_sees_the_packages() -> None:
    graph = _graph()
    assert "agentgym.environments" in graph
    assert "agentgym.environments" in graph["agentgym.spec"]
    assert "agentgym.inference.errors" in graph["agentgym.inference.vllm"]


def test_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []
