# One image for every loraplex process: `platform serve` (the default), `engine serve ...` and one-shot jobs such
# as `db upgrade`; compose.yaml picks the command. Two flavors of it, by the torch inside:
#   docker build -t loraplex:local .                                  torch's CPU build (the default)
#   docker build --build-arg TORCH_FLAVOR=cuda -t loraplex:cuda .      torch's CUDA build, with Triton, for GPU hosts
# (compose.gpu.yaml and deploy/k8s run the second). The CUDA wheels carry their own CUDA runtime: the host needs
# NVIDIA's driver (one that supports CUDA_TORCH_INDEX_URL's CUDA version) and container toolkit, nothing else.

# torch from PyTorch's own indexes: resolved from PyPI, the project's `torch>=2.13` would pull whichever build PyPI
# has. The native operators are built against this same torch, which their file names record.
ARG TORCH_VERSION=2.13.0
ARG TORCH_FLAVOR=cpu
ARG CPU_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

FROM python:3.11-slim AS python
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# torch first, a stage (a layer) of its own, so a code change does not download it again.
FROM python AS torch-cpu
ARG TORCH_VERSION
ARG CPU_TORCH_INDEX_URL
RUN pip install "torch==${TORCH_VERSION}" --index-url "${CPU_TORCH_INDEX_URL}"

FROM python AS torch-cuda
ARG TORCH_VERSION
ARG CUDA_TORCH_INDEX_URL
RUN pip install "torch==${TORCH_VERSION}" --index-url "${CUDA_TORCH_INDEX_URL}" \
    && python -c "import triton"

# The native CPU operators (kernels/native.py), built in a stage with the compiler for every level of the
# architecture (x86-64 v3, v4, v4 with VNNI and BF16; ARMv8), none for the build machine's own CPU: each host the
# image runs on loads the best level it has (decision 0050). The image ships the libraries only.
FROM torch-${TORCH_FLAVOR} AS native
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY kernels /src/kernels
RUN python /src/kernels/native.py --levels all --dest /opt/loraplex/native

FROM torch-${TORCH_FLAVOR}

WORKDIR /src
# The dependencies next, read from pyproject.toml alone, so that this layer too survives code changes.
COPY pyproject.toml setup.py README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The same inputs tests/test_packaging.py builds its wheel from. Installed non-editable, so the image runs
# from site-packages like any wheel install: the Alembic scripts come along as loraplex.migrations.
COPY platform ./platform
COPY engine ./engine
COPY kernels ./kernels
COPY migrations ./migrations
RUN pip install --no-deps . \
    && cd / && rm -rf /src

# The native operators' libraries, read-only: found there, never built at run time (the image has no compiler).
COPY --from=native /opt/loraplex/native /opt/loraplex/native
ENV LORAPLEX_NATIVE_DIR=/opt/loraplex/native \
    LORAPLEX_NATIVE_BUILD=0

# A fixed uid, so bind-mounted folders (models, data) can be given to it on the host.
RUN useradd --system --uid 10001 --user-group --home-dir /home/loraplex --create-home loraplex \
    && mkdir -p /var/lib/loraplex /models \
    && chown loraplex:loraplex /var/lib/loraplex
USER loraplex
WORKDIR /home/loraplex

# Inside a container the server must listen on every interface; the data dir is the one folder it writes.
ENV LORAPLEX_HOST=0.0.0.0 \
    LORAPLEX_PORT=8000 \
    LORAPLEX_DATA_DIR=/var/lib/loraplex
EXPOSE 8000

# python rather than curl: the slim image has no curl. LORAPLEX_PORT is the platform's port; the engine listens
# on its --port, so compose.yaml gives the engine its own healthcheck.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('LORAPLEX_PORT', '8000'), timeout=4)"

ENTRYPOINT ["loraplex"]
CMD ["platform", "serve"]
