"""Ship the pinned vLLM's Python code to a lent GPU machine (`make gpu-wheels`), so that
`make gpu-check`'s receivers (bench/gpu_check_receiver.py) take weights through vLLM's own
PyNcclCommunicator rather than a stand-in. That machine has no vLLM and no network, and what
travels is limited to 64 MiB: the .py files of the release's wheel (about 11 MiB as a zip,
which Python imports from directly), not its compiled kernels, which the communicator does
not need.

    python hack/gpu_vllm_source.py .gpu        # writes .gpu/vllm-<version>-py.zip

The wheel (about 340 MB) is downloaded once into ~/.cache/rlhf-operator/ (outside the
repository) and reused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from rlhf_contract.images import VLLM_VERSION

CACHE = Path(os.environ.get("RLHF_CACHE_DIR", Path.home() / ".cache" / "rlhf-operator")) / f"vllm-{VLLM_VERSION}-wheel"


def wheel() -> Path:
    found = sorted(CACHE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(CACHE), f"vllm=={VLLM_VERSION}"], check=True)
        found = sorted(CACHE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return found[-1]


def python_zip(source: Path, target: Path) -> int:
    """Every vllm/**.py member of the wheel `source`, and its dist-info (vLLM's platform
    detection reads its own version from the metadata: without it, no CUDA platform), into
    the zip `target`; returns its size."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(source) as whl, zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as out:
        for info in whl.infolist():
            top = info.filename.split("/")[0]
            if (top == "vllm" and info.filename.endswith(".py")) or top.endswith(".dist-info"):
                out.writestr(info.filename, whl.read(info))
    partial.replace(target)
    return target.stat().st_size


if __name__ == "__main__":
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu")
    target = out_dir / f"vllm-{VLLM_VERSION}-py.zip"
    size = python_zip(wheel(), target)
    print(f"{target}: vLLM {VLLM_VERSION}'s Python code, {size / 2**20:.1f} MiB")
