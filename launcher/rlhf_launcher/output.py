"""Machine-readable output of `rlhfctl` (`-o json|yaml`): one format for every command.

Several Kubernetes objects print as YAML documents (`---` between them, what `kubectl
apply -f` reads) or as one JSON `v1` List (what `kubectl get -o json` prints); anything else
prints as one JSON value or one YAML document."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

FORMATS = ("json", "yaml")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a file in a ConfigMap) as `|` blocks, as kubectl prints them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def add_output_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("-o", "--output-format", dest="output_format", choices=FORMATS,
                        help=f"print {what} as JSON or YAML instead of text")


def dump(value: Any, fmt: str) -> str:
    """`value` as JSON (indented) or one YAML document."""
    if fmt == "json":
        return json.dumps(value, indent=2) + "\n"
    return yaml.dump(value, Dumper=_Dumper, sort_keys=False)


def dump_objects(objects: list[dict[str, Any]], fmt: str) -> str:
    """Kubernetes objects: YAML documents, or a JSON `v1` List."""
    if fmt == "json":
        return dump({"apiVersion": "v1", "kind": "List", "items": objects}, fmt)
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False)


def emit(value: Any, fmt: str) -> None:
    sys.stdout.write(dump(value, fmt))
