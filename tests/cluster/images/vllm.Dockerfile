# Test base for VLLM_BASE_IMAGE: PyPI's vLLM wheel (the pinned release, CUDA build) on the
# torch base, entry point as in vllm/vllm-openai. No GPU here: the tests check that
# `vllm serve --help` runs in a container; the rollout pods of the tests run the CPU engine.
ARG TORCH_BASE_IMAGE
FROM ${TORCH_BASE_IMAGE}
ARG VLLM_VERSION=0.33.0
RUN pip install --no-cache-dir "vllm==${VLLM_VERSION}" \
    && python -c "import vllm; print(vllm.__version__)"
ENTRYPOINT ["vllm", "serve"]
