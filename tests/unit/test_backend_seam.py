"""One seam per choice (issue 51): every value of `spec.backend` is named, and `spec.backend`
read, only in the operator's backends/ (one module per backend; backends/__init__.py picks).
Read from the source's AST: a string constant that IS a backend's kind, plural, API group or
trigger name, and any read of a `backend` field, outside backends/ fails."""

from __future__ import annotations

import ast
from pathlib import Path

from rlhf_contract.backends import BACKENDS as NEEDS

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "rlhf_operator"
SEAM = OPERATOR / "backends"
PICKER = SEAM / "__init__.py"


def backend_strings() -> set[str]:
    """What names a backend: its kind, its kind in lower case (a trigger, a field), its
    resource's plural and its API group (every backend's, from the contract)."""
    return {s for n in NEEDS.values() for s in (n.backend, n.backend.lower(), n.plural, n.group)}


def kind_strings_in(path: Path, names: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def _named(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def backend_reads_in(path: Path) -> list[str]:
    """`x.backend` and `x.get("backend")` / `x["backend"]`: reads of a `backend` field (but
    `<...needs>.backend`, the kind's name in a contract entry, `rlhf_contract.backends.BackendNeeds`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr == "backend" and isinstance(node.ctx, ast.Load)
                and not _named(node.value).lower().endswith("needs")):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: .backend")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "backend"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: .get('backend')")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "backend":
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: ['backend']")
    return out


def test_backend_kinds_are_named_only_in_backends():
    outside = [p for p in sorted(OPERATOR.rglob("*.py")) if SEAM not in p.parents]
    found = [hit for p in outside for hit in kind_strings_in(p, backend_strings())]
    assert not found, "backend kinds named outside operator/rlhf_operator/backends/:\n" + "\n".join(found)


def test_spec_backend_is_read_in_the_picker_only():
    """The picker reads `spec.backend`; a backend module reads only its contract entry's
    `.backend` (its kind's name), never a job's."""
    found = [hit for p in sorted(OPERATOR.rglob("*.py")) if p != PICKER for hit in backend_reads_in(p)]
    assert not found, "spec.backend read outside backends/__init__.py:\n" + "\n".join(found)


def test_the_checks_see_a_kind_and_a_read(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('KIND = "JobSet"\nX = "a JobSet in prose"\ndef f(job, body, needs):\n'
                      '    return job.spec.backend, body["spec"].get("backend"), needs.backend\n')
    rel = Path(module).relative_to(tmp_path)
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert kind_strings_in(module, backend_strings()) == [f"{rel}:1: 'JobSet'"]
        assert backend_reads_in(module) == [f"{rel}:4: .backend", f"{rel}:4: .get('backend')"]
    finally:
        ROOT = root


def test_every_backend_of_the_contract_has_its_module():
    from rlhf_operator.backends import BACKENDS, CHILD_KINDS

    assert set(BACKENDS) == set(NEEDS)
    for name, backend in BACKENDS.items():
        assert (SEAM / f"{name.lower()}.py").is_file(), name
        assert backend.workload in backend.kinds and backend.workload.kind == name
        assert backend.workload.api_version == NEEDS[name].api_version
        assert backend.workload in CHILD_KINDS
