"""Our side of the protocol against vLLM itself, not against our own CPU engine.

`vllm_facts.json` was produced by `extract_vllm.py` from the pinned release's own code
(its routes and signatures, its init_info / update_info dataclasses, its packed
producer and consumer run on the CPU, its `vllm serve` argument parser). A misreading
of vLLM shared by the sender and the CPU engine fails here.
"""

from __future__ import annotations

import base64
import json
import shlex
import socket
from pathlib import Path

import httpx
import yaml
import pytest
import torch

from rlhf_contract.api.load import load_job
from rlhf_contract.images import VLLM_VERSION
from rlhf_contract.pod import rollout_process, serve_command
from rlhf_inference.cpu_engine import weights as cpu_weights
from rlhf_inference.cpu_engine.engine import PAUSE_MODES
from rlhf_trainer.weight_sync import WeightSyncSender, bucket_ranges, pack_buckets
from rlhf_trainer.weight_sync.buckets import BufferRing
from rlhf_trainer.weight_sync.transport import NcclTransport

FACTS = json.loads(Path(__file__).with_name("vllm_facts.json").read_text())
ROOT = Path(__file__).resolve().parents[2]
ROUTES = {(r["method"], r["path"]): r for r in FACTS["routes"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_facts_are_from_the_pinned_release():
    assert FACTS["vllm_version"] == VLLM_VERSION


# ---- packed layout -------------------------------------------------------------------

@pytest.mark.parametrize("case", FACTS["packed_layout"], ids=lambda c: f"{len(c['sizes'])}x-buf{c['buffer_size_bytes']}")
def test_bucket_layout_equals_vllms_producer_and_consumer(case):
    sizes, buffer = case["sizes"], case["buffer_size_bytes"]
    assert [list(r) for r in bucket_ranges(sizes, buffer)] == case["chunks"]  # sender
    assert list(cpu_weights.packed_buckets(sizes, buffer)) == case["chunks"]  # CPU engine receiver
    tensors = [torch.full((n,), i % 251, dtype=torch.uint8) for i, n in enumerate(sizes)]
    assert [b.numel() for b in pack_buckets(tensors, buffer)] == case["chunk_bytes"]
    # the sender's reused buffers give the same bytes, bucket by bucket
    ring = BufferRing("cpu", count=3)
    for got, idx in zip(pack_buckets(tensors, buffer, ring), case["chunks"], strict=True):
        assert torch.equal(got, torch.cat([tensors[i] for i in idx]))


# ---- payloads ------------------------------------------------------------------------

def _fields(name: str) -> dict:
    return FACTS[name]


def test_cpu_engine_payload_classes_are_vllms_field_for_field():
    import dataclasses

    for ours, theirs in ((cpu_weights.InitInfo, _fields("init_info")), (cpu_weights.UpdateInfo, _fields("update_info"))):
        got = {}
        for f in dataclasses.fields(ours):
            if f.default is not dataclasses.MISSING:
                got[f.name] = {"required": False, "default": f.default}
            elif f.default_factory is not dataclasses.MISSING:
                got[f.name] = {"required": False, "default": f.default_factory()}
            else:
                got[f.name] = {"required": True}
        assert got == theirs
    assert PAUSE_MODES == tuple(FACTS["pause_modes"])


def check_init_info(info: dict) -> None:
    fields = _fields("init_info")
    assert set(info) <= set(fields), f"vLLM's NCCLWeightTransferInitInfo has no {set(info) - set(fields)}"
    assert {n for n, f in fields.items() if f["required"]} <= set(info)
    uid = bool(info.get("nccl_unique_id_b64"))
    tcp = "master_address" in info or "master_port" in info
    assert uid != tcp, "exactly one rendezvous mode, as vLLM's decode_nccl_unique_id requires"
    if uid:
        assert len(base64.b64decode(info["nccl_unique_id_b64"], validate=True)) == 128
    else:
        assert isinstance(info["master_address"], str) and isinstance(info["master_port"], int)
    assert info["packed"] is True and info["packed_buffer_size_bytes"] > 0


def check_call(method: str, path: str, params: dict | None, body: dict | None) -> None:
    route = ROUTES.get((method, path))
    assert route is not None, f"vLLM {VLLM_VERSION} has no {method} {path}"
    declared = {p["name"]: p for p in route["params"]}
    for name in params or {}:
        assert declared.get(name, {}).get("in") == "query", f"{path} takes no query parameter {name!r}"
    for name in body or {}:
        assert declared.get(name, {}).get("in") == "body", f"{path} takes no body field {name!r}"
    for p in route["params"]:
        if p["required"] and p["in"] == "body":
            assert p["name"] in (body or {}), f"{path} requires {p['name']!r}"
    if path == "/init_weight_transfer_engine":
        check_init_info(body["init_info"])
    if path == "/update_weights":
        assert set(body["update_info"]) == set(_fields("update_info"))
    if path == "/pause":
        assert params["mode"] in FACTS["pause_modes"]


class RecordingSender(WeightSyncSender):
    """The real sender, recording every HTTP call it makes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded: list[tuple] = []

    def _call(self, method, endpoint, path, body=None, *, params=None, timeout=None):
        self.recorded.append((method, path, params, body))
        return super()._call(method, endpoint, path, body, params=params, timeout=timeout)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, start_engines):
    with start_engines(tiny_model_dir, 1) as urls:
        yield urls[0]


def test_every_call_of_the_sender_is_a_vllm_route_with_vllms_fields(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = {n: p.detach() for n, p in model.named_parameters()}
    meta = [(n, list(t.shape), t.dtype) for n, t in params.items()]
    sender = RecordingSender([engine], "127.0.0.1", free_port(), bucket_bytes=8192, timeout_s=60)
    try:
        sender.init()
        sender.send(meta, iter(params.values()), weight_version="1")
        sender.send(meta, iter(params.values()), weight_version="2")
    finally:
        sender.close()
    for method, path, query, body in sender.recorded:
        check_call(method, path, query, body)
    posts = [path for method, path, _, _ in sender.recorded if method == "POST"]
    one_round = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                 "/reset_prefix_cache", "/resume"]
    assert posts == ["/init_weight_transfer_engine", *one_round, *one_round]
    updates = [body["update_info"] for _, path, _, body in sender.recorded if path == "/update_weights"]
    assert updates[0]["names"] == list(params) and updates[1] == {"names": [], "dtype_names": [], "shapes": []}


def test_an_in_flight_round_pauses_with_vllms_keep_mode_and_resets_running_requests(engine, tiny_model_dir):
    """rollout.inFlightUpdates: /pause?mode=keep (a PauseMode of vLLM's) and, since paused
    requests hold KV blocks, one /reset_prefix_cache with vLLM's reset_running_requests query."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = {n: p.detach() for n, p in model.named_parameters()}
    meta = [(n, list(t.shape), t.dtype) for n, t in params.items()]
    sender = RecordingSender([engine], "127.0.0.1", free_port(), bucket_bytes=8192, timeout_s=60, pause_mode="keep")
    try:
        sender.init()
        sender.send(meta, iter(params.values()), weight_version="1")
    finally:
        sender.close()
    for method, path, query, body in sender.recorded:
        check_call(method, path, query, body)
    round_ = [(path, query) for method, path, query, _ in sender.recorded if method == "POST"][1:]
    assert round_ == [("/pause", {"mode": "keep"}), ("/start_weight_update", None), ("/update_weights", None),
                      ("/finish_weight_update", None), ("/reset_prefix_cache", {"reset_running_requests": "true"}),
                      ("/resume", None)]
    assert "keep" in FACTS["pause_modes"]


def test_nccl_init_info_is_the_unique_id_mode_vllm_accepts():
    transport = object.__new__(NcclTransport)  # no GPU here: only the payload is checked
    transport.unique_id = bytes(range(128))
    info = {**transport.rendezvous(), "world_size": 3, "rank_offset": 1, "packed": True,
            "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}
    check_init_info(info)


def test_startup_check_uses_vllm_routes():
    check_call("GET", "/version", None, None)
    check_call("GET", "/server_info", {"config_format": "json"}, None)
    check_call("GET", "/get_world_size", None, None)
    check_call("GET", "/health", None, None)


def test_cpu_engine_serves_the_vllm_routes_it_claims(engine):
    # exercise the real server: every vLLM route we rely on answers something other than 404/405
    used = ["/health", "/version", "/server_info", "/get_world_size", "/is_paused", "/weight_info",
            "/pause", "/resume", "/reset_prefix_cache", "/init_weight_transfer_engine",
            "/shutdown_weight_transfer_engine", "/start_weight_update", "/update_weights",
            "/finish_weight_update", "/update_weight_version", "/weight_checker"]
    for (method, path), route in ROUTES.items():
        if path not in used:
            continue
        query = {p["name"]: "true" if "bool" in p["annotation"] else "x" for p in route["params"] if p["in"] == "query"}
        if path == "/pause":
            query["mode"] = "keep"
        if path == "/server_info":
            query["config_format"] = "json"
        reply = httpx.request(method, engine + path, params=query, json={} if method == "POST" else None, timeout=30)
        assert reply.status_code not in (404, 405), f"CPU engine lacks {method} {path}"
        assert reply.status_code != 422, f"CPU engine rejects vLLM's query parameters of {path}: {reply.text}"
    httpx.post(engine + "/resume")


# ---- the launcher's command line -----------------------------------------------------

def _flags(command: list[str]) -> list[tuple[str, str | None]]:
    out, i = [], 0
    while i < len(command):
        if command[i].startswith("--") and "=" in command[i]:
            out.append(tuple(command[i].split("=", 1)))
            i += 1
        elif command[i].startswith("--"):
            value = command[i + 1] if i + 1 < len(command) and not command[i + 1].startswith("--") else None
            out.append((command[i], value))
            i += 2 if value is not None else 1
        else:
            i += 1
    return out


@pytest.mark.parametrize("example", ["examples/rlhfjob.yaml"])
def test_the_example_jobs_rollout_command_is_accepted_by_vllms_parser(example):
    job = load_job(ROOT / example)
    assert job.spec.rollout.engine == "vllm"
    process = rollout_process(job, model_path=job.spec.model.path, host="0.0.0.0", port=8000)
    command = process.command
    assert command[:3] == ["vllm", "serve", job.spec.model.path]
    assert process.env["VLLM_SERVER_DEV_MODE"] == "1"  # the weight-transfer routes exist only then
    options = FACTS["serve_options"]
    for flag, value in _flags(command):
        assert flag in options, f"vLLM {VLLM_VERSION}'s `vllm serve` does not accept {flag}: {shlex.join(command)}"
        if options[flag] is not None:
            assert value in options[flag], f"{flag} {value}: vLLM accepts {options[flag]}"
    transfer = json.loads(dict(_flags(command))["--weight-transfer-config"])
    assert transfer == {"backend": "nccl"}


def test_the_judge_servers_command_is_accepted_by_vllms_parser():
    from rlhf_contract.pod import JUDGE_SERVED_MODEL, judge_process

    doc = yaml.safe_load((ROOT / "examples/rlhfjob.yaml").read_text())
    doc["spec"]["reward"] = {"type": "math", "components": [{"name": "judge", "type": "judge",
                                                             "judge": {"model": "/models/judge"}}]}
    from rlhf_contract.api.load import validate_job

    command = judge_process(validate_job(doc), host="0.0.0.0", port=8000).command
    assert command[:3] == ["vllm", "serve", "/models/judge"]
    options = FACTS["serve_options"]
    for flag, value in _flags(command):
        assert flag in options, f"vLLM {VLLM_VERSION}'s `vllm serve` does not accept {flag}: {shlex.join(command)}"
        if options[flag] is not None:
            assert value in options[flag], f"{flag} {value}: vLLM accepts {options[flag]}"
    assert dict(_flags(command))["--served-model-name"] == JUDGE_SERVED_MODEL


def test_the_contracts_option_list_is_the_extracts():
    from rlhf_contract.vllm_options import SERVE_OPTIONS

    assert SERVE_OPTIONS == set(FACTS["serve_options"])


def test_rollout_vllm_settings_become_flags_vllms_parser_accepts():
    from rlhf_contract.api.load import validate_job

    doc = yaml.safe_load((ROOT / "examples/rlhfjob.yaml").read_text())
    doc["spec"]["rollout"]["vllm"] = {"gpuMemoryUtilization": 0.85, "maxNumSeqs": 128, "maxNumBatchedTokens": 8192,
                                      "enablePrefixCaching": False, "enforceEager": True,
                                      "extraArgs": ["--kv-cache-dtype", "fp8", "--block-size=32"]}
    job = validate_job(doc)
    command = serve_command(job.spec, model_path="/m", host="h", port=1, name="n")
    flags = dict(_flags(command))
    options = FACTS["serve_options"]
    for flag, value in _flags(command):
        assert flag in options, flag
        if options[flag] is not None and value is not None:
            assert value in options[flag], f"{flag} {value}: vLLM accepts {options[flag]}"
    assert flags["--gpu-memory-utilization"] == "0.85" and flags["--max-num-seqs"] == "128"
    assert "--no-enable-prefix-caching" in command and "--enforce-eager" in command
    assert command[-3:] == ["--kv-cache-dtype", "fp8", "--block-size=32"]


def test_serve_command_for_every_dtype_is_accepted():
    job = load_job(ROOT / "examples/rlhfjob.yaml")
    for dtype in ("auto", "bfloat16", "float16", "float32"):
        spec = job.spec.model_copy(update={"model": job.spec.model.model_copy(update={"dtype": dtype})})
        command = serve_command(spec, model_path="/m", host="h", port=1, name="n")
        assert dict(_flags(command))["--dtype"] in FACTS["serve_options"]["--dtype"]


def test_a_colocated_jobs_servers_get_sleep_mode_from_flags_vllms_parser_accepts():
    """Colocated placement: `--enable-sleep-mode` (vLLM's /sleep and /wake_up routes, with
    VLLM_SERVER_DEV_MODE=1); refused in extraArgs, where it would bypass the placement."""
    from rlhf_contract.api.load import JobError, validate_job

    doc = yaml.safe_load((ROOT / "examples/rlhfjob.yaml").read_text())
    separate = validate_job(doc)
    doc["spec"]["rollout"]["placement"] = "colocated"
    with pytest.raises(JobError, match="rollout.vllm.kvCacheMemoryBytes: is required"):
        validate_job(doc)  # the KV cache in bytes: the trainer's state shares the GPU
    doc["spec"]["rollout"]["vllm"] = {"kvCacheMemoryBytes": 20 * 2**30}
    job = validate_job(doc)
    command = serve_command(job.spec, model_path="/m", host="h", port=1, name="n")
    assert "--enable-sleep-mode" in command and dict(_flags(command))["--kv-cache-memory-bytes"] == str(20 * 2**30)
    assert "--enable-sleep-mode" not in serve_command(separate.spec, model_path="/m", host="h", port=1, name="n")
    # on the trainer's GPUs the weights come by CUDA IPC (NCCL refuses two processes on a GPU), and
    # vLLM's ipc engine unpickles the handles only with VLLM_ALLOW_INSECURE_SERIALIZATION=1
    assert json.loads(dict(_flags(command))["--weight-transfer-config"]) == {"backend": "ipc"}
    assert rollout_process(job, model_path="/m", host="127.0.0.1", port=1).env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in rollout_process(separate, model_path="/m", host="h", port=1).env
    for flag, value in _flags(command):
        assert flag in FACTS["serve_options"], flag
    doc["spec"]["rollout"]["vllm"] = {"extraArgs": ["--enable-sleep-mode"]}
    with pytest.raises(JobError, match="rollout.placement"):
        validate_job(doc)


def test_rank_offsets_and_world_size_across_tensor_parallel_servers():
    """Two servers with 2 and 4 workers (tensorParallelSize): world = 1 + 2 + 4, the
    second server's workers start at rank 3 (vLLM ranks a worker rank_offset + its rank)."""
    import http.server
    import threading

    from rlhf_trainer.weight_sync import WeightSyncError

    def serve(world_size: int) -> http.server.ThreadingHTTPServer:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                replies = {"/version": {"version": "0.33.0"}, "/get_world_size": {"world_size": world_size},
                           "/server_info": {"vllm_config": {"weight_transfer_config": {"backend": "gloo"}}}}
                body = json.dumps(replies.get(self.path.split("?")[0], {})).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # refuses to join: the init fails after the bodies are recorded
                self.send_response(503)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd

    servers = [serve(2), serve(4)]
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    sender = RecordingSender(urls, "127.0.0.1", free_port(), timeout_s=5)
    try:
        with pytest.raises(WeightSyncError, match="HTTP 503"):
            sender.init()
    finally:
        sender.close()
        for s in servers:
            s.shutdown()
    inits = [body["init_info"] for method, path, _, body in sender.recorded if path == "/init_weight_transfer_engine"]
    assert sorted((i["rank_offset"], i["world_size"]) for i in inits) == [(1, 7), (3, 7)]
    for info in inits:
        check_init_info(info)
    assert sender.group is None


def test_an_ipc_round_calls_vllms_routes_in_the_nccl_rounds_order():
    """Servers that say `{"backend": "ipc"}` (colocated): no group is formed; a round is
    /pause, /start_weight_update, one /update_weights per bucket, /finish_weight_update,
    /reset_prefix_cache, /resume, every one a route of vLLM's RL router with its fields
    (the ipc bodies themselves are checked against vLLM's dataclasses in tests/vllm)."""
    import http.server
    import threading

    from rlhf_trainer.weight_sync import ipc

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            replies = {"/version": {"version": "0.33.0"}, "/get_world_size": {"world_size": 2},
                       "/server_info": {"vllm_config": {"weight_transfer_config": {"backend": "ipc"},
                                                        "model_config": {"dtype": "torch.bfloat16"}}}}
            self._reply(replies.get(self.path.split("?")[0], {}))

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self._reply({"success": True} if self.path.startswith("/reset_prefix_cache") else {})

        def _reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    sender = RecordingSender([f"http://127.0.0.1:{httpd.server_address[1]}"], "127.0.0.1", free_port(), timeout_s=10)
    meta = [("a", [2, 3], torch.bfloat16), ("b", [4], torch.bfloat16)]
    try:
        sender.init()
        assert sender.backend == "ipc" and sender.group is None
        sender.begin_ipc_round()
        for part in (meta[:1], meta[1:]):
            sender.send_ipc_bucket(ipc.update_info(part, {"GPU-x": tuple(range(15))}))
        sender.end_ipc_round("1")
    finally:
        sender.close()
        httpd.shutdown()
    posts = [(path, body) for method, path, _, body in sender.recorded if method == "POST"]
    assert [p for p, _ in posts] == ["/init_weight_transfer_engine", "/pause", "/start_weight_update",
                                     "/update_weights", "/update_weights", "/finish_weight_update",
                                     "/reset_prefix_cache", "/resume"]
    assert posts[0][1] == {"init_info": {"packed": True}}
    for method, path, query, body in sender.recorded:
        if path in ("/init_weight_transfer_engine", "/update_weights"):  # ipc bodies: tests/vllm
            assert set(body) == {p["name"] for p in ROUTES[(method, path)]["params"] if p["in"] == "body"}
        else:
            check_call(method, path, query, body)


# ---- FP8 rollouts ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8", "fp8_per_block", "fp8_per_tensor", "fp8_per_channel"])
def test_fp8_rollouts_are_an_online_scheme_that_requantizes_pushed_weights(name):
    """`rollout.vllm.quantization` becomes a `--quantization` value vLLM's parser takes, and one
    of its online schemes: the servers load the policy's bf16 weights, which vLLM's own `fp8`
    refuses (it wants an FP8 checkpoint). Weight pushes go through both engines' layerwise
    reload, which runs a layer's online quantization again on the weights it receives."""
    from rlhf_contract.api.load import validate_job

    quant = FACTS["quantization"]
    doc = yaml.safe_load((ROOT / "examples/rlhfjob.yaml").read_text())
    doc["spec"]["rollout"]["vllm"] = {"quantization": name}
    job = validate_job(doc)
    command = serve_command(job.spec, model_path="/m", host="h", port=1, name="n")
    value = dict(_flags(command))["--quantization"]
    assert "--quantization" in FACTS["serve_options"]
    assert value in quant["methods"] and value in quant["online_shorthands"], value
    # a plain `--quantization fp8` would fail at start on a bf16 checkpoint
    assert quant["fp8_refuses_unquantized_checkpoint"] and value != "fp8"
    assert quant["engines_reload_layerwise"] == {"nccl": True, "ipc": True}
    assert quant["layerwise_reload_requantizes_online"]


def test_quantization_flags_are_refused_in_extra_args():
    from rlhf_contract.api.load import JobError, validate_job

    doc = yaml.safe_load((ROOT / "examples/rlhfjob.yaml").read_text())
    for args in (["--quantization", "fp8"], ["--quantization-config", "{}"], ["-q", "fp8"]):
        doc["spec"]["rollout"]["vllm"] = {"extraArgs": args}
        with pytest.raises(JobError, match="rollout.vllm.quantization"):
            validate_job(doc)


def test_a_multi_node_servers_leader_and_worker_commands_are_accepted_by_vllms_parser():
    """rollout.nodesPerServer 2: the leader (rank 0, HTTP) and the headless worker, each flag one
    vLLM's `vllm serve` has; the values LWS's env gives them are Kubernetes `$(VAR)`s."""
    from rlhf_contract.api.load import JobError, validate_job
    from rlhf_contract.pod import multinode_flags

    doc = yaml.safe_load((ROOT / "examples/rlhfjob.yaml").read_text())
    doc["spec"]["rollout"].update(tensorParallelSize=8, nodesPerServer=2)
    job = validate_job(doc)
    base = serve_command(job.spec, model_path="/m", host="h", port=1, name="n")
    options = FACTS["serve_options"]
    for leader in (True, False):
        command = base + multinode_flags(job.spec, leader=leader)
        flags = dict(_flags(command))
        for flag, value in _flags(command):
            assert flag in options, f"vLLM {VLLM_VERSION}'s `vllm serve` does not accept {flag}: {shlex.join(command)}"
        assert flags["--nnodes"] == "$(LWS_GROUP_SIZE)" and flags["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
        assert flags["--node-rank"] == ("0" if leader else "$(LWS_WORKER_INDEX)")
        assert ("--headless" in command) is not leader
        assert flags["--tensor-parallel-size"] == "8"  # the whole group's ranks
    one_node = validate_job(yaml.safe_load((ROOT / "examples/rlhfjob.yaml").read_text()))
    assert multinode_flags(one_node.spec, leader=True) == []
    doc["spec"]["rollout"]["vllm"] = {"extraArgs": ["--nnodes", "2"]}  # the operator's, from nodesPerServer
    with pytest.raises(JobError, match="rollout.nodesPerServer"):
        validate_job(doc)
