"""FastAPI app: vLLM's OpenAI completions endpoint plus its RLHF dev endpoints.

Endpoints (same paths and bodies as vLLM with VLLM_SERVER_DEV_MODE=1):
  GET  /health, /v1/models, /get_world_size, /is_paused, /weight_info
  POST /v1/completions, /pause?mode=abort|wait|keep, /resume
  POST /init_weight_transfer_engine {"init_info": {...}}
  POST /start_weight_update, /update_weights {"update_info": {...}},
       /finish_weight_update {"weight_version": ...}, /weight_checker {"action": ...}
  GET  /stats   (CPU engine only: counters, e.g. forward passes, to check batching)

Every blocking call (generation is already on the engine's worker thread; joining the
group, receiving broadcasts, pausing) runs in a thread so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from http import HTTPStatus

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from . import protocol
from .engine import PAUSE_MODES, Engine
from .protocol import RequestError, error_body
from .weights import InitInfo, UpdateInfo, WeightReceiver, WeightUpdateError, copy_into

log = logging.getLogger("rlhf_inference.cpu_engine")


def build_app(engine: Engine, *, model_name: str, model_path: str,
              weight_timeout_s: float = 600.0) -> FastAPI:
    app = FastAPI(title="rlhf-operator CPU rollout engine")
    receiver = WeightReceiver(timeout_s=weight_timeout_s)
    weight_lock = asyncio.Lock()  # one weight-transfer call at a time
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return JSONResponse(error_body(str(exc), exc.param, exc.status_code),
                            status_code=exc.status_code)

    @app.exception_handler(WeightUpdateError)
    async def _weight_error(_: Request, exc: WeightUpdateError):
        return JSONResponse(error_body(str(exc), exc.param, 400), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", None, 500),
                            status_code=500)

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

    # ---- OpenAI ------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "vllm",
            "root": model_path, "parent": None, "max_model_len": engine.max_model_len,
        }]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = protocol.parse_request(await json_body(request))
        if req.model is not None and req.model != model_name:
            raise RequestError(f"The model `{req.model}` does not exist.", "model", 404)
        protocol.validate(req, vocab_size=engine.vocab_size)
        prompts = protocol.prompts_as_ids(req, engine.tokenizer, engine.vocab_size,
                                          engine.max_model_len)
        params = protocol.sampling_params(req)
        per_prompt = [engine.new_sequences(ids, params, req.n, req.seed) for ids in prompts]
        # All prompts of one request go into the queue at once: one batch if they fit.
        await engine.generate([s for seqs in per_prompt for s in seqs])
        return protocol.completion_response(req, model_name, engine.tokenizer, per_prompt)

    # ---- pause / resume ----------------------------------------------------------

    @app.post("/pause")
    async def pause(mode: str = Query("abort")):
        if mode not in PAUSE_MODES:
            return JSONResponse({"error": f"mode must be one of {'|'.join(PAUSE_MODES)}, "
                                          f"got {mode!r}"}, status_code=400)
        await asyncio.to_thread(engine.pause, mode)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        engine.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    # ---- weight transfer ---------------------------------------------------------

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)):
        return {"world_size": 1}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request):
        body = await json_body(request)
        if body.get("init_info") is None:
            raise RequestError("Missing 'init_info' in request body", "init_info")
        info = InitInfo.parse(body["init_info"])
        async with weight_lock:
            await asyncio.to_thread(receiver.init, info)
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weight_update():
        await asyncio.to_thread(engine.pause, "keep")
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = await json_body(request)
        if body.get("update_info") is None:
            raise RequestError("Missing 'update_info' in request body", "update_info")
        info = UpdateInfo.parse(body["update_info"])
        if not engine.is_paused:
            # vLLM requires start_weight_update first; pausing here keeps the model safe.
            await asyncio.to_thread(engine.pause, "keep")
        targets = engine.named_weights()
        async with weight_lock:
            await asyncio.to_thread(receiver.receive, info, targets,
                                    lambda pairs: copy_into(targets, pairs))
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request):
        body = await json_body(request, required=False)
        version = body.get("weight_version")
        if version is not None:
            engine.weight_version = str(version)
        engine.resume()
        return {"message": "Weight update finished"}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await json_body(request)
        if "new_version" not in body:
            raise RequestError("Missing 'new_version' in request body", "new_version")
        engine.weight_version = str(body["new_version"])
        return {"success": True, "new_version": engine.weight_version}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": engine.weight_version}

    @app.post("/weight_checker")
    async def weight_checker(request: Request):
        body = await json_body(request)
        action = body.get("action")
        if action not in ("checksum", "compare"):
            raise RequestError(f"action must be one of checksum|compare, got {action!r}",
                               "action")
        if engine.is_paused:
            return JSONResponse(
                error_body("weight_checker requires an awake, unpaused engine", None, 409),
                status_code=HTTPStatus.CONFLICT.value)
        checksums = await asyncio.to_thread(engine.checksums)
        if action == "checksum":
            return {"checksums": checksums}
        baseline = body.get("baseline")
        if not isinstance(baseline, dict):
            raise RequestError("action='compare' requires a 'baseline' object", "baseline")
        mismatches = sorted(n for n in set(baseline) | set(checksums)
                            if baseline.get(n) != checksums.get(n))
        return {"match": not mismatches, "mismatches": mismatches}

    @app.get("/stats")
    async def stats():
        return engine.stats()

    return app
