# For compose.dev.yaml only (people with Docker and registry access): the mesh's own services
# run as processes, never from this image, on real machines. The image holds the package and
# nothing else: no virtualenv, no mesh folder, no credentials (.dockerignore; compose.dev.yaml
# issues them into volumes at start).
FROM docker.io/library/python:3.12-slim
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /src/
COPY mesh /src/mesh
COPY services /src/services
COPY programs /src/programs
RUN pip install --no-cache-dir /src && rm -rf /src
ENTRYPOINT []
