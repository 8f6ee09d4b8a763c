#!/usr/bin/env bash
# Make a Docker engine reachable on this machine (what `make test-compose` needs):
# install Debian's docker.io, docker-compose and debootstrap when dockerd is absent, start
# dockerd when nothing answers on its socket, and wait (bounded) until it does.
# Idempotent: on a machine with a running engine it only checks it. Needs root for apt and
# dockerd (CI runs as root); the engine's log goes to ${DOCKERD_LOG:-/tmp/dockerd.log}.
set -euo pipefail

log=${DOCKERD_LOG:-/tmp/dockerd.log}
wait_s=${DOCKERD_WAIT_S:-60}

if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null \
    || ! command -v debootstrap >/dev/null; then
    echo "docker-engine: installing docker.io docker-compose debootstrap (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends \
        docker.io docker-compose debootstrap iptables ca-certificates >/dev/null
fi

if docker info >/dev/null 2>&1; then
    echo "docker-engine: an engine answers ($(docker version -f '{{.Server.Version}}'))"
    exit 0
fi

echo "docker-engine: starting dockerd (log: $log)"
# setsid: the engine outlives this script (and the make recipe that ran it).
setsid dockerd >"$log" 2>&1 </dev/null &
for ((i = 0; i < wait_s; i++)); do
    if docker info >/dev/null 2>&1; then
        echo "docker-engine: dockerd $(docker version -f '{{.Server.Version}}') up in ${i} s"
        exit 0
    fi
    sleep 1
done
echo "docker-engine: dockerd did not answer within ${wait_s} s; its log:" >&2
tail -n 40 "$log" >&2
exit 1
