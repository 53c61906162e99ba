"""Reading a job file's YAML as the API server would accept it, and no more: one document,
at most `MAX_JOB_BYTES`, no anchors or aliases, no duplicate keys.

Why each: an alias expands in memory, so a few hundred bytes of nested aliases in a free-form
field (a toleration, an affinity) become gigabytes when rendered (the "billion laughs");
anchors are refused with them, before anything is constructed. kubectl refuses a duplicate
key, and with PyYAML the last one would silently win. The API server keeps an object in etcd,
whose request limit is about 1.5 MiB: a job file above 1 MiB is not a job, and is refused
before it is read whole.

Departure: YAML merge keys (`<<:`) are accepted only with an inline mapping (an alias is
what usually feeds them, and aliases are refused).
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_JOB_BYTES = 1024 * 1024
"""The largest job file read (etcd stores an object of at most about 1.5 MiB)."""


class YamlRefused(ValueError):
    """The text is not a job file we read; `problems` holds (field path or '', message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in problems))


def too_large(size: int, *, at_least: bool = False) -> str:
    return (f"the job file is {'over ' if at_least else ''}{size / 2**20:.1f} MiB; a job file may hold at most "
            f"{MAX_JOB_BYTES // 2**20} MiB "
            "(the API server stores a job in etcd, whose limit is about 1.5 MiB): put data in a dataset file "
            "(data.path) and code in files (reward.file), not in the job")


class _JobLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses anchors and aliases while composing (before any
    value is built)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise YamlRefused([("", f"line {event.start_mark.line + 1}: YAML anchors and aliases (&name, *name) "
                                "are not accepted in a job file (an alias can expand a small file into gigabytes); "
                                "write the value out")])
        return super().compose_node(parent, index)


def _duplicates(node: yaml.Node, path: str) -> list[tuple[str, str]]:
    """(field path, message) of every key written twice in one mapping."""
    out: list[tuple[str, str]] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else str(key.value)
            here = f"{path}.{name}" if path else name
            if name in seen:
                out.append((here, f"duplicate key (lines {seen[name]} and {key.start_mark.line + 1}); kubectl refuses "
                            "duplicate keys, and only one value could be used: keep one"))
            else:
                seen[name] = key.start_mark.line + 1
            out += _duplicates(value, here)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out += _duplicates(item, f"{path}[{i}]")
    return out


def parse_job_yaml(text: str) -> Any:
    """The one YAML document of `text`; YamlRefused naming what is refused, or yaml.YAMLError."""
    size = len(text.encode())
    if size > MAX_JOB_BYTES:
        raise YamlRefused([("", too_large(size))])
    loader = _JobLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        dupes = _duplicates(node, "")
        if dupes:
            raise YamlRefused(dupes)
        return loader.construct_document(node)
    finally:
        loader.dispose()
