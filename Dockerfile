# One image for every loraplex process: `platform serve` (the default), `engine serve ...` and one-shot jobs such
# as `db upgrade`; compose.yaml picks the command. This is the CPU image: torch's CPU build, no Triton.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# torch first, from PyTorch's CPU index: resolved from PyPI, the project's `torch>=2.13` would pull the
# multi-GB CUDA build. Its own layer, so a code change does not download it again.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

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
