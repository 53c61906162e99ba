"""`README.md` of every exported model (`final/`, and each `output.hub.every` push): the model
card the Hub shows, built with `huggingface_hub.ModelCard` / `ModelCardData`.

Metadata (the YAML the Hub indexes): `base_model` (an `hf://` model), `datasets` (the `hf://`
training and evaluation datasets), `license` (`output.license`, else the base model's own
card's, read from its local copy; omitted when neither says), `library_name`, `tags` (the
method and the algorithm preset). Text: the method and algorithm, the reward, a short table
of the reward (offline methods: the loss) by step from metrics.jsonl, the last evaluation's
scores, the last step's metrics, the tracker runs (W&B / MLflow URLs when the job has them)
and the resolved job spec.

Nothing secret: the spec is the redacted one (rlhf_contract.redact.redact_spec, again here)
and every link loses its user info and query string (`redact_url`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml

from rlhf_contract.api.uris import parse_remote
from rlhf_contract.outputs import METRICS_FILE
from rlhf_contract.redact import redact_spec, redact_url

log = logging.getLogger(__name__)

CARD = "README.md"
CURVE_ROWS = 10
"""Rows of the card's reward-by-step table (evenly spaced, the last step always in)."""


def _rows(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / METRICS_FILE
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _hub_id(uri: Any) -> str | None:
    """The repository id (`org/name`, without type prefix, revision or folder) of an `hf://`
    address (None for any other, or a malformed one)."""
    if not (isinstance(uri, str) and uri.startswith("hf://")):
        return None
    try:
        return parse_remote(uri).name
    except ValueError:
        return None


def base_license(base_dir: Path | None) -> str | None:
    """The `license` of the base model's own card (its local copy's README.md), if it has one."""
    from huggingface_hub import ModelCard

    card = base_dir / CARD if base_dir is not None else None
    if card is None or not card.is_file():
        return None
    try:
        return ModelCard.load(card).data.license
    except Exception as err:  # a card we cannot read only costs the field
        log.warning("the base model's card %s cannot be read (%s); no license taken from it", card, err)
        return None


def curve(rows: list[dict[str, Any]], key: str, n: int = CURVE_ROWS) -> list[tuple[int, float]]:
    """(step, value) of `key` at about `n` evenly spaced steps, the last included."""
    points = [(int(r["step"]), float(r[key])) for r in rows
              if isinstance(r.get(key), (int, float)) and isinstance(r.get("step"), int)]
    if len(points) <= n:
        return points
    picked = sorted({round(i * (len(points) - 1) / (n - 1)) for i in range(n)})
    return [points[i] for i in picked]


def card_data(spec: dict[str, Any], *, license: str | None) -> Any:
    from huggingface_hub import ModelCardData

    algorithm = spec.get("algorithm") or {}
    datasets = [d for d in [_hub_id((spec.get("data") or {}).get("path")),
                            *(_hub_id(e.get("path")) for e in (spec.get("evaluation") or {}).get("datasets", []))] if d]
    tags = ["rlhf-operator", str(spec.get("method", "rl"))] + ([str(algorithm["preset"])] if algorithm.get("preset") else [])
    return ModelCardData(base_model=_hub_id((spec.get("model") or {}).get("path")),
                         datasets=list(dict.fromkeys(datasets)) or None, license=license,
                         library_name="transformers", tags=tags)


def render(run_config: dict[str, Any], output_dir: Path, *, base_dir: Path | None = None,
           links: dict[str, str] | None = None) -> str:
    """The card's text (YAML metadata as the Hub reads it, then Markdown)."""
    from huggingface_hub import ModelCard

    spec = redact_spec(run_config.get("spec", {}))
    license = (spec.get("output") or {}).get("license") or base_license(base_dir)
    data = card_data(spec, license=license)
    base, method = (spec.get("model") or {}).get("path", "unknown"), spec.get("method", "rl")
    algorithm = {k: v for k, v in (spec.get("algorithm") or {}).items() if v is not None}
    rows = _rows(output_dir)
    last = rows[-1] if rows else {}
    evals = {k: v for r in rows for k, v in r.items() if k.startswith("eval/") and v is not None}
    key = "reward_mean" if any("reward_mean" in r for r in rows) else "loss"
    lines = [f"# {run_config.get('name', 'model')}", "",
             f"Trained with rlhf-operator (`method: {method}`) from `{base}`.", ""]
    if algorithm:
        lines += [f"Algorithm: `{json.dumps(algorithm, sort_keys=True)}`", ""]
    lines += ["## Reward", "", f"`{json.dumps(spec.get('reward', {}), sort_keys=True)}`", "",
              f"| step | {key} |", "|---|---|", *(f"| {s} | {_num(v)} |" for s, v in curve(rows, key)), "",
              "## Evaluation", ""]
    lines += (["| metric | value |", "|---|---|"] + [f"| {k} | {_num(v)} |" for k, v in sorted(evals.items())]
              if evals else ["No evaluation was configured (`spec.evaluation`)."])
    shown = {k: v for k, v in last.items() if isinstance(v, (int, float)) and not k.startswith("eval/")}
    lines += ["", f"## Last step ({last.get('step', 0)})", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_num(v)} |" for k, v in sorted(shown.items())]
    if links:
        lines += ["", "## Runs", "", *(f"- {name}: {redact_url(url)}" for name, url in sorted(links.items()))]
    lines += ["", "## Job spec (resolved)", "", "```yaml", yaml.safe_dump(spec, sort_keys=False).rstrip(), "```", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_card(model_dir: Path, run_config: dict[str, Any], output_dir: Path, *, base_dir: Path | None = None,
               links: dict[str, str] | None = None) -> Path:
    """`model_dir/README.md`, written atomically; `base_dir`: the base model's local copy."""
    path = model_dir / CARD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render(run_config, output_dir, base_dir=base_dir, links=links))
    tmp.rename(path)
    return path
