"""Regenerate `vllm_facts.json`: what the pinned vLLM release says about the protocol we
speak, taken from its own code (no vLLM code is committed, only these facts).

vLLM pins another torch than ours, so it is not a test dependency: run this once per
vLLM upgrade, in a throwaway virtual environment that sees this repository's torch plus
vLLM's pure-Python dependencies (whatever `import` asks for), with the release's wheel
unpacked beside it:

    pip download vllm==0.33.0 --no-deps --only-binary :all: -d /tmp/w
    unzip -q /tmp/w/vllm-0.33.0-*.whl 'vllm/*' 'vllm-*.dist-info/*' -d /tmp/vllm-0.33.0
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/tmp/vllm-0.33.0 python tests/protocol/extract_vllm.py /tmp/vllm-0.33.0

What it records:
- `routes`: every route of the RL router (`entrypoints/rl/online/api_router.py`) and the
  dev / info routes we call (`/reset_prefix_cache`, `/server_info`, `/version`,
  `/health`), read from the decorators and signatures: method, path, and each
  parameter's name, place (query or JSON body) and whether it is required;
- `pause_modes`: the values of `PauseMode`;
- `init_info` / `update_info`: the fields of `NCCLWeightTransferInitInfo` and
  `NCCLWeightTransferUpdateInfo` (required, or the default), from `dataclasses.fields`;
- `packed_layout`: cases run through vLLM's own `pack_tensors` (the producer) AND its
  `packed_nccl_broadcast_consumer` (run on the CPU with the CUDA stream calls stubbed):
  for tensors of given byte sizes and a buffer size, the indices in each chunk;
- `serve_options`: every option string of the real `vllm serve` argument parser
  (`make_arg_parser`), with its choices where it has any;
- `nccl`: what vLLM's NCCL side is made of: the torch its wheel requires (`Requires-Dist`)
  and the NCCL wheel that torch requires (read from the extraction environment's torch,
  which must be that same version: ours, since the trainer pins vLLM's torch), the
  ctypes signature of every function its `pynccl_wrapper.NCCLLibrary` declares, its NCCL
  data-type enum, the unique id's size, and the package patterns `/server_info` lists
  (`collect_env.DEFAULT_PIP_PATTERNS`; `--nccl-only` refreshes just these);
- `prometheus_metrics`: every `vllm:*` metric the V1 engine's Prometheus logger declares
  (`v1/metrics/loggers.py`, `perf.py`), with its kind (counter, gauge, histogram), read from
  the source's AST (`--metrics-only` refreshes just these, without importing vLLM);
- `quantization`: what `--quantization` accepts (`QuantizationMethods`), its online
  shorthands (`_ONLINE_SHORTHANDS`: quantize a bf16 checkpoint as it loads), whether plain
  `fp8` refuses a checkpoint that is not already FP8 (`Fp8Config.__init__` raising), and
  whether each weight-transfer engine reloads through vLLM's layerwise reload (which runs a
  layer's online quantization again on pushed weights), all read from the source's AST
  (`--quant-only` refreshes just these).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import random
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).with_name("vllm_facts.json")

ROUTE_FILES = [
    "vllm/entrypoints/rl/online/api_router.py",
    "vllm/entrypoints/serve/dev/cache/api_router.py",
    "vllm/entrypoints/serve/dev/server_info/api_router.py",
    "vllm/entrypoints/serve/instrumentator/basic.py",
    "vllm/entrypoints/serve/instrumentator/health.py",
]
SKIP_PARAMS = {"raw_request", "request"}


def routes(root: Path) -> list[dict]:
    found = []
    for rel in ROUTE_FILES:
        tree = ast.parse((root / rel).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
                continue
            for dec in fn.decorator_list:
                if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and dec.func.attr in ("get", "post") and dec.args
                        and isinstance(dec.args[0], ast.Constant)):
                    continue
                found.append({"method": dec.func.attr.upper(), "path": dec.args[0].value,
                              "file": rel, "params": _params(fn)})
    return sorted(found, key=lambda r: (r["path"], r["method"]))


def _params(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> list[dict]:
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
    params = []
    for arg, default in zip(args, defaults):
        if arg.arg in SKIP_PARAMS:
            continue
        source = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        where = "body" if "Body(" in source else "query"
        required = default is None
        if isinstance(default, ast.Call) and ast.unparse(default.func) in ("Query", "Body"):
            where = "body" if ast.unparse(default.func) == "Body" else "query"
            required = not default.args and not any(k.arg == "default" for k in default.keywords)
        params.append({"name": arg.arg, "in": where, "required": required, "annotation": source})
    return params


def dataclass_fields(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = {"required": False, "default": f.default}
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = {"required": False, "default": f.default_factory()}
        else:
            out[f.name] = {"required": True}
    return out


class _StubStream:
    def synchronize(self):
        pass

    def wait_event(self, event):
        pass


class _StubEvent:
    def record(self, stream=None):
        pass


class _RecordingGroup:
    """Stands for the NCCL communicator: records each broadcast's size and, on the
    receiving side, fills the buffer from the producer's chunks."""

    def __init__(self, chunks=None):
        self.sizes, self.chunks = [], list(chunks or [])

    def broadcast(self, tensor, src=0, stream=None):
        self.sizes.append(tensor.numel())
        if self.chunks:
            tensor.copy_(self.chunks.pop(0))
        else:
            self.chunks_sent = getattr(self, "chunks_sent", []) + [tensor.clone()]


