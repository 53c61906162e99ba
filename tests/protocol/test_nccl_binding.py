"""Our libnccl binding (rlhf_trainer/weight_sync/nccl.py) against the real library and
against what the pinned vLLM release's own NCCL wrapper declares (`vllm_facts.json`'s
`nccl`, extracted from `pynccl_wrapper.NCCLLibrary` and the wheel's metadata).

No GPU here: the library loads, reports its version and mints unique ids on the CPU;
opening a communicator needs CUDA, and NCCL's own error must come back, not a crash.
"""

from __future__ import annotations

import base64
import importlib.util
import re
import ctypes
import importlib.metadata
import json
import os
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


# ---- the non-blocking formation's config and entry point, against the installed nccl.h ----

HEADER = Path(importlib.util.find_spec("nvidia.nccl").submodule_search_locations[0]) / "include" / "nccl.h"
C_TYPES = {"size_t": ctypes.c_size_t, "unsigned int": ctypes.c_uint, "int": ctypes.c_int,
           "const char *": ctypes.c_char_p, "ncclResult_t": ctypes.c_int, "ncclComm_t": ctypes.c_void_p,
           "ncclUniqueId": nccl.NcclUniqueId, "ncclDataType_t": ctypes.c_int, "ncclRedOp_t": ctypes.c_int,
           "cudaStream_t": ctypes.c_void_p, "const void*": ctypes.c_void_p, "void*": ctypes.c_void_p,
           "const char*": ctypes.c_char_p, "ncclConfig_t": nccl.NcclConfig}


def _header() -> str:
    return re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)


def _macro(name: str) -> str:
    return re.search(rf"^#define {name}(?!\w)(.*)$", _header(), re.M).group(1).strip()


def _header_config() -> type[ctypes.Structure]:
    """nccl.h's whole ncclConfig_t, as a ctypes struct (field names and C types from the header)."""
    body = re.search(r"typedef struct ncclConfig_v\d+ \{(.*?)\} ncclConfig_t;", _header(), re.S).group(1)
    fields = []
    for line in filter(None, (line.strip() for line in body.splitlines())):
        ctype, name = re.fullmatch(r"(.+?)\s*(\w+);", line).groups()
        fields.append((name, C_TYPES[re.sub(r"\s*\*\s*$", " *", ctype)]))
    return type("HeaderConfig", (ctypes.Structure,), {"_fields_": fields})


def _nccl_version(x: int, y: int, z: int) -> int:
    """nccl.h's NCCL_VERSION macro, evaluated as the header writes it."""
    expr = _macro(r"NCCL_VERSION\(X,Y,Z\)").replace("(X)", str(x)).replace("(Y)", str(y)).replace("(Z)", str(z))
    cond, yes, no = re.fullmatch(r"\(\((.*)\) \? (.*) : (.*)\)", expr).groups()
    return eval(yes if eval(cond.replace("&&", "and")) else no)


def test_our_config_is_the_head_of_the_headers_ncclconfig_t():
    header = _header_config()
    ours = nccl.NcclConfig._fields_
    assert [name for name, _ in header._fields_[:len(ours)]] == [name for name, _ in ours] == \
        ["size", "magic", "version", "blocking"]
    for (name, ctype), (_, header_type) in zip(ours, header._fields_):
        assert ctype is header_type, name
        assert getattr(nccl.NcclConfig, name).offset == getattr(header, name).offset, name
    # `size` covers our fields exactly: the header's next field starts where ours end (no
    # padding byte of ours lands on it), and NCCL copies min(size, its sizeof) bytes
    next_field = header._fields_[len(ours)][0]
    assert nccl.CONFIG_BYTES == getattr(header, next_field).offset == 20 < ctypes.sizeof(header)
    assert nccl.nonblocking_config().size == nccl.CONFIG_BYTES


