"""Loading a job file: YAML (job_yaml.py: one document, size-capped, no aliases, no
duplicate keys) -> overrides -> validated `RLHFJob`, with every problem reported by its
field path (`spec.rollout.replicas: ...`)."""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.alias_generators import to_camel

from .job_yaml import MAX_JOB_BYTES, YamlRefused, parse_job_yaml, too_large
from .models import MAX_NAME_LENGTH, Method, RLHFJob
from .rules import RL_ONLY_FIELDS, RuleViolations


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class JobError(ValueError):
    """The job is invalid; `problems` lists each with its field path."""

    def __init__(self, problems: list[Problem], source: str = ""):
        self.problems = problems
        self.source = source
        head = f"{source}: " if source else ""
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{head}{len(problems)} problem(s) in the job spec:\n{lines}")


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at `loc` (for suggestions)."""
    model: Any = RLHFJob
    for part in loc:
        if isinstance(part, int) or model is None:
            return None
        fields = {(f.alias or n): f for n, f in model.model_fields.items()}
        field = fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def problems(err: ValidationError) -> list[Problem]:
    """Every error of a failed validation as a `Problem` with its field path (rule
    violations split into one problem each)."""
    out: list[Problem] = []
    for e in err.errors():
        loc = tuple(e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, RuleViolations):
            prefix = _format_loc(loc)
            out += [Problem(f"{prefix}.{p}" if prefix else p, m) for p, m in cause.violations]
            continue
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1])
            known = [f.alias or n for n, f in owner.model_fields.items()] if owner else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = "unknown field" + (f"; did you mean '{close[0]}'?" if close else "")
            if known:
                msg += f" (allowed: {', '.join(known)})"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        out.append(Problem(_format_loc(loc), msg))
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`rollout.replicas=2` -> (['spec', 'rollout', 'replicas'], 2). Keys may be snake_case;
    the `spec.` prefix is optional; the value is parsed as YAML; an empty value unsets the
    field (null: its default or the preset's value applies)."""
    if "=" not in text:
        raise JobError([Problem("--set", f"{text!r} is not of the form dotted.field=value")])
    key, value = text.split("=", 1)
    parts = [to_camel(p) for p in key.strip().split(".") if p]
    if not parts:
        raise JobError([Problem("--set", f"{text!r} has an empty field name")])
    if parts[0] not in ("spec", "metadata"):
        parts = ["spec", *parts]
    try:
        return parts, parse_job_yaml(value) if value.strip() else None  # empty: unset
    except (YamlRefused, yaml.YAMLError) as err:
        raise JobError([Problem("--set", f"{text!r}: {err}")]) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                where = ".".join(parts[: i + 1])
                raise JobError([Problem(where, f"--set {text!r}: {where} is not a mapping")])
            node = nxt
        node[parts[-1]] = value
    return data


NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
"""The characters of the suffix the API server appends to `metadata.generateName`
(k8s.io/apimachinery/pkg/util/rand: no vowels, no 0, 1, 3)."""
NAME_SUFFIX_LENGTH = 5


def generated_name(prefix: str) -> str:
    """A name as the API server makes one from `metadata.generateName`."""
    import secrets

    return prefix + "".join(secrets.choice(NAME_ALPHABET) for _ in range(NAME_SUFFIX_LENGTH))


def _named(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The document as validated: a job with `metadata.generateName` and no name gets a name
    made from it (the API server's alphabet), since the job's children are named after it; the
    caller's document keeps no name (`rlhfctl submit` lets the server choose)."""
    meta = data.get("metadata")
    if not isinstance(meta, dict) or meta.get("name") is not None or meta.get("generateName") is None:
        return data
    prefix, longest = meta["generateName"], MAX_NAME_LENGTH - NAME_SUFFIX_LENGTH
    if not isinstance(prefix, str) or not re.fullmatch(r"[a-z][-a-z0-9]*", prefix) or len(prefix) > longest:
        raise JobError([Problem("metadata.generateName", f"{prefix!r} must be lowercase letters, digits and '-', "
                                f"start with a letter and be at most {longest} characters (the server adds "
                                f"{NAME_SUFFIX_LENGTH}; a job's name is at most {MAX_NAME_LENGTH})")], source)
    return {**data, "metadata": {**meta, "name": generated_name(prefix)}}


def validate_job(data: Any, overrides: list[str] = (), source: str = "") -> RLHFJob:
    """Validate a parsed job document; raise `JobError` listing every problem. A document
    with `metadata.generateName` and no name is validated under a name made from it."""
    if not isinstance(data, dict):
        raise JobError([Problem("", "the job file must hold one YAML mapping (an RLHFJob)")], source)
    data = _named(apply_overrides(data, list(overrides)), source)
    spec = data.get("spec")
    if isinstance(spec, dict) and spec.get("method") not in (Method.RL, Method.DISTILL, None):
        given = [f for f in RL_ONLY_FIELDS if spec.get(f) is not None]
        if given:
            raise JobError([Problem(f"spec.{f}", f"only methods rl and distill read it; remove it from this "
                                    f"method {spec['method']} job (it trains from data alone)") for f in given], source)
    try:
        return RLHFJob.model_validate(data)
    except ValidationError as err:
        raise JobError(problems(err), source) from None


STDIN = "-"
"""The job file name that reads the job from standard input (`cat job.yaml | rlhfctl validate -`)."""


def job_source(path: str | Path) -> str:
    """How messages name a job file: its path, or `<stdin>`."""
    return "<stdin>" if str(path) == STDIN else str(path)


def read_job_document(path: str | Path) -> Any:
    """The parsed YAML of a job file (`-`: standard input), or a `JobError`."""
    source = job_source(path)
    try:
        if str(path) == STDIN:
            text = sys.stdin.read(MAX_JOB_BYTES + 1)  # characters: at least as many bytes
            if len(text) > MAX_JOB_BYTES:  # not read further
                raise JobError([Problem("", too_large(MAX_JOB_BYTES, at_least=True))], source)
        else:
            size = Path(path).stat().st_size
            if size > MAX_JOB_BYTES:  # refused before it is read
                raise JobError([Problem("", too_large(size))], source)
            text = Path(path).read_text()
    except OSError as err:
        raise JobError([Problem("", f"cannot read {path}: {err.strerror}")], source) from None
    try:
        return parse_job_yaml(text)
    except YamlRefused as err:
        raise JobError([Problem(p, m) for p, m in err.problems], source) from None
    except yaml.YAMLError as err:
        raise JobError([Problem("", f"not valid YAML: {err}")], source) from None


def load_job(path: str | Path, overrides: list[str] = ()) -> RLHFJob:
    """Read and validate a job YAML file (`-`: standard input)."""
    return validate_job(read_job_document(path), overrides, job_source(path))
