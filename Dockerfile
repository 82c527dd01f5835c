# The image of compose.dev.yaml's machines (their hosts run `mesh host run`) and one-shot
# services: the package and nothing else: no virtualenv of the checkout, no mesh folder, no
# credentials (.dockerignore; compose.dev.yaml issues them into volumes at start). The mesh's own
# services are never this image's processes: a machine's host runs the controller from its module.
#
# BASE: images/build makes mesh-base:local from Debian's packages, with no registry: Debian
# bookworm with python3 (and its venv). With a registry, an image with the same Python works:
# --build-arg BASE=docker.io/library/python:3.11-slim-bookworm.
ARG BASE=mesh-base:local
FROM ${BASE}
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/mesh/bin:$PATH
# The packages the mesh requires first, from pyproject.toml alone (a layer kept while it does not
# change), then the mesh's code.
COPY pyproject.toml README.md /src/
RUN python3 -m venv /opt/mesh && /opt/mesh/bin/pip install --no-cache-dir -q /src && rm -rf /src
COPY pyproject.toml README.md /src/
COPY mesh /src/mesh
COPY services /src/services
COPY programs /src/programs
RUN /opt/mesh/bin/pip install --no-cache-dir -q --no-deps --force-reinstall /src && rm -rf /src
ENTRYPOINT []