def test_our_magic_and_version_are_the_headers():
    config = nccl.nonblocking_config()
    assert config.magic == nccl.NCCL_API_MAGIC == int(_macro("NCCL_API_MAGIC"), 16)
    assert config.version == nccl.NCCL_VERSION_2_14 == _nccl_version(2, 14, 0)
    assert _nccl_version(2, 14, 0) <= int(_macro("NCCL_VERSION_CODE"))  # the header's own release is newer
    assert config.blocking == 0
    assert int(_macro("NCCL_CONFIG_UNDEF_INT").replace("INT_MIN", str(-2 ** 31))) != 0  # 0 is a value, not "unset"


def test_every_function_we_declare_has_the_headers_prototype():
    """Not only vLLM's view: ncclCommInitRankConfig and ncclCommGetAsyncError, which vLLM's
    wrapper does not declare, against nccl.h itself."""
    def ctype(declaration: str):
        """A C parameter or return type ("ncclComm_t* comm", "const void* sendbuff") as ctypes."""
        ctype_ = re.sub(r"\s*\*", "*", declaration.strip())
        if ctype_.endswith("*"):
            base = ctype_[:-1].strip()
            return {"const void": ctypes.c_void_p, "void": ctypes.c_void_p,
                    "const char": ctypes.c_char_p}.get(base) or ctypes.POINTER(C_TYPES[base])
        return C_TYPES[ctype_]

    for fn, (restype, argtypes) in nccl.FUNCTIONS.items():
        match = re.search(rf"^(ncclResult_t|const char\s*\*)\s+{fn}\(([^)]*)\);", _header(), re.M)
        assert match, fn
        ret, args = match.groups()
        params = [re.fullmatch(r"(.*?)\s*\b\w+", " ".join(arg.split())).group(1) for arg in args.split(",")]
        assert ctype(ret) is restype, fn  # ctypes.POINTER(t) is one cached type per t: `is` compares them
        assert [ctype(p) for p in params] == argtypes, fn
    assert nccl.FUNCTIONS["ncclCommInitRankConfig"][1][-1] is ctypes.POINTER(nccl.NcclConfig)


INIT_CONFIG_PROBE = """
import sys
from rlhf_trainer.weight_sync import nccl
lib = nccl.Nccl()
config = nccl.nonblocking_config()
if sys.argv[1] == "wrong magic":
    config.magic ^= 0xFFFF
try:
    print("handle", lib.comm_init_rank_nonblocking(1, lib.unique_id(), 0, config))
except nccl.NcclError as exc:
    print("code", exc.code, exc)
"""


def _init_config(kind: str) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", INIT_CONFIG_PROBE, kind], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NCCL_DEBUG": "WARN"})
    assert out.returncode == 0, out.stderr[-2000:]  # NCCL's answer, not a crash
    return out.stdout.strip().splitlines()[-1], out.stdout + out.stderr  # NCCL_DEBUG writes to stdout


def test_the_real_ncclcomminitrankconfig_without_cuda_answers_its_cuda_error_not_a_config_error():
    """What the library answers here, for real: NCCL's ncclCommInitRankConfig asks CUDA for
    the current device (src/init.cc, `CUDACHECK(cudaGetDevice(&cudaDev))`) before it parses the
    config (`parseCommConfig`, inside ncclCommInitRankDev, after `cudaFree(NULL)`), so without
    CUDA the answer is "unhandled cuda error" (1), never the config's "invalid argument" (4),
    and a wrong magic gets the same answer: on the CPU our struct is not read yet. That it is
    read, and accepted, only shows where CUDA is (bench/gpu_check_pair.py's non-blocking case
    forms a group with it)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    ours, warnings = _init_config("ours")
    assert ours.startswith("code 1 ncclCommInitRankConfig failed: NCCL error 1: unhandled cuda error"), ours
    assert "(ncclCommInitRankConfig) NCCL WARN Cuda failure" in warnings
    assert "ncclConfig_t argument not initialized" not in warnings and "invalid argument" not in ours
    wrong, wrong_warnings = _init_config("wrong magic")
    assert wrong == ours  # the same answer: the config was not reached (see the docstring)
    assert "ncclConfig_t argument not initialized" not in wrong_warnings
