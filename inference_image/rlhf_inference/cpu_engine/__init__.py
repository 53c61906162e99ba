"""A small CPU stand-in for vLLM: `python -m rlhf_inference.cpu_engine --model PATH`.

Speaks vLLM's OpenAI completions protocol (token ids in, token ids + raw logprobs out)
and its RLHF weight-transfer endpoints over a gloo group, around a Hugging Face causal
LM. Modules: generator.py (one batched KV-cache generation loop), engine.py (queue,
worker thread, pause), weights.py (receiving packed broadcasts), protocol.py (request
validation and response shapes), server.py (FastAPI routes), __main__.py (CLI).
"""
