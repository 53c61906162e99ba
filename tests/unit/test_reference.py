"""docs/reference.md is generated from the API models (`make docs`): it is current, it names
every field of the models with its documentation, and its tables are the contract's own.
The README and the other docs pages name only files and links that exist."""

from __future__ import annotations

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
