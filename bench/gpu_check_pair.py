"""`make gpu-check`'s `pair` and `failures` parts: the real sender (trainer rank 0) pushing
weights to receiving processes (bench/gpu_check_receiver.py) over NCCL on one GPU, and the
failures injected into that pair.

Two ranks on one GPU: NCCL refuses them only when their host hashes match, so every
process gets its own `NCCL_HOSTID` and they talk over NCCL's network transport on loopback
(`NCCL_SOCKET_IFNAME=lo`; NCCL calls this setup unsupported). Every process logs with
`NCCL_DEBUG=INFO` into its own `NCCL_DEBUG_FILE`, and the report names the network NCCL
chose ("Using network ...") and the channels' transport ("... via NET/Socket/0").

The trainer side runs as the trainer does: the real launcher (`rlhf_trainer.launch`: its
marker file and exit-code rule) starts the real `rlhf_trainer.main.main()`, whose run loop
is `PairLoop` instead of the RL loop: it builds the `WeightSyncSender` as `RunLoop` does
(endpoints, the weight-sync address, `rollout.weightSyncTimeoutSeconds`), forms the group
from the servers' handshake and sends a Qwen2-shaped set of bf16 weights (deterministic
random values). A failed sync so ends the way it ends in a job: main's WeightSyncError path
(`threads.exit_process`, exit 75), a config error 2.

    pair      one and then two receivers, a 1.5B-shaped set: the sha256 of every tensor
              on both sides, GB/s of /update_weights labelled by the network NCCL chose;
    failures  receiver killed (SIGKILL) and stopped (SIGSTOP) mid-transfer, a receiver that
              never joins (all: exit 75), a bad NCCL_SOCKET_IFNAME in the trainer (exit 2),
              each within its deadline; on the GPU also "never joins" with the formation in
              NCCL's non-blocking mode (NCCL_ONLY: exit 75, formation aborted or not).

The same harness runs on the CPU with backend "gloo" (the sender's GlooTransport, the
receivers joining as the CPU engine does) and tiny shapes: tests/unit/test_gpu_check_pair.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from tensor_digest import sha256

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RECEIVER = BENCH / "gpu_check_receiver.py"
QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
"""bench/gpu_check_parts.py QWEN2_SHAPES["1.5b"] (the fields the weights' shapes depend on)."""
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
SHAPES = {"1.5b": QWEN2_1_5B, "tiny": TINY}
SPEC_ENV = "GPU_CHECK_PAIR_SPEC"
EXPECTED = {"killed": 75, "stopped": 75, "never joins": 75, "bad interface": 2}
"""ExitCode.WEIGHT_SYNC for a lost peer, ExitCode.CONFIG_ERROR for a wrong interface name."""
NONBLOCKING = "never joins (non-blocking formation)"
NCCL_ONLY = {NONBLOCKING: 75}
"""Cases of the `failures` part on the GPU only: "never joins" with the trainer forming the
group in NCCL's non-blocking mode (RLHF_NCCL_NONBLOCKING_INIT=1): exit 75 within the same
deadline, and the report says whether the trainer's log shows the formation aborted. Not on
the CPU: the gloo harness has no NCCL formation to abort (GlooTransport ignores the variable),
so the case would only repeat "never joins"."""
FORMATION_ABORTED = "aborting the non-blocking formation"
"""What the trainer logs when it aborts a formation that did not finish (transport.py)."""
BAD_INTERFACE = "doesnotexist0"
REACH_S = 180.0
"""How long the trainer may take to reach the receiver's held bucket (start-up, init, packing)."""


# ---- weights -----------------------------------------------------------------------------

def qwen2_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of a Qwen2 model of config `c`, in Hugging Face's order and names."""
    h, inter, head = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)), (p + "mlp.down_proj.weight", (h, inter)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (c["vocab_size"], h)))
    return out


