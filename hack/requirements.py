#!/usr/bin/env python3
"""Prints the pinned requirements of pyproject.toml's base dependencies plus the given extras
(self-references such as `rlhf-operator[trainer]` expanded), one per line.

    python3 hack/requirements.py pyproject.toml trainer gem > requirements.txt

The Dockerfiles install these in a layer of their own before the sources are copied, so a
change to the code rebuilds only the small layer that installs our packages (`--no-deps`).
"""

from __future__ import annotations

import re
import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as fh:
        project = tomllib.load(fh)["project"]
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    out: list[str] = []
    seen: set[str] = set()

    def add(reqs: list[str]) -> None:
        for req in reqs:
            self_ref = re.fullmatch(rf"{re.escape(name)}\[([^\]]+)\]", req.strip())
            if self_ref:
                for extra in self_ref.group(1).split(","):
                    expand(extra.strip())
            elif req not in out:
                out.append(req)

    def expand(extra: str) -> None:
        if extra in seen:
            return
        if extra not in optional:
            raise SystemExit(f"requirements.py: no extra {extra!r} in {pyproject} (has: {', '.join(optional)})")
        seen.add(extra)
        add(optional[extra])

    add(project.get("dependencies", []))
    for extra in extras:
        expand(extra)
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
