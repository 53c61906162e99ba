"""docs/reference.md is generated from the API models (`make docs`): it is current, it names
every field of the models with its documentation, and its tables are the contract's own.
The README and the other docs pages name only files and links that exist, and so do the
docstrings of the packages' sources."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Iterator

from rlhf_contract.api.models import RLHFJobSpec, RLHFJobStatus
from rlhf_contract.api.presets import preset_table
from rlhf_contract.exit_codes import TABLE
from rlhf_launcher.reference import reference

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reference.md"
TOP_DIRS = ("contract/", "launcher/", "operator/", "trainer_image/", "inference_image/", "tests/", "examples/",
            "charts/", "crds/", "bench/", "docs/")


def schema_paths(node: dict[str, Any], defs: dict[str, Any], path: str) -> Iterator[tuple[str, dict]]:
    """Every field path of pydantic's own JSON schema (not the CRD's), with its node."""
    if "$ref" in node:
        node = {**defs[node["$ref"].split("/")[-1]], **node}
    for variant in node.get("anyOf", []):
        yield from schema_paths(variant, defs, path)
    if node.get("type") == "array" and "items" in node:
        yield from schema_paths(node["items"], defs, path + "[]")
    for name, child in node.get("properties", {}).items():
        yield f"{path}.{name}", child
        yield from schema_paths(child, defs, f"{path}.{name}")


def model_paths() -> dict[str, dict]:
    found = {}
    for model, root in ((RLHFJobSpec, "spec"), (RLHFJobStatus, "status")):
        schema = model.model_json_schema(by_alias=True, mode="validation")
        found.update(schema_paths(schema, schema.get("$defs", {}), root))
    return found


def rows() -> dict[str, list[str]]:
    """docs/reference.md's field rows (the tables before the presets): path -> cells."""
    out = {}
    for line in DOC.read_text().split("## Algorithm presets")[0].splitlines():
        match = re.match(r"\| `((?:spec|status)\.[^`]+)` \|", line)
        if match:
            out[match.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    return out


def test_reference_is_current():
    assert DOC.read_text() == reference(), "docs/reference.md is stale: run `make docs`"


def test_every_field_of_the_models_has_a_documented_row():
    paths, documented = model_paths(), rows()
    assert len(paths) > 150 and "spec.rollout.replicas" in paths and "spec.reward.components[].weight" in paths
    assert sorted(paths) == sorted(documented), set(paths) ^ set(documented)
    for path, cells in documented.items():
        assert len(cells) == 5, path
        assert cells[4], f"{path} has no description: add a docstring under the field in contract/rlhf_contract/api"


def test_rows_carry_type_default_and_bounds():
    documented = rows()
    replicas = documented["spec.rollout.replicas"]
    assert replicas[1].startswith("integer") and replicas[2] == "`1`" and replicas[3].startswith("at least 1")
    assert documented["spec.model.path"][2] == "**required**"
    assert documented["spec.rollout.topP"][3] == "above 0; at most 1"
    assert documented["spec.algorithm.klCoef"][2] == "from `preset`"
    assert documented["spec.model.lora"][1] == "[object](#specmodellora) or null"
    assert '`"vllm"`, `"cpu"`' in documented["spec.rollout.engine"][3]
    assert "-> float \\| {reward, score}`;" in documented["spec.reward.function"][4]  # a table cell's | escaped


def test_presets_and_exit_codes_come_from_their_tables():
    text = DOC.read_text()
    assert preset_table() in text
    for meaning in TABLE:
        yes = "yes" if meaning.permanent else "no"
        assert f"| {int(meaning.code)} | `{meaning.code.name}` | {meaning.text} | {yes} |" in text


def named_paths(page: Path) -> Iterator[str]:
    """Repository paths a page names in code spans (`trainer_image/...`) and relative links."""
    text = page.read_text()
    for path in re.findall(r"`([^`\s<*{]+)`", text):
        if path.startswith(TOP_DIRS):
            yield path
    for link in re.findall(r"\]\(([^)#\s]+)", text):
        if "://" not in link:
            yield str((page.parent / link).resolve().relative_to(ROOT))


def test_readme_and_docs_name_files_that_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(page.name, path) for page in pages for path in named_paths(page)}
    assert len(named) > 100
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path.rstrip("/")).exists())
    assert not missing, "pages name files that do not exist (moved or renamed?):\n" + "\n".join(missing)


PACKAGES = {"contract": "rlhf_contract", "operator": "rlhf_operator", "trainer_image": "rlhf_trainer",
            "inference_image": "rlhf_inference", "launcher": "rlhf_launcher"}
# Another project's files are named from its own root (`vllm/v1/engine/core.py`); bare file
# names that are not ours: vLLM's modules, and the sandbox's program (sandbox/bwrap.py).
FOREIGN_ROOTS = ("vllm/",)
FOREIGN_NAMES = {"packed_tensor.py", "pynccl_wrapper.py", "gpu_worker.py", "nccl_engine.py", "nccl_common.py",
                 "main.py"}
SLASHED = re.compile(r"(?<![\w./-])([A-Za-z_][\w.-]*(?:/[\w.-]+)+)")
BARE = re.compile(r"(?<![\w./-])([A-Za-z_]\w*\.py)\b")
OURS = (*TOP_DIRS, "hack/", *(f"{package}/" for package in PACKAGES.values()))


def docstrings(path: Path) -> Iterator[tuple[str, str]]:
    """(where, docstring) for the module, its classes and its functions."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}", doc


def docstring_paths(doc: str) -> Iterator[str]:
    """Our file paths a docstring names: a path with a slash that ends in `.py` or starts at one
    of our folders (`docs/storage.md`), and a bare `*.py` name. Other paths (`final/README.md`,
    `checkpoints/step-N/`) are a job's artefacts, not files of this repository."""
    for path in SLASHED.findall(doc):
        path = path.rstrip(".")
        if path.startswith(FOREIGN_ROOTS):
            continue
        if path.startswith(OURS) or path.endswith(".py"):
            yield path
    for name in BARE.findall(doc):
        if name not in FOREIGN_NAMES:
            yield name


def test_docstrings_name_files_that_exist():
    """`rl/step.py` in trainer_image/rlhf_trainer/parallel/ resolves against the trainer's
    package (or the repository, the folder the package sits in, the file's own folder); a
    bare `sender.py` is a file of that name somewhere in our sources."""
    ours = {p.name for top in (*PACKAGES, "tests") for p in (ROOT / top).rglob("*.py")}
    checked, missing = 0, []
    for top, package in PACKAGES.items():
        bases = [ROOT, ROOT / top, ROOT / top / package]
        for source in sorted((ROOT / top).rglob("*.py")):
            for where, doc in docstrings(source):
                for path in docstring_paths(doc):
                    checked += 1
                    if "/" not in path:
                        found = path in ours
                    else:
                        found = any((base / path.rstrip("/")).exists()
                                    for base in (*bases, source.parent, *(ROOT / t for t in PACKAGES)))
                    if not found:
                        missing.append(f"{where}: {path}")
    assert checked > 150
    assert not missing, "docstrings name files that do not exist (moved or renamed?):\n" + "\n".join(missing)
