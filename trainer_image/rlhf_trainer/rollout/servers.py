"""The trainer's one handshake with the rollout servers, before the first round.

`handshake(endpoints, startup_timeout_s=...)` waits for every server's /health as long as
its startup probe allows, then asks each what it is (`read_servers`): its vLLM version
(GET /version, at least MIN_VLLM_VERSION), its weight-transfer engine and serving dtype
(GET /server_info: VLLM_SERVER_DEV_MODE=1 routes, `--weight-transfer-config`,
`model_config.dtype`, and the NCCL wheel in `system_env.pip_packages`) and how many
workers join the weight-transfer group (GET /get_world_size). A server no trainer could
work with ends the process with `RolloutImageError` (exit code 2, permanent for the
operator) naming `rollout.image`. The orchestrator runs it at start and hands the
`ServerInfo`s to the weight-sync sender, which forms its group from them (and compares the
servers' NCCL release with the library it opens: weight_sync/nccl.py).

It does not generate, and it keeps no connection: the rollout client (client.py) and the
sender (weight_sync/sender.py) each keep their own.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import httpx


from ..exits import ConfigErrorExit
from .client import RolloutClient, RolloutError

log = logging.getLogger(__name__)

MIN_VLLM_VERSION = (0, 33)  # the first release whose /update_weights takes empty metadata as "same as last round"


@dataclass(frozen=True)
class ServerInfo:
    """What a rollout server says about itself at start."""

    endpoint: str
    version: str  # vLLM's version (the CPU engine reports the release whose protocol it speaks)
    weight_transfer_backend: str  # "nccl" (vLLM) or "gloo" (CPU engine)
    world_size: int  # workers that join the weight-transfer group
    dtype: str | None = None  # the serving dtype as /server_info dumps it ("torch.bfloat16"); None: not said
    nccl: tuple[int, int, int] | None = None  # the NCCL wheel in the server's `pip list`; None: not listed


class RolloutImageError(ConfigErrorExit):
    """A rollout server cannot take part in weight transfer: exit code 2, `str()` says why."""


def handshake(endpoints: list[str], *, startup_timeout_s: float, request_timeout_s: float = 60.0) -> list[ServerInfo]:
    """Wait up to `startup_timeout_s` for every server's /health, then `read_servers`.
    Raises `RolloutError` when one does not start in time."""
    RolloutClient(endpoints).wait_ready(startup_timeout_s)
    return read_servers(endpoints, request_timeout_s=request_timeout_s)


def read_servers(endpoints: list[str], *, request_timeout_s: float = 60.0) -> list[ServerInfo]:
    """Each server's `ServerInfo`, in order. Raises `RolloutImageError` (SystemExit with code
    2, after logging the message) when a server cannot do weight transfer."""
    with httpx.Client(timeout=httpx.Timeout(request_timeout_s)) as http:
        return [_server_info(http, endpoint) for endpoint in (e.rstrip("/") for e in endpoints)]


def _server_info(http: httpx.Client, endpoint: str) -> ServerInfo:
    def get(path: str, **params) -> httpx.Response:
        try:
            return http.get(endpoint + path, params=params)
        except httpx.HTTPError as exc:
            raise RolloutError(f"GET {endpoint}{path} failed: {exc!r}") from exc

    image_hint = ("set rollout.image to an image with vLLM >= {}.{} and its weight-transfer API "
                  "(the default image runs the pinned release)").format(*MIN_VLLM_VERSION)
    reply = get("/version")
    version = str(reply.json().get("version", "")) if reply.status_code == 200 else ""
    parsed = _version_tuple(version)
    if parsed is None or parsed < MIN_VLLM_VERSION:
        raise RolloutImageError.reported(
            f"rollout.image: the server at {endpoint} runs vLLM {version or '(no /version)'}, older than the "
            f"weight-transfer API this trainer speaks ({MIN_VLLM_VERSION[0]}.{MIN_VLLM_VERSION[1]}); {image_hint}")
    reply = get("/server_info", config_format="json")
    if reply.status_code == 404:
        raise RolloutImageError.reported(
            f"rollout.image: the server at {endpoint} (vLLM {version}) does not serve the weight-transfer "
            "routes: it must run with VLLM_SERVER_DEV_MODE=1 (the operator sets it; an image whose "
            f"entry point drops it cannot be used); {image_hint}")
    if reply.status_code != 200:
        raise RolloutError(f"GET {endpoint}/server_info answered HTTP {reply.status_code}: {reply.text[:500]}")
    info = reply.json()
    config = info.get("vllm_config")
    transfer = config.get("weight_transfer_config") if isinstance(config, dict) else None
    if not transfer or not transfer.get("backend"):
        raise RolloutImageError.reported(
            f"rollout.image: the server at {endpoint} (vLLM {version}) runs without a weight-transfer "
            f"engine (no --weight-transfer-config); {image_hint}")
    reply = get("/get_world_size")
    if reply.status_code != 200:
        raise RolloutImageError.reported(
            f"rollout.image: the server at {endpoint} (vLLM {version}) has no /get_world_size "
            f"(HTTP {reply.status_code}); {image_hint}")
    dtype = (config.get("model_config") or {}).get("dtype")
    return ServerInfo(endpoint, version, str(transfer["backend"]), int(reply.json()["world_size"]),
                      dtype=dtype if isinstance(dtype, str) else None, nccl=_nccl_release(info.get("system_env")))


def _version_tuple(version: str) -> tuple[int, int] | None:
    match = re.match(r"v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _nccl_release(system_env) -> tuple[int, int, int] | None:
    packages = system_env.get("pip_packages") if isinstance(system_env, dict) else None
    return package_version(packages) if isinstance(packages, str) else None


def package_version(pip_packages: str) -> tuple[int, int, int] | None:
    """The NCCL release of an `nvidia-nccl-cuXX==X.Y.Z` line in `pip list --format=freeze`
    output (what vLLM's /server_info reports as `system_env.pip_packages`)."""
    for line in pip_packages.splitlines():
        name, _, version = line.strip().partition("==")
        if name.lower().replace("_", "-").startswith("nvidia-nccl-cu"):
            parts = version.split(".")[:3]
            if len(parts) == 3 and all(p.isdigit() for p in parts):
                return int(parts[0]), int(parts[1]), int(parts[2])
    return None
