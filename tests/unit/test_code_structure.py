"""The product's shape, read from its source (AST), not from running it:
- no import cycle among product modules (function-level and TYPE_CHECKING imports count);
- no module imports another module's underscore-prefixed name (privates stay private);
- no product file over 400 lines and no function over 80, except the ones named below, each
  with its reason and its own cap. A file that has grown past the cap is split where it has
  a seam; where it has none (one table, one protocol, one state machine), it is named here
  rather than cut in two by line count, and its cap stops it growing further unseen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"rlhf_contract": "contract", "rlhf_operator": "operator", "rlhf_trainer": "trainer_image",
            "rlhf_inference": "inference_image", "rlhf_launcher": "launcher"}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
LONG_FILES_ALLOWED: dict[str, tuple[int, str]] = {}
"""Dotted module name -> (its own line cap, why it is one file); none today."""
LONG_FUNCTIONS_ALLOWED: dict[str, tuple[int, str]] = {}
"""`module:function` -> (its own line cap, why it is one function: a table, a route list);
none today."""


def product_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the product packages."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((root / folder / package).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(product modules that `name` imports anywhere in its file, underscore names it
    imports from other modules)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found, private = set(), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
                    if alias.name.startswith("_") and base != name:
                        private.append(f"{name} imports {base}.{alias.name}")
    return found - {name}, private


def import_graph(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    graph, private = {}, []
    for name, path in modules.items():
        graph[name], bad = imports_of(name, path, modules)
        private += bad
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    out.append(sorted(component))
    return out


def test_no_import_cycle_in_the_product():
    graph, _ = import_graph(product_modules())
    assert not cycles(graph), "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles(graph))


def test_no_module_imports_another_modules_private_name():
    _, private = import_graph(product_modules())
    assert not private, "\n".join(private)


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path):
    pkg = tmp_path / "contract" / "rlhf_contract"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import _hidden\n")
    (pkg / "c.py").write_text("from rlhf_contract.a import f\n_hidden = 1\n")
    graph, private = import_graph(product_modules(tmp_path))
    assert cycles(graph) == [["rlhf_contract.a", "rlhf_contract.b", "rlhf_contract.c"]]
    assert private == ["rlhf_contract.b imports rlhf_contract.c._hidden"]


def function_lengths(source: str) -> dict[str, int]:
    return {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize("name,path", sorted(product_modules().items()))
def test_files_and_functions_stay_small(name, path):
    source = path.read_text()
    cap, _ = LONG_FILES_ALLOWED.get(name, (MAX_FILE_LINES, ""))
    assert len(source.splitlines()) <= cap, (
        f"{path.relative_to(ROOT)} has over {cap} lines: split it where it has a seam, or name it in "
        f"LONG_FILES_ALLOWED with the reason it is one file and its own cap")
    long = [f"{name}:{fn} ({n} lines)" for fn, n in function_lengths(source).items()
            if n > LONG_FUNCTIONS_ALLOWED.get(f"{name}:{fn}", (MAX_FUNCTION_LINES, ""))[0]]
    assert not long, f"functions over their cap ({MAX_FUNCTION_LINES} unless named in LONG_FUNCTIONS_ALLOWED): {long}"


def test_every_named_exception_is_still_needed_and_says_why():
    """An exception names a file (or function) that exists, is over the common cap (else the
    entry is stale: delete it) and gives its reason; its own cap is above the common one."""
    modules = product_modules()
    for name, (cap, why) in LONG_FILES_ALLOWED.items():
        assert name in modules and why and cap > MAX_FILE_LINES, name
        assert len(modules[name].read_text().splitlines()) > MAX_FILE_LINES, f"{name} is under the cap again"
    for name, (cap, why) in LONG_FUNCTIONS_ALLOWED.items():
        module, fn = name.split(":")
        lengths = function_lengths(modules[module].read_text()) if module in modules else {}
        assert fn in lengths and why and cap > MAX_FUNCTION_LINES, name
        assert lengths[fn] > MAX_FUNCTION_LINES, f"{name} is under the cap again"