def make_weights(shape: str, device, seed: int = 0) -> dict:
    """Deterministic random bf16 values for every tensor of `SHAPES[shape]`."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(dims, device=device, generator=gen).to(torch.bfloat16)
            for name, dims in qwen2_tensors(SHAPES[shape])}



# ---- NCCL's log ----------------------------------------------------------------------------

# NCCL 2.28.9 (src/debug.cc): an INFO line is "[%F %T] " (NCCL_DEBUG_TIMESTAMP_FORMAT's default),
# "%s:%d:%d " (host:pid:tid), "[%d] NCCL INFO " (CUDA device), then the call site's format:
#   src/init.cc          "Using network %s"  (comm->ncclNet->name: "IB", "Socket", a plugin's)
#   src/transport/net.cc "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s" (and [receive])
#   src/transport/p2p.cc "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/..."; shm.cc "... via SHM/%s/%s"
USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
CHANNEL = re.compile(r"NCCL INFO Channel \d+/\d+ : \d+\[\d+\] -> \d+\[\d+\] (?:\[(send|receive)\] )?via (\S+)")
VERSION = re.compile(r"NCCL version (\S+)")
WARN = re.compile(r"NCCL WARN (.*?)\s*$")  # "[%d] %s:%d NCCL WARN " (src/debug.cc) then the call site's


def parse_nccl_log(text: str) -> dict:
    """What NCCL's INFO log says of its transport: the network it loaded (`network`), the
    distinct transports its channels were set up over (`via`, e.g. "NET/Socket/0"), its
    version line, and its first WARN lines (why a communicator was refused)."""
    networks, via, version, warnings = [], [], None, []
    for line in text.splitlines():
        if m := WARN.search(line):
            warnings.append(m.group(1))
        elif m := USING_NETWORK.search(line):
            networks.append(m.group(1)) if m.group(1) not in networks else None
        elif m := CHANNEL.search(line):
            via.append(m.group(2)) if m.group(2) not in via else None
        elif version is None and (m := VERSION.search(line)):
            version = m.group(1)
    return {"network": networks[0] if len(networks) == 1 else (networks or None), "via": via, "version": version,
            "warnings": warnings[:10]}


def network_label(parsed: dict) -> str:
    if not parsed.get("network"):
        return "no NCCL log"
    via = ", ".join(parsed["via"]) or "no channel lines"
    return f"{parsed['network']} ({via})"


# ---- the trainer side -----------------------------------------------------------------------

class PairLoop:
    """main.py's run loop for this check: the sender as RunLoop builds it, one send per round."""

    def __init__(self, config, info, *, endpoints: list[str], weight_sync_addr: str, output_dir: str):
        from rlhf_trainer.weight_sync import WeightSyncSender

        self.spec, self.info = json.loads(os.environ[SPEC_ENV]), info
        host, port = weight_sync_addr.rsplit(":", 1)
        self.sender = WeightSyncSender(endpoints, host, int(port), timeout_s=config.rollout_weight_sync_timeout_seconds,
                                       pause_mode=config.sampling.weight_update_pause_mode,
                                       **({"bucket_bytes": self.spec["bucket_bytes"]} if self.spec.get("bucket_bytes")
                                          else {}))

    def resume_if_possible(self) -> None:
        pass

    def run(self) -> None:
        self._init()
        weights = make_weights(self.spec["shape"], self.info.device)
        meta = [(n, list(t.shape), t.dtype) for n, t in weights.items()]
        rounds = []
        for r in range(self.spec.get("rounds", 1)):
            stats = self.sender.send(meta, iter(weights.values()), weight_version=str(r + 1))
            rounds.append({**stats, "update_seconds": self.sender.phase_seconds.get("/update_weights")})
        result = {"backend": self.sender.backend, "world_size": self.sender.world_size, "rounds": rounds,
                  "checksums": {n: sha256(t) for n, t in weights.items()}}
        Path(self.spec["result"]).write_text(json.dumps(result))
        self.sender.close()

    def _init(self) -> None:
        if not self.spec.get("cpu_nccl"):
            return self.sender.init()
        # On a machine without CUDA only: past NcclTransport's CUDA check (as the unit tests do), so
        # the real ncclGetUniqueId runs with this process's NCCL_SOCKET_IFNAME
        import torch

        saved = torch.cuda.is_available, torch.cuda.current_device
        torch.cuda.is_available, torch.cuda.current_device = (lambda: True), (lambda: 0)
        try:
            self.sender.init()
        finally:
            torch.cuda.is_available, torch.cuda.current_device = saved


def trainer_process() -> None:
    """`rlhf_trainer.main.main()`, with PairLoop as its RL loop."""
    loop = types.ModuleType("rlhf_trainer.rl.loop")
    loop.RunLoop = PairLoop
    sys.modules["rlhf_trainer.rl.loop"] = loop
    from rlhf_trainer.main import main

    main()