def packed_layout_cases() -> list[dict]:
    import torch

    import vllm.distributed.weight_transfer.packed_tensor as pt

    # Run the CUDA-stream code on the CPU: only the stream bookkeeping is stubbed.
    pt._get_streams = lambda device_idx, n: tuple(_StubStream() for _ in range(n))
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.current_stream = lambda: _StubStream()
    torch.Event = _StubEvent
    torch.Tensor.record_stream = lambda self, s: None

    rng = random.Random(0)
    cases = [([4, 4, 4, 4], 8), ([8, 8], 8), ([9], 8), ([1, 20, 1, 1], 8), ([3, 5, 7], 15), ([3, 5, 7], 14)]
    for _ in range(30):
        sizes = [rng.choice([1, 2, 4, 8, 64, 100, 4096, 5000]) for _ in range(rng.randint(1, 25))]
        cases.append((sizes, rng.choice([1, 7, 64, 1000, 4096, 10**6])))
    out = []
    for sizes, buffer in cases:
        tensors = [(f"t{i}", torch.arange(n, dtype=torch.uint8) + i) for i, n in enumerate(sizes)]
        producer = _RecordingGroup()
        pt.packed_nccl_broadcast_producer(iter(tensors), producer, 0, lambda item: item[1],
                                          buffer_size_bytes=buffer, num_buffers=2)
        received: list[list[str]] = []
        consumer = _RecordingGroup(producer.chunks_sent)
        meta = ((name, ([t.numel()], torch.uint8)) for name, t in tensors)
        loaded = {}

        def load(pairs, received=received, loaded=loaded):
            received.append([name for name, _ in pairs])
            loaded.update({name: t.clone() for name, t in pairs})

        pt.packed_nccl_broadcast_consumer(meta, consumer, 0, load, buffer_size_bytes=buffer,
                                          num_buffers=2, device="cpu")
        assert producer.sizes == consumer.sizes, (sizes, buffer)
        assert all(torch.equal(loaded[name], t) for name, t in tensors)
        out.append({"sizes": sizes, "buffer_size_bytes": buffer, "chunk_bytes": producer.sizes,
                    "chunks": [[int(name[1:]) for name in names] for names in received]})
    return out


