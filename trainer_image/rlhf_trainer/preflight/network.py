"""NCCL's network settings in the trainer's pod, checked before any model loads: an
NCCL_SOCKET_IFNAME that lets NCCL use none of the pod's interfaces, or NCCL_NET=IB
(`rollout.weightSyncNetwork: ib`) with no InfiniBand device, can never work, so the job
fails at once with exit code 2 instead of spending its restarts on a group that cannot form.

NCCL_SOCKET_IFNAME's syntax is NCCL's (its environment-variable docs): comma-separated
interface name prefixes (each may end in `:port`, which names no interface); a leading `^`
excludes what the list matches instead of selecting it, and a `=` after it (or first)
makes every entry an exact name instead of a prefix. The weight sync's sender applies the
same check when NCCL itself refuses to mint the group's unique id (weight_sync/sender.py).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from rlhf_contract.pod import ENV_NCCL_NET, ENV_NCCL_SOCKET_IFNAME, NCCL_NET_VALUES

INFINIBAND_DIR = Path("/sys/class/infiniband")


def interfaces() -> list[str]:
    """The network interfaces of this pod (of its network namespace)."""
    return [name for _, name in socket.if_nameindex()]


def ifname_matches(value: str, names: list[str]) -> list[str]:
    """The interfaces among `names` that NCCL_SOCKET_IFNAME=`value` lets NCCL use."""
    exclude = value.startswith("^")
    rest = value[1:] if exclude else value
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    prefixes = [entry.split(":", 1)[0] for entry in rest.split(",") if entry.split(":", 1)[0]]

    def listed(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in prefixes)

    return [name for name in names if listed(name) != exclude]


def socket_ifname_problem(value: str | None = None, names: list[str] | None = None) -> str | None:
    """What is wrong with NCCL_SOCKET_IFNAME (this process's, unless `value`) and what to
    set, or None (unset, or it matches an interface)."""
    value = os.environ.get(ENV_NCCL_SOCKET_IFNAME) if value is None else value
    if not value:
        return None
    names = interfaces() if names is None else names
    if ifname_matches(value, names):
        return None
    return (f"spec.pod.env {ENV_NCCL_SOCKET_IFNAME}: {value!r} matches no network interface of the trainer's pod "
            f"(it has {', '.join(names) or 'none'}), so NCCL can form no group; set spec.pod.env "
            f"{ENV_NCCL_SOCKET_IFNAME} to the interface the trainer and the rollout servers share (e.g. =eth0, "
            "the pod network's), or remove the entry to keep the operator's default")


def infiniband_problem(net: str | None = None, device_dir: Path = INFINIBAND_DIR) -> str | None:
    """NCCL_NET=IB (`rollout.weightSyncNetwork: ib`) needs an InfiniBand device in the pod."""
    net = os.environ.get(ENV_NCCL_NET, "") if net is None else net
    if net.lower() != NCCL_NET_VALUES["ib"].lower():
        return None
    try:
        devices = sorted(p.name for p in device_dir.iterdir())
    except OSError:
        devices = []
    if devices:
        return None
    return (f"spec.rollout.weightSyncNetwork: ib ({ENV_NCCL_NET}={net}) but the trainer's pod sees no InfiniBand "
            f"device ({device_dir} is empty or missing), so NCCL can form no group; request the RDMA device in "
            "spec.trainer.resources (and the servers' in spec.rollout.resources), or set weightSyncNetwork: socket "
            "(or auto, NCCL's own choice)")


def network_problems() -> list[str]:
    """Every problem of NCCL's network settings in this pod."""
    return [p for p in (socket_ifname_problem(), infiniband_problem()) if p]
