"""`python -m rlhf_inference.cpu_engine --model PATH --host H --port P`: serve a HF model.

A stand-in for `vllm serve` in local mode and CI: same OpenAI completions protocol and
the same weight-transfer endpoints (gloo instead of NCCL). See server.py for endpoints.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from .engine import Engine
from .protocol import GENERATION_CONFIG_FIELDS
from .server import build_app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlhf_inference.cpu_engine", description=__doc__)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0, help="seeds requests that bring no seed")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences (prompts x n) in one batched generation loop")
    p.add_argument("--served-model-name", default=None, help="model name in the API "
                   "(default: --model)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output token limit (default: max_position_embeddings)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--weight-transfer-timeout", type=float, default=600.0,
                   help="seconds to wait in the weight-transfer group before failing")
    p.add_argument("--generation-config", default="auto",
                   help="'auto': sampling fields a request omits come from the model's "
                        "generation_config.json (as vLLM); 'vllm': neutral defaults")
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"],
                   help="as vLLM: log-probs before or after temperature / top-k / top-p")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="as vLLM: POST /sleep and /wake_up (the trainer's colocated placement)")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def generation_defaults(model_path: str, source: str) -> dict:
    """vLLM's get_diff_sampling_param: the sampling fields set in generation_config.json
    ("auto"), none ("vllm"), or those of another directory's file."""
    if source == "vllm":
        return {}
    path = Path(model_path if source == "auto" else source) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = Engine(model, tokenizer, max_num_seqs=args.max_num_seqs, seed=args.seed,
                    max_model_len=args.max_model_len, logprobs_mode=args.logprobs_mode)
    app = build_app(engine, model_name=args.served_model_name or args.model,
                    model_path=args.model, weight_timeout_s=args.weight_transfer_timeout,
                    generation_defaults=generation_defaults(args.model, args.generation_config),
                    enable_sleep_mode=args.enable_sleep_mode)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