def launcher_process() -> int:
    """The trainer pod's launcher (`rlhf_trainer.launch.main`) with the worker command
    pointed at `trainer_process` (a world of one: no torchrun)."""
    from rlhf_trainer import launch

    popen_kept = launch.popen_kept
    launch.popen_kept = lambda command, env: popen_kept([sys.executable, str(Path(__file__).resolve()), "--trainer"],
                                                        env)
    return launch.main([])


# ---- the harness ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_config(path: Path, timeout_s: float) -> None:
    from rlhf_contract.api.load import load_job
    from rlhf_contract.trainer_config import TrainerConfig

    config = TrainerConfig.from_job(load_job(ROOT / "examples" / "local-grpo.yaml",
                                             ["trainer.parallelism.activationCheckpointing=false"]))
    path.write_text(config.model_copy(update={"rollout_weight_sync_timeout_seconds": timeout_s}).to_json())


def _get(url: str, timeout: float = 5.0) -> dict:
    import httpx

    return httpx.get(url, timeout=timeout).json()


def nccl_env(workdir: Path, who: str) -> dict[str, str]:
    return {"NCCL_HOSTID": f"gpu-check-{who}", "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_DEBUG_FILE": str(workdir / f"nccl-{who}.%p.log")}


def start_receivers(workdir: Path, n: int, *, backend: str, device: str, faults: dict[int, list[str]],
                    timeout_s: float) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        env = {**os.environ, **nccl_env(workdir, f"receiver{i}")}
        with open(workdir / f"receiver{i}.log", "w") as log:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, str(RECEIVER), "--port", str(port), "--backend", backend,
                                           "--device", device, "--timeout-s", str(timeout_s),
                                           *faults.get(i, [])], env=env, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    for proc, url in zip(procs, urls):
        while True:
            try:
                _get(url + "/health", 2)
                break
            except Exception:  # noqa: BLE001  (not up yet)
                if proc.poll() is not None or time.monotonic() > deadline:
                    for other in procs:
                        other.kill()
                        other.wait()
                    raise RuntimeError(f"the receiver at {url} did not start: {tail(workdir / 'receiver0.log')}")
                time.sleep(0.1)
    return procs, urls


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def launcher_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=max(0.1, timeout))
    except subprocess.TimeoutExpired:
        return None