def serve_options() -> dict:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    return {opt: (sorted(map(str, action.choices)) if action.choices else None)
            for opt, action in sorted(parser._option_string_actions.items())}


METRIC_FILES = ["vllm/v1/metrics/loggers.py", "vllm/v1/metrics/perf.py"]


def prometheus_metrics(root: Path) -> dict[str, str]:
    """{name as declared: counter | gauge | histogram} of the engine's `vllm:*` metrics (a
    counter is exported with `_total`, a histogram as `_bucket`, `_sum`, `_count`)."""
    kinds = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}
    found = {}
    for rel in METRIC_FILES:
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            kind = kinds.get(node.func.attr)
            names = [k.value.value for k in node.keywords if k.arg == "name" and isinstance(k.value, ast.Constant)]
            if kind and names and str(names[0]).startswith("vllm:"):
                found[names[0]] = kind
    return dict(sorted(found.items()))


QUANT_METHODS_FILE = "vllm/model_executor/layers/quantization/__init__.py"
QUANT_CONFIG_FILE = "vllm/config/quantization.py"
FP8_FILE = "vllm/model_executor/layers/quantization/fp8.py"
LAYERWISE_FILE = "vllm/model_executor/model_loader/reload/layerwise.py"
ENGINE_FILES = {"nccl": "vllm/distributed/weight_transfer/nccl_engine.py",
                "ipc": "vllm/distributed/weight_transfer/ipc_engine.py"}


def _assigned(tree: ast.AST, name: str) -> ast.AST:
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node.value
    raise LookupError(name)


def _calls(fn: ast.AST) -> set[str]:
    return {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            for n in ast.walk(fn) if isinstance(n, ast.Call)}


