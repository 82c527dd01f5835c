# For compose.dev.yaml only (people with Docker and registry access): the mesh's own services
# run as processes, never from this image, on real machines.
FROM docker.io/library/python:3.12-slim
COPY . /src
RUN pip install --no-cache-dir /src
ENTRYPOINT []