def run_case(workdir: Path, *, backend: str, device: str, shape: str, receivers: int = 1, fault: str | None = None,
             timeout_s: float = 60.0, deadline_s: float = 120.0, rounds: int = 1, bucket_bytes: int | None = None,
             hold_after: int = 1) -> dict:
    """One trainer (launcher, main, PairLoop) and `receivers` receivers; `fault` one of
    EXPECTED's cases, injected into receiver 0 (or the trainer, for the interface). Returns
    the launcher's exit code, the seconds from the fault (from the trainer's start for "never
    joins" and "bad interface") to its exit, and for a clean round the checksums compared."""
    workdir.mkdir(parents=True, exist_ok=True)
    faults = {"killed": {0: ["--hold-after", str(hold_after)]}, "stopped": {0: ["--hold-after", str(hold_after)]},
              "never joins": {0: ["--never-join"]}, NONBLOCKING: {0: ["--never-join"]}}.get(fault, {})
    announced = "nccl" if fault == "bad interface" else backend  # the interface matters to NCCL only
    procs, urls = start_receivers(workdir, receivers, backend=announced, device=device, faults=faults,
                                  timeout_s=timeout_s)
    config, result, termination = workdir / "trainer.json", workdir / "result.json", workdir / "termination-log"
    trainer_config(config, timeout_s)
    termination.write_text("")
    from rlhf_contract.pod import ENV_OUTPUT_DIR, ENV_RESUME, ENV_ROLLOUT_ENDPOINTS, ENV_TRAINER_CONFIG, \
        ENV_WEIGHT_SYNC_ADDR
    from rlhf_trainer.launch import ENV_CHECKED_CONFIG, config_digest

    spec = {"shape": shape, "rounds": rounds, "result": str(result), "bucket_bytes": bucket_bytes,
            "cpu_nccl": fault == "bad interface" and not device.startswith("cuda")}
    env = {**os.environ, **nccl_env(workdir, "trainer"), SPEC_ENV: json.dumps(spec),
           ENV_TRAINER_CONFIG: str(config), ENV_CHECKED_CONFIG: config_digest(config),
           ENV_ROLLOUT_ENDPOINTS: ",".join(urls), ENV_WEIGHT_SYNC_ADDR: f"127.0.0.1:{free_port()}",
           ENV_OUTPUT_DIR: str(workdir / "output"), ENV_RESUME: "0", "RLHF_TERMINATION_LOG": str(termination)}
    if fault == "bad interface":
        env["NCCL_SOCKET_IFNAME"] = BAD_INTERFACE
    from rlhf_trainer.weight_sync.nccl import NONBLOCKING_INIT_ENV

    env.pop(NONBLOCKING_INIT_ENV, None)
    if fault == NONBLOCKING:
        env[NONBLOCKING_INIT_ENV] = "1"
    out: dict = {"case": fault or f"{receivers} receiver(s)", "backend": backend, "shape": shape,
                 "receivers": receivers}
    start = time.monotonic()
    with open(workdir / "trainer.log", "w") as log:
        trainer = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--launcher"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if fault in ("killed", "stopped"):
            while not _holding(urls[0]):  # mid-transfer: the receiver has taken `hold_after` buckets
                if trainer.poll() is not None or time.monotonic() - start > REACH_S:
                    raise RuntimeError(f"the round never reached receiver 0's bucket {hold_after}: "
                                       f"{tail(workdir / 'trainer.log')}")
                time.sleep(0.05)
            os.kill(procs[0].pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            start = time.monotonic()
        code = launcher_exit(trainer, deadline_s - (time.monotonic() - start))
        out["seconds"] = round(time.monotonic() - start, 2)
        out["deadline_s"] = deadline_s
        if code is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
            out.update(exit_code=None, error=f"still running after its {deadline_s} s deadline")
        else:
            out["exit_code"] = code
        out["termination_message"] = termination.read_text()[:500]
        if fault is None and code == 0:
            sent = json.loads(result.read_text())
            answers = [_get(url + "/checksums", 120) for url in urls]
            got = [a["checksums"] for a in answers]
            out["receiver"] = sorted({a.get("receiver") or "?" for a in answers})
            out["receiver_errors"] = sorted({a["receiver_error"] for a in answers if a.get("receiver_error")})
            out.update(world_size=sent["world_size"], backend=sent["backend"], tensors=len(sent["checksums"]),
                       gib=round(sent["rounds"][-1]["bytes"] / 2**30, 3), buckets=sent["rounds"][-1]["buckets"],
                       mismatched=[[n for n in sent["checksums"] if g.get(n) != sent["checksums"][n]] + sorted(
                           set(g) - set(sent["checksums"])) for g in got],
                       update_seconds=[round(r["update_seconds"], 3) for r in sent["rounds"]],
                       gb_per_s=[round(r["bytes"] / r["update_seconds"] / 1e9, 2) for r in sent["rounds"]])
            out["checksums_match"] = all(not m for m in out["mismatched"])
            out["_checksums"] = {"sent": sent["checksums"], "received": got}  # dropped from the report
        if backend == "nccl":
            out["nccl"] = parse_nccl_log("".join(tail(p, 10**7) for p in sorted(workdir.glob("nccl-trainer.*.log"))))
            out["network"] = network_label(out["nccl"])
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()
    if fault == NONBLOCKING:  # reported, not required: what the GPU measures before it becomes the default
        out["formation_aborted"] = FORMATION_ABORTED in tail(workdir / "trainer.log", 10**6)
    if fault is not None:
        out["expected"] = {**EXPECTED, **NCCL_ONLY}[fault]
        out["ok"] = out.get("exit_code") == out["expected"] and out["seconds"] <= deadline_s
    else:
        out["ok"] = out.get("exit_code") == 0 and out.get("checksums_match") is True
    if not out["ok"]:
        out["trainer_log_tail"] = tail(workdir / "trainer.log")
        out["receiver_log_tail"] = tail(workdir / "receiver0.log", 1500)
    return out


def guarded(case: str, expected: int | None, deadline_s: float, run) -> dict:
    """`run()`, or the case failed with the harness's own error (the other cases still run)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001  (the report carries it)
        return {"case": case, "ok": False, "error": repr(exc)[:3000], "expected": expected, "deadline_s": deadline_s}


def _holding(url: str) -> bool:
    try:
        return bool(_get(url + "/progress", 2)["holding"])
    except Exception:  # noqa: BLE001  (busy or gone: asked again)
        return False


def failure_deadlines(timeout_s: float, start_s: float) -> dict[str, float]:
    """Each case's deadline, from what the sender documents: a lost peer ends the round at
    once (its HTTP call or NCCL's asynchronous error); a stopped one at the round's
    `timeout_s`, then the teardown (an abort that waits up to ABORT_LOCK_WAIT_S for a call
    holding the communicator, /shutdown_weight_transfer_engine bounded by SHUTDOWN_TIMEOUT_S
    + 5); a receiver that never joins at init's `timeout_s`; a bad interface before any
    server is asked to join. `start_s`: a trainer process's start-up on this machine."""
    from rlhf_trainer.weight_sync.nccl import ABORT_LOCK_WAIT_S
    from rlhf_trainer.weight_sync.sender import SHUTDOWN_TIMEOUT_S

    teardown = ABORT_LOCK_WAIT_S + SHUTDOWN_TIMEOUT_S + 5
    return {"killed": teardown, "stopped": timeout_s + teardown + 5, "never joins": start_s + timeout_s + teardown,
            "bad interface": start_s + 10, NONBLOCKING: start_s + timeout_s + teardown}


def run_pair(workdir: Path, *, backend: str, device: str, shape: str, rounds: int = 2,
             bucket_bytes: int | None = None, timeout_s: float = 120.0) -> list[dict]:
    return [guarded(f"{n} receiver(s)", None, timeout_s * 2, lambda n=n: run_case(
        workdir / f"receivers-{n}", backend=backend, device=device, shape=shape, receivers=n, rounds=rounds,
        bucket_bytes=bucket_bytes, timeout_s=timeout_s, deadline_s=timeout_s * 2)) | {"receivers": n} for n in (1, 2)]


def run_failures(workdir: Path, *, backend: str, device: str, shape: str, timeout_s: float, start_s: float,
                 bucket_bytes: int | None = None, cases: tuple[str, ...] = tuple(EXPECTED),
                 parallel: bool = False) -> list[dict]:
    """Every case of EXPECTED, one after the other (or all at once: `parallel`, on the CPU)."""
    import concurrent.futures as cf

    deadlines = failure_deadlines(timeout_s, start_s)

    def one(case: str) -> dict:
        return guarded(case, {**EXPECTED, **NCCL_ONLY}[case], deadlines[case], lambda: run_case(
            workdir / case.replace(" ", "-"), backend=backend, device=device, shape=shape, fault=case,
            timeout_s=timeout_s, deadline_s=deadlines[case], bucket_bytes=bucket_bytes))

    if not parallel:
        return [one(case) for case in cases]
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, cases))


