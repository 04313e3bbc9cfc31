# One image for every pagoda role (see compose.yaml). TORCH_INDEX_URL picks the torch
# build: a CUDA index for GPU hosts (default), https://download.pytorch.org/whl/cpu otherwise.
FROM python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PYTHONUNBUFFERED=1 PAGODA_CACHE=/cache
WORKDIR /app
# g++ (and ninja, a Python dependency) build the CPU worker's C++ kernels at first use;
# without them the worker falls back to the slower torch path
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_EXTENSIONS_DIR=/cache/torch_extensions
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY pyproject.toml README.md ./
COPY pagoda ./pagoda
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
RUN pip install --no-cache-dir .
# the model is fetched into the cache volume on first start (pagoda fetch smollm2)
VOLUME /cache
CMD ["pagoda", "serve", "--help"]
