"""FastAPI app: vLLM's OpenAI completions endpoint plus its RL / dev endpoints.

Endpoints (same paths, parameters and bodies as the pinned vLLM release with
VLLM_SERVER_DEV_MODE=1; tests/protocol/ checks them against its source):
  GET  /health, /version, /v1/models, /get_world_size, /is_paused, /weight_info,
       /server_info?config_format=json (only `vllm_config.weight_transfer_config` and
       `vllm_config.parallel_config` are filled in)
  POST /v1/completions, /pause?mode=abort|wait|keep&clear_cache=..., /resume,
       /reset_prefix_cache, /init_weight_transfer_engine {"init_info": {...}},
       /shutdown_weight_transfer_engine, /start_weight_update,
       /update_weights {"update_info": {...}}, /finish_weight_update {"weight_version"},
       /update_weight_version {"new_version"}, /weight_checker {"action", "baseline"}
  GET  /stats   (CPU engine only: counters, e.g. forward passes, to check batching)
  POST /sleep, /wake_up; GET /is_sleeping (with --enable-sleep-mode: sleep.py)

The weight-update state machine is vLLM's worker's (`gpu_worker.py`): update_weights
needs an active update (start_weight_update), start needs none active, finish needs one,
shutdown refuses while one is active; a failed update_weights ends the active update.
Those state errors answer HTTP 500 with vLLM's messages; malformed payloads answer 400
naming the field. The CPU engine has no prefix cache: /reset_prefix_cache answers
{"success": true} unless a generation loop is running (vLLM fails the reset while blocks
are held), and counts resets in /stats.

Every blocking call (generation is already on the engine's worker thread; joining the
group, receiving broadcasts, pausing) runs in a thread so the event loop stays free.
The routes are grouped in routers by protocol (OpenAI, pause and cache control, weight
transfer, weight version and checks) over one `ServerState`; `build_app` assembles them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from rlhf_contract.images import VLLM_VERSION

from . import protocol
from .engine import PAUSE_MODES, Engine
from .protocol import RequestError, error_body
from .sleep import Sleeper, SleepStateError, sleep_router
from .weights import InitInfo, UpdateInfo, WeightReceiver, WeightUpdateError, copy_into

WEIGHT_TRANSFER_BACKEND = "gloo"  # what /server_info reports as weight_transfer_config.backend

log = logging.getLogger("rlhf_inference.cpu_engine")


class WeightStateError(RuntimeError):
    """A weight-transfer call out of order (vLLM raises RuntimeError: HTTP 500)."""


@dataclass
class ServerState:
    """What the routes share: the engine, the weight receiver and the update state."""

    engine: Engine
    model_name: str
    model_path: str
    receiver: WeightReceiver
    sleeper: Sleeper
    version: str = VLLM_VERSION
    generation_defaults: dict = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One weight-transfer call at a time."""
    update_active: bool = False
    prefix_cache_resets: int = 0
    calls: list[str] = field(default_factory=list)
    """Weight-protocol calls, in order (GET /stats shows them)."""


async def json_body(request: Request, *, required: bool = True) -> dict:
    raw = await request.body()
    if not raw and not required:
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(f"Invalid JSON body: {exc}", None) from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None)
    return body


def required(body: dict, key: str) -> object:
    """`body[key]`, or vLLM's 400 naming the missing key."""
    if body.get(key) is None:
        raise RequestError(f"Missing '{key}' in request body", key)
    return body[key]