# ---- the parts -------------------------------------------------------------------------------

def use_vllm_source() -> None:
    """Receive with the pinned vLLM's own PyNcclCommunicator where `make gpu-wheels` shipped its
    Python code (.gpu/vllm-<version>-py.zip), unless RLHF_VLLM_SOURCE already names one."""
    from rlhf_contract.images import VLLM_VERSION

    shipped = ROOT / ".gpu" / f"vllm-{VLLM_VERSION}-py.zip"
    if shipped.exists():
        os.environ.setdefault("RLHF_VLLM_SOURCE", str(shipped))


def part_pair() -> dict:
    use_vllm_source()
    with tempfile.TemporaryDirectory(prefix="gpu-check-pair-") as tmp:
        return pair_report(run_pair(Path(tmp), backend="nccl", device="cuda:0", shape="1.5b"))


def part_failures() -> dict:
    use_vllm_source()
    with tempfile.TemporaryDirectory(prefix="gpu-check-failures-") as tmp:
        report = failures_report(run_failures(Path(tmp), backend="nccl", device="cuda:0", shape="1.5b",
                                              timeout_s=12, start_s=20, cases=(*EXPECTED, *NCCL_ONLY)))
    report["nonblocking config"] = config_probe()  # reported, not required (NCCL_ONLY)
    return report


