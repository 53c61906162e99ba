"""What never leaves a job in an artefact: the literal values of environment variables and
HTTP headers, the user info and query string of URLs, and values under keys that name a secret.

`redact_spec` makes the copy of a resolved spec that goes where others read it (the job's
ConfigMap `job.json`, TensorBoard, MLflow, W&B, the model card); `redact_text` cleans a
message (an error that quotes a URL) before it reaches status, events or logs we write.
The job's own processes still get the real values, through the pod spec and Secrets.

What this does not do: find a secret pasted into a free-text field (a rubric, a system
prompt); validation refuses URL credentials in the spec (`rules.py`), this is the second
line.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REDACTED = "<redacted>"

# Keys whose values are secrets wherever they appear in a spec (camelCase or snake_case); a key
# ending in `Secret` names a Kubernetes Secret (a reference, kept).
_SECRET_KEY = re.compile(r"(?i)(password|passwd|secret(?!Name|KeyRef|Ref|s?$)|token(?!izer|s\b|sPer)|api_?key(?!Secret)|"
                         r"credential|private_?key|access_?key(?!Secret))")
# A URL with a scheme and authority; user info or a query string are what we cut.
_URL = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>:,.;)])")  # not its trailing punctuation


def redact_url(url: str) -> str:
    """`scheme://user:pass@host/p?token=x#f` -> `scheme://<redacted>@host/p?<redacted>#f` (a
    query inside the fragment, `#/route?token=x`, is cut too)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = REDACTED if parts.query else ""
    fragment = parts.fragment  # a single-page app's route keeps its own query there (MLflow's `#/...?x=`)
    if "?" in fragment:
        fragment = f"{fragment.split('?', 1)[0]}?{REDACTED}"
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def redact_text(text: str) -> str:
    """Every URL in `text` with its user info and query string cut."""
    return _URL.sub(lambda m: redact_url(m.group(1)), text)


_REFERENCE = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*\}$")
"""`${NAME}`: a value read from the trainer's environment (an MCP server's env or headers)."""


def _env_list(value: Any) -> Any:
    """Kubernetes EnvVar lists keep names and references (`valueFrom`); literal values go. A
    name -> value map (an MCP server's `env`, HTTP `headers`) keeps its names and `${NAME}`
    references; its literal values go (an `Authorization` header names no secret)."""
    if isinstance(value, dict):
        return {k: v if isinstance(v, str) and _REFERENCE.match(v) else REDACTED for k, v in value.items()}
    if not isinstance(value, list):
        return redact_spec(value)
    out = []
    for item in value:
        if isinstance(item, dict) and "value" in item:
            item = {**item, "value": REDACTED}
        out.append(redact_spec(item))
    return out


def redact_spec(value: Any, key: str = "") -> Any:
    """A deep copy of `value` (JSON-like) with env values, secret-named keys' values and URL
    credentials replaced by `<redacted>`."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if k in ("env", "headers"):
                out[k] = _env_list(v)
            elif isinstance(v, (str, int, float)) and not isinstance(v, bool) and _SECRET_KEY.search(str(k)):
                out[k] = REDACTED
            else:
                out[k] = redact_spec(v, str(k))
        return out
    if isinstance(value, list):
        return [redact_spec(v, key) for v in value]
    if isinstance(value, str) and "://" in value:
        return redact_text(value)
    return value
