# Test base for TORCH_BASE_IMAGE: PyPI's torch (the trainer's pin; its CUDA libraries come
# with it, unused on CPU) on the Debian Python base.
ARG PYTHON_BASE_IMAGE
FROM ${PYTHON_BASE_IMAGE}
ARG TORCH_VERSION=2.14.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && python -c "import torch; print(torch.__version__)"