CONFIG_PROBE = """
import json, torch
from rlhf_trainer.weight_sync import nccl
lib, result = nccl.Nccl(), {}
if torch.cuda.is_available():
    torch.cuda.set_device(0)
for kind in ("ours", "wrong magic"):
    config = nccl.nonblocking_config()
    if kind == "wrong magic":
        config.magic ^= 0xFFFF
    try:
        comm = nccl.Communicator(lib, lib.comm_init_rank_nonblocking(1, lib.unique_id(), 0, config))
        comm.wait_formed()
        result[kind] = "formed"
        comm.abort()
    except nccl.NcclError as exc:
        result[kind] = f"code {exc.code}: {exc}"
result["read"] = result["ours"] == "formed" and result["wrong magic"].startswith("code 4")
print(json.dumps(result))
"""


def config_probe() -> dict:
    """Whether NCCL reads our ncclConfig_t (nccl.NcclConfig): a one-rank non-blocking
    communicator forms with ours, and the same with a wrong magic is refused (invalid
    argument, 4). Only where CUDA is: without it NCCL stops at cudaGetDevice before reading
    the config (tests/protocol/test_nccl_binding.py)."""
    out = subprocess.run([sys.executable, "-c", CONFIG_PROBE], capture_output=True, text=True, timeout=120)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"read": False, "error": (out.stdout + out.stderr)[-1500:]}


def pair_report(cases: list[dict]) -> dict:
    """The pair part's result from its cases (the checksums themselves left out)."""
    cases = [{k: v for k, v in c.items() if k != "_checksums"} for c in cases]
    rows = [{"receivers": c["receivers"], "receiver": ", ".join(c.get("receiver") or []),
             "network": c.get("network"), "GiB": c.get("gib"),
             "buckets": c.get("buckets"), "GB/s per round": c.get("gb_per_s"), "exit": c.get("exit_code"),
             "sha256 equal": c.get("checksums_match")} for c in cases]
    return {"status": "ok" if all(c["ok"] for c in cases) else "failed", "cases": cases,
            "tables": {"sender to receivers": rows}, "summary": "; ".join(_pair_summary(c) for c in cases)}


def _pair_summary(c: dict) -> str:
    if c.get("exit_code") != 0:  # e.g. NCCL refusing two ranks on one GPU: its own words
        return (f"{c['receivers']} receiver(s): trainer exit {c.get('exit_code')}: {c.get('termination_message') or ''}"
                f" {c.get('error') or ''} NCCL: {(c.get('nccl') or {}).get('warnings')}")
    return (f"{c['receivers']} receiver(s) ({', '.join(c.get('receiver') or [])}"
            + (f"; {'; '.join(c['receiver_errors'])}" if c.get("receiver_errors") else "") + ") "
            f"over {c.get('network', c['backend'])}: {c.get('gb_per_s')} GB/s per round, "
            f"sha256 of {c.get('tensors')} tensors {'equal' if c.get('checksums_match') else 'NOT equal'}")


def failures_report(cases: list[dict]) -> dict:
    rows = [{"case": c["case"], "exit": c.get("exit_code"), "expected": c["expected"], "seconds": c.get("seconds"),
             "deadline s": c["deadline_s"], "ok": c["ok"]}
            | ({"formation aborted": c["formation_aborted"]} if "formation_aborted" in c else {}) for c in cases]
    return {"status": "ok" if all(c["ok"] for c in cases) else "failed", "cases": cases,
            "tables": {"failures injected": rows},
            "summary": "; ".join(f"{c['case']}: exit {c.get('exit_code')} (expected {c['expected']}) in "
                                 f"{c.get('seconds')} s of {c['deadline_s']}"
                                 + (f", formation aborted: {c['formation_aborted']}" if "formation_aborted" in c else "")
                                 for c in cases)}


def die_with_parent() -> None:
    """SIGKILL this process when its parent ends (Linux): the trainer runs in a session of its
    own (so a missed deadline ends it and its launcher at once), and a part that the check's
    time box kills must not leave it behind on the GPU."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent ended before the call
        os._exit(1)


if __name__ == "__main__":
    die_with_parent()
    if sys.argv[1:] == ["--launcher"]:
        sys.exit(launcher_process())
    if sys.argv[1:] == ["--trainer"]:
        trainer_process()
