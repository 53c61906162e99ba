"""The container images, one place: the spec's defaults, the Dockerfiles, `make images`
and the examples name these tags (tests/unit/test_images.py keeps them equal).

vLLM is pinned to 0.33.0, the newest release, and the weight-transfer protocol we speak
is that release's (tests/protocol/ checks our sender, the CPU engine and the launcher's
flags against an extract of its source): `update_info` carries only names, dtype_names
and shapes while the packed settings travel in `init_info` (since 0.28), its NCCL engine
accepts `nccl_unique_id_b64` (0.32 and newer; the trainer joins through its own libnccl
binding), and empty metadata means "as last round" (0.33 and newer, the trainer's
minimum). The trainer pins vLLM's torch (2.14.0), so both sides load NCCL 2.30.7.
"""

VERSION = "0.1.0"
REGISTRY = "ghcr.io/rlhf-operator"

VLLM_VERSION = "0.33.0"
VLLM_BASE_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"  # FROM of inference_image/Dockerfile

TRAINER_IMAGE = f"{REGISTRY}/trainer:{VERSION}"
INFERENCE_IMAGE = f"{REGISTRY}/inference:{VERSION}"
OPERATOR_IMAGE = f"{REGISTRY}/operator:{VERSION}"
COLOCATED_IMAGE = f"{REGISTRY}/colocated:{VERSION}"
"""`rollout.placement: colocated` on a cluster: the inference image (the pinned vLLM and its
torch) with the trainer in a virtual environment of its own that sees vLLM's packages (the
trainer pins a newer transformers than vLLM allows); trainer pods run
`python -m rlhf_trainer.supervise` from it."""
