"""Our libnccl binding (rlhf_trainer/weight_sync/nccl.py) against the real library and
against what the pinned vLLM release's own NCCL wrapper declares (`vllm_facts.json`'s
`nccl`, extracted from `pynccl_wrapper.NCCLLibrary` and the wheel's metadata).

No GPU here: the library loads, reports its version and mints unique ids on the CPU;
opening a communicator needs CUDA, and NCCL's own error must come back, not a crash.
"""

from __future__ import annotations

import base64
import ctypes
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_trainer.rollout.servers import package_version
from rlhf_trainer.weight_sync import nccl
from rlhf_trainer.weight_sync.transport import NcclTransport

FACTS = json.loads(Path(__file__).with_name("vllm_facts.json").read_text())["nccl"]
NOT_IN_VLLM = {"ncclCommGetAsyncError", "ncclCommInitRankConfig"}  # in nccl.h; vLLM's wrapper does not use them (checked against nccl.h below)


def _pin(requirement: str) -> tuple[str, str]:
    name, _, version = requirement.partition("==")
    return name, version


def test_our_torch_is_the_pinned_vllm_torch_so_both_sides_load_one_nccl_release():
    name, version = _pin(FACTS["torch_requirement"])
    assert importlib.metadata.version(name) == version
    nccl_package, nccl_version = _pin(FACTS["nccl_requirement"])
    assert importlib.metadata.version(nccl_package) == nccl_version


def test_the_binding_loads_the_wheels_libnccl_and_reports_the_version_vllms_torch_requires():
    lib = nccl.Nccl()
    assert Path(lib.path).name == "libnccl.so.2" and "nvidia/nccl/lib" in lib.path
    _, nccl_version = _pin(FACTS["nccl_requirement"])
    assert lib.version() == tuple(int(x) for x in nccl_version.split("."))


def test_the_binding_and_torch_share_one_loaded_library():
    """torch loads the same file: one NCCL in the trainer process, not two."""
    probe = ("import torch, ctypes, sys; from rlhf_trainer.weight_sync import nccl; "
             "torch.cuda.nccl.version(); nccl.load(); "
             "maps = [l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l]; print(sorted(set(maps)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert loaded == [nccl.library_path()]


def test_every_function_we_declare_has_the_signature_vllms_wrapper_declares():
    def name(t) -> str:
        if isinstance(t, type) and issubclass(t, ctypes.Structure):
            return f"struct[{ctypes.sizeof(t)}]"
        if isinstance(t, type) and issubclass(t, ctypes._Pointer):
            return "pointer to " + name(t._type_)
        return {ctypes.c_size_t: "c_size_t"}.get(t, t.__name__)

    checked = 0
    for fn, (restype, argtypes) in nccl.FUNCTIONS.items():
        if fn in NOT_IN_VLLM:
            continue
        assert [name(restype), [name(a) for a in argtypes]] == FACTS["functions"][fn], fn
        checked += 1
    assert checked == len(nccl.FUNCTIONS) - len(NOT_IN_VLLM) >= 8
    lib = nccl.Nccl()
    assert all(hasattr(lib.lib, fn) for fn in nccl.FUNCTIONS)  # the library exports them all


def test_data_types_and_unique_id_size_are_vllms():
    for dtype, value in nccl.DATATYPES.items():
        vllm_name = "nccl" + dtype[0].upper() + dtype[1:]
        assert FACTS["datatypes"][vllm_name] == value, dtype
        assert getattr(torch, dtype).itemsize  # every name is a torch dtype (dtype_name() yields them)
    assert nccl.UNIQUE_ID_BYTES == FACTS["unique_id_bytes"] == ctypes.sizeof(nccl.NcclUniqueId)


def test_unique_ids_are_fresh_128_byte_ids_in_the_base64_form_vllm_decodes():
    lib = nccl.Nccl()
    first, second = lib.unique_id(), lib.unique_id()
    assert len(first) == len(second) == 128 and first != second and any(first)
    # vLLM's decode_nccl_unique_id: standard base64 (validate=True), 128 bytes
    transport = object.__new__(NcclTransport)
    transport.unique_id = first
    encoded = transport.rendezvous()["nccl_unique_id_b64"]
    assert base64.b64decode(encoded, validate=True) == first


def test_opening_a_communicator_without_cuda_is_nccls_own_error_not_a_crash():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    lib = nccl.Nccl()
    with pytest.raises(nccl.NcclError) as err:
        lib.comm_init_rank(1, lib.unique_id(), 0)
    assert "ncclCommInitRank failed: NCCL error" in str(err.value) and err.value.code != 0
    with pytest.raises(ValueError, match="128 bytes"):
        lib.comm_init_rank(1, b"short", 0)


def test_a_missing_library_is_named_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(nccl.LIBRARY_ENV, str(tmp_path / "libnccl.so.2"))
    with pytest.raises(OSError, match="RLHF_NCCL_LIBRARY"):
        nccl.Nccl()


def test_server_nccl_version_is_read_from_vllms_pip_list():
    listing = "numpy==2.2.6\nnvidia-nccl-cu13==2.30.7\ntorch==2.14.0\nnvidia-cublas==13.1.1.3"
    assert package_version(listing) == (2, 30, 7)
    assert package_version("torch==2.14.0") is None
    assert "nccl" in FACTS["server_info_pip_patterns"]  # vLLM's /server_info keeps these lines
