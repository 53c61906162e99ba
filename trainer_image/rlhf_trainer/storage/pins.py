"""One revision per source per job: the job's first download of an `hf://` or `s3://`
address records what it resolved to (the Hub commit a branch or tag pointed at; the S3
objects and their ETags) in `sources/.pins/<hash>.json` on the job's volume, created
exclusively (the first process wins, on any node); every later download (other pods on
the volume, restarts) reads exactly that: the Hub commit, or each object only while it
still has its pinned ETag. So a branch moved or an object replaced during the job is not
mixed in: the Hub copy stays at the commit, a changed S3 object fails the step (exit 2).

The trainer reports the pins in `status.progress.sources` (`summaries`). Limit: a rollout
pod that keeps its model in its own emptyDir (no shared volume at the output directory)
has no pin to read and resolves its address itself; pin a commit in the spec, or mount a
shared volume there, to make it read the trainer's revision."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from rlhf_contract.sources import PINS_DIR, Fetch

from . import StorageError
from .files import create_exclusive

log = logging.getLogger(__name__)


def read(fetch: Fetch) -> dict | None:
    """The pin of `fetch`'s address on this volume, or None before the first download."""
    path = Path(fetch.pin_file())
    try:
        pin = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise StorageError(f"{fetch.field}: {fetch.uri}: the pin {path} cannot be read ({err}); delete it to pin the "
                           "address again", permanent=True) from None
    if not isinstance(pin, dict) or pin.get("uri") != fetch.uri or not ("revision" in pin or "objects" in pin):
        raise StorageError(f"{fetch.field}: {fetch.uri}: the pin {path} is not this address's; delete it to pin the "
                           "address again", permanent=True)
    return pin


def record(fetch: Fetch, resolved: dict) -> dict:
    """Pin `resolved` ({"revision": commit} or {"objects": {key: ETag}}) unless another
    process pinned first; returns the pin in force."""
    path = Path(fetch.pin_file())
    path.parent.mkdir(parents=True, exist_ok=True)
    pin = {"uri": fetch.uri, **resolved}
    if create_exclusive(path, json.dumps(pin, indent=1)):
        log.info("%s: %s pinned to %s for this job", fetch.field, fetch.uri, summary(pin))
        return pin
    return read(fetch) or pin


def same(pin: dict, record: dict) -> bool:
    """Whether a copy's marker `record` is of the pinned revision."""
    if "revision" in pin:
        return record.get("revision") == pin["revision"]
    return record.get("objects") == pin.get("objects")


def summary(pin: dict) -> str:
    """One string per pin: the Hub commit; `etag:<ETag>` of one S3 object; for several,
    `etags:<sha256 of the sorted key=ETag lines, 16 hex> (<n> objects)`."""
    if "revision" in pin:
        return str(pin["revision"])
    objects = pin.get("objects") or {}
    if len(objects) == 1:
        return f"etag:{next(iter(objects.values()))}"
    digest = hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(objects.items())).encode()).hexdigest()
    return f"etags:{digest[:16]} ({len(objects)} objects)"


def summaries(sources_dir: str | Path) -> dict[str, str]:
    """{address: summary} of every pin under `sources_dir` (unreadable ones skipped)."""
    out = {}
    for path in sorted(Path(sources_dir, PINS_DIR).glob("*.json")):
        try:
            pin = json.loads(path.read_text())
            out[str(pin["uri"])] = summary(pin)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out
