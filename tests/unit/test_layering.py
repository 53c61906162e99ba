"""The layering rule (DESIGN.md): the operator, the trainer and the inference server each
import the contract package and never each other; the contract imports none of them;
only the launcher (`rlhfctl`, local mode) may import all. Read from the source's AST."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "rlhf_contract": ROOT / "contract" / "rlhf_contract",
    "rlhf_operator": ROOT / "operator" / "rlhf_operator",
    "rlhf_trainer": ROOT / "trainer_image" / "rlhf_trainer",
    "rlhf_inference": ROOT / "inference_image" / "rlhf_inference",
    "rlhf_launcher": ROOT / "launcher" / "rlhf_launcher",
}
ALLOWED = {
    "rlhf_contract": set(),
    "rlhf_operator": {"rlhf_contract"},
    "rlhf_trainer": {"rlhf_contract"},
    "rlhf_inference": {"rlhf_contract"},
    "rlhf_launcher": {"rlhf_contract", "rlhf_operator", "rlhf_trainer", "rlhf_inference"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level product packages that a module imports (absolute imports; relative ones
    stay inside their own package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return found


def test_import_graph_goes_through_the_contract_only():
    bad = []
    for package, folder in PACKAGES.items():
        for module in sorted(folder.rglob("*.py")):
            for other in imported_packages(module) - {package} - ALLOWED[package]:
                bad.append(f"{module.relative_to(ROOT)} imports {other}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_forbidden_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom rlhf_trainer.models import builtin\ndef f():\n    import rlhf_operator.kube\n")
    assert imported_packages(module) == {"rlhf_trainer", "rlhf_operator"}


def _run_without(blocked: list[str], code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where importing any of `blocked` fails."""
    guard = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        f"    blocked = {blocked!r}\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in self.blocked:\n"
        "            raise ImportError(f'{name} is made unimportable by the test')\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    return subprocess.run([sys.executable, "-c", guard + code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("code", [
    "import rlhf_contract.api, rlhf_contract.pod, rlhf_contract.trainer_config, rlhf_contract.outputs",
    "import rlhf_operator.builders, rlhf_operator.status, rlhf_operator.handlers, rlhf_operator.kube",
    "from rlhf_launcher.cli import main; import sys; sys.argv = ['rlhfctl', 'crd']; main()",
    "from rlhf_launcher.cli import main; main(['validate', 'examples/local-grpo.yaml'])",
])
def test_operator_contract_and_cli_need_no_torch(code):
    res = _run_without(["torch", "transformers"], code + "\nassert 'torch' not in sys.modules")
    assert res.returncode == 0, res.stderr[-3000:]


def test_trainer_needs_no_kubernetes_client():
    code = ("import sys, rlhf_trainer.rl.loop, rlhf_trainer.main, rlhf_trainer.launch, rlhf_trainer.rewards\n"
            "assert not {'kopf', 'kubernetes', 'rlhf_operator'} & set(sys.modules)")
    res = _run_without(["kopf", "kubernetes"], code)
    assert res.returncode == 0, res.stderr[-3000:]


def test_contract_imports_no_program():
    res = subprocess.run([sys.executable, "-c", "import sys, rlhf_contract.api.crd, rlhf_contract.pod, "
                          "rlhf_contract.trainer_config\nprint(sorted(m for m in sys.modules if m.split('.')[0] in "
                          "('torch', 'kopf', 'rlhf_operator', 'rlhf_trainer', 'rlhf_inference')))"],
                         capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr
