"""The layout of DESIGN.md, checked on the sources: our modules import each other
without cycles, and each top-level package imports only the packages the layout allows.

Imports are read with `ast`, function-level ones included: an import moved into a
function still makes one module need the other, so it cannot hide a cycle here.
Imports under `if TYPE_CHECKING:` never run, so they cannot close an import cycle;
the layout rules still apply to them.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "tools", "index", "server", "clients", "training", "kernels")

# Cycles among our modules that are known and kept, each with the reason it is kept
# (a frozenset of the modules of one strongly connected component -> why). Empty: the
# modules form a DAG.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}

# package -> the packages it may import (DESIGN.md, "Layout"). `tools` reaches the
# index only through its `Index` protocol, so it imports no `index` module at all.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "tools": frozenset(),
    "index": frozenset(),
    "agent": frozenset({"tools", "index"}),
    "server": frozenset({"agent", "tools", "index", "training", "clients"}),
    "clients": frozenset({"server"}),
    "training": frozenset({"agent", "tools", "index", "kernels"}),
    "kernels": frozenset(),
}
# Edges the table allows only lazily (inside a function), so the front door stays fast.
LAZY_ONLY = {("server", "training"), ("server", "clients")}
# The one module of another package the TUI may import: the LSP contract's token file
# (how a client on this machine finds a TCP server's token); it imports only stdlib.
CLIENT_CONTRACT = frozenset({"opencomposer.server.lsp_auth"})
KERNELS_THIRD_PARTY = frozenset({"torch", "triton"})


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # one of our modules, or a top-level third-party name
    line: int
    lazy: bool  # inside a function
    type_only: bool  # under `if TYPE_CHECKING:`


def modules() -> dict[str, Path]:
    """Every module of the package, by its import name."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "node_modules" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out["opencomposer." + ".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    node: ast.AST, lazy: bool = False, type_only: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy, type_only
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, True, type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), lazy, type_only)
        else:
            yield from _walk(child, lazy, type_only)


def imports(mods: dict[str, Path]) -> list[Import]:
    """What every module imports: our modules by name (the longest that exists),
    anything else by its top-level name."""

    def ours(name: str) -> str | None:
        while name:
            if name in mods:
                return name
            name = name.rpartition(".")[0]
        return None

    out: list[Import] = []
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, lazy, type_only in _walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                # `from pkg import mod` imports the module; `from mod import name` the module
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for name in names:
                target = ours(name) if name.startswith("opencomposer.") else name.split(".")[0]
                if target and target != module:
                    out.append(Import(module, target, node.lineno, lazy, type_only))
    return out


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _package(module: str) -> str:
    return module.split(".")[1]


def test_cycles_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by an import inside a function is found."""
    (tmp_path / "a.py").write_text("import opencomposer.agent.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from opencomposer.agent import a\n")
    mods = {"opencomposer.agent.a": tmp_path / "a.py", "opencomposer.agent.b": tmp_path / "b.py"}
    edges: dict[str, set[str]] = {}
    for imp in imports(mods):
        edges.setdefault(imp.source, set()).add(imp.target)
    assert cycles(edges) == [frozenset(mods)]


def test_our_modules_form_a_dag() -> None:
    """Guards against import cycles among our modules (training/tasks ⇄ mining ⇄ starter,
    rl ⇄ sft ⇄ demos and kernels/mx ⇄ moe were such), including the ones dodged by
    moving an import into a function."""
    edges: dict[str, set[str]] = {}
    for imp in imports(modules()):
        if imp.target.startswith("opencomposer.") and not imp.type_only:
            edges.setdefault(imp.source, set()).add(imp.target)
    found = {c for c in cycles(edges) if c not in ALLOWED_CYCLES}
    assert not found, "import cycles: " + "; ".join(
        " ⇄ ".join(sorted(m.removeprefix("opencomposer.") for m in c)) for c in found
    )
    stale = set(ALLOWED_CYCLES) - set(cycles(edges))
    assert not stale, f"ALLOWED_CYCLES lists cycles that are gone: {stale}"


def test_packages_import_only_what_the_layout_allows() -> None:
    """Guards DESIGN.md's layout table: `tools` and `index` import nothing of ours, the
    TUI nothing but the LSP contract, `kernels` only torch; the server reaches training
    and the TUI only lazily."""
    bad = []
    for imp in imports(modules()):
        src = _package(imp.source)
        where = f"{imp.source}:{imp.line} imports {imp.target}"
        if not imp.target.startswith("opencomposer."):
            stdlib = imp.target in sys.stdlib_module_names or imp.target == "__future__"
            if src == "kernels" and not stdlib and imp.target not in KERNELS_THIRD_PARTY:
                bad.append(where + " (kernels import torch only)")
            continue
        dst = _package(imp.target)
        if dst == src:
            continue
        if dst not in MAY_IMPORT[src]:
            bad.append(
                where + f" ({src} may import {sorted(MAY_IMPORT[src]) or 'nothing of ours'})"
            )
        elif src == "clients" and imp.target not in CLIENT_CONTRACT:
            bad.append(where + " (the TUI imports only the LSP contract)")
        elif (src, dst) in LAZY_ONLY and not imp.lazy:
            bad.append(where + " (only inside a function)")
    assert not bad, "\n".join(bad)
