"""Each choice of the job spec is read in one module (issue 51, "one seam per choice"),
read from the source's AST of the trainer and the launcher:

- placement: the colocated choice (`sampling.colocated` of the trainer config) only in
  rl/placement.py, which gives the loop its `Separate` / `Colocated` object;
- engine: which engine a job trains on (`optim.engine`), and which engine wrote a
  checkpoint (ZeRO's file layout), only in engine/;
- method: which reference model a method has (`kl_coef` deciding it, `with_ref`) only in
  the contract's TrainerConfig.reference_model, and whether it syncs weights only in the
  method facts (no `Method.RL` / `Method.DISTILL` comparison in the trainer or launcher)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((ROOT / "trainer_image" / "rlhf_trainer").rglob("*.py")),
           *sorted((ROOT / "launcher" / "rlhf_launcher").rglob("*.py"))]


def _where(predicate) -> set[str]:
    """Files (relative to the trainer or launcher package) with a node matching `predicate`."""
    found = set()
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        if any(predicate(node) for node in ast.walk(tree)):
            found.add("/".join(path.relative_to(ROOT).parts[1:]))
    return found


def _attr(node, name: str, owner: str | None = None) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == name
            and (owner is None or (isinstance(node.value, ast.Attribute) and node.value.attr == owner)
                 or (isinstance(node.value, ast.Name) and node.value.id == owner)))


def _string(node, text: str) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and text in node.value


def test_the_placement_is_read_in_one_module():
    assert _where(lambda n: _attr(n, "colocated", "sampling")) == {"rlhf_trainer/rl/placement.py"}
    assert _where(lambda n: isinstance(n, ast.Name) and n.id == "Colocation") <= {
        "rlhf_trainer/rl/placement.py", "rlhf_trainer/rl/colocation.py"}


def test_the_engine_is_read_in_the_engine_package_only():
    assert _where(lambda n: _attr(n, "engine", "optim")) == {"rlhf_trainer/engine/__init__.py"}
    assert {p for p in _where(lambda n: _string(n, "model_states.pt"))} == {"rlhf_trainer/engine/zero.py"}
    assert _where(lambda n: isinstance(n, ast.Compare) and any(_string(c, "deepspeed") for c in n.comparators)) \
        == {"rlhf_trainer/engine/__init__.py"}


def test_method_facts_are_read_from_the_table():
    assert not _where(lambda n: isinstance(n, ast.keyword) and n.arg == "with_ref")
    assert not _where(lambda n: _attr(n, "RL", "Method") or _attr(n, "DISTILL", "Method") or _attr(n, "DPO", "Method"))
    # kl_coef only where the KL itself is computed, never to decide whether a reference exists
    assert _where(lambda n: _attr(n, "kl_coef")) <= {"rlhf_trainer/rl/tensors.py", "rlhf_trainer/algorithms/losses.py"}