def add_error_handlers(app: FastAPI) -> None:
    """Errors answer with vLLM's error body: 400 for bad payloads, 500 for state errors."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return JSONResponse(error_body(str(exc), exc.param, exc.status_code),
                            status_code=exc.status_code)

    @app.exception_handler(WeightUpdateError)
    async def _weight_error(_: Request, exc: WeightUpdateError):
        return JSONResponse(error_body(str(exc), exc.param, 400), status_code=400)

    @app.exception_handler(WeightStateError)
    @app.exception_handler(SleepStateError)
    async def _state_error(_: Request, exc: RuntimeError):
        return JSONResponse(error_body(str(exc), None, 500), status_code=500)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", None, 500),
                            status_code=500)


def openai_router(s: ServerState) -> APIRouter:
    """OpenAI-compatible serving: health, version, server info, models, completions."""
    router, engine = APIRouter(), s.engine

    @router.get("/health")
    async def health():
        return Response(status_code=200)

    @router.get("/version")
    async def version_():
        return {"version": s.version}

    @router.get("/server_info")
    async def server_info(config_format: str = Query("text")):
        dtype = next(s.engine.model.parameters()).dtype  # vLLM: model_config.dtype, a torch.dtype dumped as str
        config = {"weight_transfer_config": {"backend": WEIGHT_TRANSFER_BACKEND},
                  "model_config": {"dtype": str(dtype)},
                  "parallel_config": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                      "data_parallel_size": 1, "world_size": 1}}
        return {"vllm_config": config if config_format == "json" else json.dumps(config),
                "vllm_env": {}, "system_env": {"engine": "rlhf_inference.cpu_engine"}}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": s.created, "owned_by": "vllm",
            "root": s.model_path, "parent": None, "max_model_len": engine.max_model_len,
        }]}

    @router.post("/v1/completions")
    async def completions(request: Request):
        req = protocol.apply_generation_defaults(protocol.parse_request(await json_body(request)),
                                                 s.generation_defaults)
        if req.model is not None and req.model != s.model_name:
            raise RequestError(f"The model `{req.model}` does not exist.", "model", 404)
        protocol.validate(req, vocab_size=engine.vocab_size)
        s.sleeper.check_generate()
        if engine.rejects_new_requests:
            raise RequestError("The engine is paused for a weight update; retry after /resume", None, 503)
        prompts = protocol.prompts_as_ids(req, engine.tokenizer, engine.vocab_size,
                                          engine.max_model_len)
        params = protocol.sampling_params(req)
        per_prompt = [engine.new_sequences(ids, params, req.n, req.seed) for ids in prompts]
        # All prompts of one request go into the queue at once: one batch if they fit.
        await engine.generate([seq for seqs in per_prompt for seq in seqs])
        return protocol.completion_response(req, s.model_name, engine.tokenizer, per_prompt)

    return router


def control_router(s: ServerState) -> APIRouter:
    """vLLM's dev-mode control: pause and resume, the prefix cache; the CPU engine's /stats."""
    router, engine = APIRouter(), s.engine

    @router.post("/pause")
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)):
        s.calls.append(f"pause?mode={mode}")
        if mode not in PAUSE_MODES:
            return JSONResponse({"error": f"mode must be one of {'|'.join(PAUSE_MODES)}, "
                                          f"got {mode!r}"}, status_code=400)
        await asyncio.to_thread(engine.pause, mode)
        if clear_cache and mode != "keep":
            s.prefix_cache_resets += 1
        return {"status": "paused"}

    @router.post("/resume")
    async def resume():
        s.calls.append("resume")
        engine.resume()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False),
                                 reset_external: bool = Query(False)):
        s.calls.append("reset_prefix_cache")
        success = reset_running_requests or engine.is_idle
        if success:
            s.prefix_cache_resets += 1
        return {"success": success}

    @router.get("/stats")
    async def stats():
        return {**engine.stats(), "weight_update_active": s.update_active, "sleep": s.sleeper.stats(),
                "prefix_cache_resets": s.prefix_cache_resets, "weight_calls": list(s.calls)}

    return router


def weight_transfer_router(s: ServerState) -> APIRouter:
    """vLLM's weight-transfer API and its worker's state machine (see the module docstring)."""
    router, engine, receiver = APIRouter(), s.engine, s.receiver

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request):
        s.calls.append("init_weight_transfer_engine")
        info = InitInfo.parse(required(await json_body(request), "init_info"))
        async with s.weight_lock:
            await asyncio.to_thread(receiver.init, info)
        return {"message": "Weight transfer initialized"}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        s.calls.append("shutdown_weight_transfer_engine")
        if s.update_active:
            raise WeightStateError("Cannot release a trainer connection during a weight update")
        receiver.shutdown()
        return {"message": "Weight transfer shut down"}

    @router.post("/start_weight_update")
    async def start_weight_update():
        s.calls.append("start_weight_update")
        if s.update_active:
            raise WeightStateError("start_weight_update called while a weight update is already active. "
                                   "Call finish_weight_update first.")
        s.update_active = True
        return {"message": "Weight update started"}

    @router.post("/update_weights")
    async def update_weights(request: Request):
        s.calls.append("update_weights")
        update_info = required(await json_body(request), "update_info")
        if not s.update_active:
            raise WeightStateError("start_weight_update must be called before update_weights.")
        try:
            s.sleeper.check_weight_update()
            info = UpdateInfo.parse(update_info)
            targets = engine.named_weights()

            def receive() -> None:
                with engine.hold():
                    receiver.receive(info, targets, load)

            def load(pairs) -> None:
                copy_into(targets, pairs)
                s.sleeper.loaded(name for name, _ in pairs)

            async with s.weight_lock:
                await asyncio.to_thread(receive)
        except BaseException:
            s.update_active = False  # as vLLM's worker: a failed update ends the session
            raise
        return {"message": "Weights updated"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request):
        s.calls.append("finish_weight_update")
        body = await json_body(request, required=False)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise RequestError(f"weight_version must be a string, got {version!r}", "weight_version")
        if not s.update_active:
            raise WeightStateError("finish_weight_update called without a matching start_weight_update.")
        s.update_active = False
        s.sleeper.weight_update_finished()
        if version is not None:
            engine.weight_version = version
        return {"message": "Weight update finished"}

    return router


def weight_info_router(s: ServerState) -> APIRouter:
    """The weights' world size, version and checksums."""
    router, engine = APIRouter(), s.engine

    @router.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)):
        return {"world_size": 1}

    @router.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await json_body(request)
        if "new_version" not in body:
            raise RequestError("Missing 'new_version' in request body", "new_version")
        engine.weight_version = str(body["new_version"])
        return {"success": True, "new_version": engine.weight_version}

    @router.get("/weight_info")
    async def weight_info():
        return {"weight_version": engine.weight_version}

    @router.post("/weight_checker")
    async def weight_checker(request: Request):
        body = await json_body(request)
        action = body.get("action")
        if action not in ("checksum", "compare"):
            raise RequestError(f"action must be one of checksum|compare, got {action!r}",
                               "action")
        checksums = await asyncio.to_thread(engine.checksums)
        if action == "checksum":
            return {"checksums": checksums}
        baseline = body.get("baseline")
        if not isinstance(baseline, dict):
            raise RequestError("action='compare' requires a 'baseline' object", "baseline")
        mismatches = sorted(n for n in set(baseline) | set(checksums)
                            if baseline.get(n) != checksums.get(n))
        return {"match": not mismatches, "mismatches": mismatches}

    return router


def build_app(engine: Engine, *, model_name: str, model_path: str,
              weight_timeout_s: float = 600.0, version: str = VLLM_VERSION,
              generation_defaults: dict | None = None, enable_sleep_mode: bool = False) -> FastAPI:
    app = FastAPI(title="rlhf-operator CPU rollout engine")
    state = ServerState(engine, model_name, model_path, WeightReceiver(timeout_s=weight_timeout_s),
                        Sleeper(engine, enable_sleep_mode), version, generation_defaults or {})
    add_error_handlers(app)
    for router in (openai_router, control_router, weight_transfer_router, weight_info_router):
        app.include_router(router(state))
    app.include_router(sleep_router(state.sleeper))
    return app
