"""The package's imports form no cycle and follow the layer order: module-level ones and lazy
ones inside functions alike (imports under `if TYPE_CHECKING:` are for annotations only and do not
count). The order is the import-linter contract in pyproject.toml (`lint-imports` in .ci/run)
and the block at the top of docs/architecture.md; these tests keep the three in step. No module
imports another module's private (`_x`) names."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: Path, modules: set[str]) -> set[str]:
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import submodule` needs the submodule; `from module import name`
            # needs the module.
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.append(submodule if submodule in modules else node.module)
        found.update(name for name in names if name in modules)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, modules) - {name} for name, path in paths.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = _graph()
    assert "gigatron.families" in graph and "gigatron.optim.build" in graph
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


def test_the_checker_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _contract_layers() -> list[list[str]]:
    """The layers of pyproject.toml's contract, top first, each a list of sibling names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers" and c["containers"] == ["gigatron"]]
    return [[name.strip() for name in layer.split("|")] for layer in layers["layers"]]


def _top_level_names() -> set[str]:
    """Every module and package directly under gigatron/."""
    package = SRC / "gigatron"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    return modules | {p.parent.name for p in package.glob("*/__init__.py")}


def test_the_contract_names_every_top_level_module_once():
    named = [name for layer in _contract_layers() for name in layer]
    assert len(named) == len(set(named)), named
    assert set(named) == _top_level_names()


def test_no_module_imports_a_higher_layer():
    rank = {name: i for i, layer in enumerate(_contract_layers()) for name in layer}
    broken = []
    for module, targets in _graph().items():
        mine = module.split(".")[1] if "." in module else None
        for target in targets:
            theirs = target.split(".")[1] if "." in target else None
            if mine and theirs and mine != theirs and rank[theirs] < rank[mine]:
                broken.append(f"{module} -> {target}")
    assert not broken, broken


def test_the_architecture_page_states_the_contract_order():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"## Layer order\n.*?```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md: no `## Layer order` block"
    stated = [
        [name.strip() for name in line.split("(")[0].replace(",", "|").split("|")]
        for line in block.group(1).splitlines()
        if line.strip()
    ]
    assert stated == _contract_layers()


def test_the_architecture_layout_names_every_file_and_folder():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"## Layout\n.*?```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md: no `## Layout` block"
    named = set(re.findall(r"[\w.]+\.py|\w+/", block.group(1)))
    package = SRC / "gigatron"
    files = {p.name for p in package.rglob("*.py") if p.name != "__init__.py"}
    folders = {f"{p.parent.name}/" for p in package.rglob("*/__init__.py")}
    missing = sorted((files | folders) - named)
    assert not missing, f"docs/architecture.md's Layout does not name {missing}"


def test_no_module_imports_another_modules_private_names():
    reaches = []
    for path in (SRC / "gigatron").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gigatron"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                private = [name for name in private if not name.startswith("__")]
                reaches += [f"{path.relative_to(SRC)}: {node.module}.{n}" for n in private]
    assert not reaches, reaches