def quantization_facts(root: Path) -> dict:
    methods = _assigned(ast.parse((root / QUANT_METHODS_FILE).read_text()), "QuantizationMethods")
    shorthands = _assigned(ast.parse((root / QUANT_CONFIG_FILE).read_text()), "_ONLINE_SHORTHANDS")
    fp8 = next(n for n in ast.walk(ast.parse((root / FP8_FILE).read_text()))
               if isinstance(n, ast.ClassDef) and n.name == "Fp8Config")
    init = next(n for n in fp8.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    refuses = any(isinstance(n, ast.Raise) and "online" in ast.unparse(n) for n in ast.walk(init))
    engines = {}
    for kind, rel in ENGINE_FILES.items():
        fns = {n.name: n for n in ast.walk(ast.parse((root / rel).read_text())) if isinstance(n, ast.FunctionDef)}
        engines[kind] = ("initialize_layerwise_reload" in _calls(fns["start_weight_update"])
                         and "finalize_layerwise_reload" in _calls(fns["finish_weight_update"]))
    return {
        "methods": sorted(e.value for e in ast.walk(methods) if isinstance(e, ast.Constant) and isinstance(e.value, str)),
        "online_shorthands": sorted(k.value for k in shorthands.keys),
        "fp8_refuses_unquantized_checkpoint": refuses,
        "engines_reload_layerwise": engines,
        "layerwise_reload_requantizes_online": "OnlineLinearBase" in (root / LAYERWISE_FILE).read_text(),
    }


def _ctype_name(t) -> str:
    """A ctypes type as a comparable string: structures by size (the name is the binding's own)."""
    import ctypes

    if t is None:
        return "void"
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return f"struct[{ctypes.sizeof(t)}]"
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return "pointer to " + _ctype_name(t._type_)
    return {ctypes.c_size_t: "c_size_t"}.get(t, t.__name__)


def nccl_facts(root: Path) -> dict:
    import importlib.metadata

    from packaging.requirements import Requirement

    (dist_info,) = root.glob("vllm-*.dist-info")
    requires = [Requirement(v) for k, v in (line.split(": ", 1) for line in
                                            (dist_info / "METADATA").read_text().splitlines() if ": " in line)
                if k == "Requires-Dist"]
    (torch_pin,) = [r for r in requires if r.name == "torch" and not r.marker]
    torch_version = str(torch_pin.specifier).removeprefix("==")
    if importlib.metadata.version("torch") != torch_version:
        raise SystemExit(f"vLLM requires torch {torch_version}; run this with that torch "
                         f"(found {importlib.metadata.version('torch')})")
    (nccl_pin,) = [Requirement(r) for r in importlib.metadata.requires("torch") if r.startswith("nvidia-nccl")]
    sys.path.insert(0, str(root))
    from vllm.collect_env import DEFAULT_PIP_PATTERNS
    from vllm.distributed.device_communicators import pynccl_wrapper as w
    from vllm.distributed.weight_transfer.nccl_common import NCCL_UNIQUE_ID_BYTES

    return {
        "torch_requirement": f"torch{torch_pin.specifier}",
        "nccl_requirement": f"{nccl_pin.name}{nccl_pin.specifier}",
        "functions": {f.name: [_ctype_name(f.restype), [_ctype_name(a) for a in f.argtypes]]
                      for f in w.NCCLLibrary.exported_functions},
        "datatypes": {k: v for k, v in vars(w.ncclDataTypeEnum).items() if k.startswith("nccl") and isinstance(v, int)},
        "unique_id_bytes": NCCL_UNIQUE_ID_BYTES,
        "server_info_pip_patterns": sorted(DEFAULT_PIP_PATTERNS),
    }


OPTIONS_MODULE = Path(__file__).resolve().parents[2] / "contract" / "rlhf_contract" / "vllm_options.py"


def write_options_module(options: dict) -> None:
    """The option names, where the contract (no test data) can read them."""
    text = OPTIONS_MODULE.read_text()
    head = text[:text.index("SERVE_OPTIONS")]
    body = textwrap.fill(" ".join(f"{name!r}," for name in sorted(options)), width=116, initial_indent="    ",
                         subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
    OPTIONS_MODULE.write_text(head + "SERVE_OPTIONS: frozenset[str] = frozenset({\n" + body + "\n})\n")


def main() -> None:
    root = Path(sys.argv[1])
    if sys.argv[2:] == ["--nccl-only"]:
        facts = json.loads(OUT.read_text())
        facts["nccl"] = nccl_facts(root)
        OUT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
        print(f"wrote {OUT}: NCCL facts, {len(facts['nccl']['functions'])} functions")
        return
    if sys.argv[2:] == ["--metrics-only"]:
        facts = json.loads(OUT.read_text())
        facts["prometheus_metrics"] = prometheus_metrics(root)
        OUT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
        print(f"wrote {OUT}: {len(facts['prometheus_metrics'])} Prometheus metrics")
        return
    if sys.argv[2:] == ["--quant-only"]:
        facts = json.loads(OUT.read_text())
        facts["quantization"] = quantization_facts(root)
        OUT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
        print(f"wrote {OUT}: quantization facts {facts['quantization']}")
        return
    sys.path.insert(0, str(root))
    import vllm
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.v1.engine import PauseMode

    facts = {
        "vllm_version": vllm.__version__,
        "regenerate": "see tests/protocol/extract_vllm.py",
        "routes": routes(root),
        "pause_modes": list(PauseMode.__args__),
        "init_info": dataclass_fields(NCCLWeightTransferInitInfo),
        "update_info": dataclass_fields(NCCLWeightTransferUpdateInfo),
        "packed_layout": packed_layout_cases(),
        "serve_options": serve_options(),
        "prometheus_metrics": prometheus_metrics(root),
        "quantization": quantization_facts(root),
        "nccl": nccl_facts(root),
    }
    OUT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    write_options_module(facts["serve_options"])
    print(f"wrote {OUT}: {len(facts['routes'])} routes, {len(facts['serve_options'])} serve options, "
          f"{len(facts['packed_layout'])} layout cases")


if __name__ == "__main__":
    main()
