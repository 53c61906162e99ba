"""`final/README.md`: the model card every run's exported model gets (and what the Hub shows
for an `output.hub` push): the base model, the method and reward, the evaluation scores of
the last evaluation and the last step's training metrics, and the resolved job spec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from rlhf_contract.api.uris import parse_remote
from rlhf_contract.outputs import METRICS_FILE

CARD = "README.md"


def _last_rows(output_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(last row of metrics.jsonl, newest value of each `eval/...` key)."""
    path = output_dir / METRICS_FILE
    last, evals = {}, {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            last = row
            evals.update({k: v for k, v in row.items() if k.startswith("eval/") and v is not None})
    return last, evals


def render(run_config: dict[str, Any], output_dir: Path) -> str:
    """The card's text (YAML front matter as the Hub reads it, then Markdown)."""
    spec = run_config.get("spec", {})
    base = spec.get("model", {}).get("path", "unknown")
    reward = spec.get("reward", {})
    last, evals = _last_rows(output_dir)
    front = {"library_name": "transformers", "tags": ["rlhf-operator", str(spec.get("method", "rl"))]}
    remote = parse_remote(base) if str(base).startswith("hf://") else None
    if remote is not None:  # the repository's id, without type prefix, revision or folder
        front["base_model"] = remote.name
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {run_config.get('name', 'model')}", "",
             f"Trained with rlhf-operator (`method: {spec.get('method', 'rl')}`) from `{base}`.", "",
             "## Reward", "", f"`{json.dumps(reward, sort_keys=True)}`", "", "## Evaluation", ""]
    lines += ([f"| metric | value |", "|---|---|"] + [f"| {k} | {_num(v)} |" for k, v in sorted(evals.items())]
              if evals else ["No evaluation was configured (`spec.evaluation`)."])
    shown = {k: v for k, v in last.items() if isinstance(v, (int, float)) and not k.startswith("eval/")}
    lines += ["", f"## Last step ({last.get('step', 0)})", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_num(v)} |" for k, v in sorted(shown.items())]
    lines += ["", "## Job spec (resolved)", "", "```yaml", yaml.safe_dump(spec, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_card(final_dir: Path, run_config: dict[str, Any], output_dir: Path) -> Path:
    path = final_dir / CARD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render(run_config, output_dir))
    tmp.rename(path)
    return path
