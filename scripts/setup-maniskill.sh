#!/usr/bin/env bash
# Install ManiSkill3 (CPU simulation, software Vulkan rendering) into a venv.
#
#   bash scripts/setup-maniskill.sh [VENV]     # VENV defaults to .venv
#
# Idempotent; run as root where system packages are missing (CI does, from `make`).
#
# 1. pip-installs mani-skill into VENV with the venv's installed torch, gymnasium and numpy
#    pinned as constraints, so pip can never swap the CPU torch wheel for a multi-GB CUDA
#    build or move what the project resolved; checks torch's version afterwards.
# 2. Probes for a Vulkan device that SAPIEN can open (ManiSkill needs one even in state
#    mode). If none works -- e.g. Debian 12's stock Mesa 22.3 lavapipe, which SAPIEN rejects
#    -- it adds bookworm-backports to apt, using the URI of the machine's existing Debian
#    source (no mirror is hard-coded here), and installs Mesa 25's llvmpipe Vulkan driver
#    from it. Then it probes again and fails loudly if rendering still does not work.
#
# gymnasium: mani-skill 3.0.1 declares gymnasium>=0.29.1, so the project's gymnasium 1.x
# stays as it is (the constraint below also pins it, so a resolver surprise fails here).
set -euo pipefail

VENV="${1:-.venv}"
PY="$VENV/bin/python"
MANI_SKILL_REQ="mani-skill==3.0.1"
BACKPORTS_LIST=/etc/apt/sources.list.d/joynexus-backports.sources
BACKPORTS_LINE_LIST=/etc/apt/sources.list.d/joynexus-backports.list

log() { echo "setup-maniskill: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ -x "$PY" ] || die "no python at $PY (create the venv and install the project first)"

# --- 1. Python packages ----------------------------------------------------------------------

pinned_version() {  # installed version of a distribution in the venv, or empty
    "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}

TORCH_VERSION="$(pinned_version torch)"
GYM_VERSION="$(pinned_version gymnasium)"
NUMPY_VERSION="$(pinned_version numpy)"
[ -n "$TORCH_VERSION" ] || die "torch is not installed in $VENV; install torch==2.13.0 first"

if [ "$(pinned_version mani-skill)" = "${MANI_SKILL_REQ#mani-skill==}" ]; then
    log "mani-skill ${MANI_SKILL_REQ#mani-skill==} already installed"
else
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    # Local version labels (2.13.0+cpu) must be matched exactly, so pin the full string.
    echo "torch==$TORCH_VERSION" >"$constraints"
    # Hold what the project already resolved: mani-skill must fit around it, not move it.
    [ -z "$GYM_VERSION" ] || echo "gymnasium==$GYM_VERSION" >>"$constraints"
    [ -z "$NUMPY_VERSION" ] || echo "numpy==$NUMPY_VERSION" >>"$constraints"
    log "installing $MANI_SKILL_REQ (held: $(tr '\n' ' ' <"$constraints"))"
    "$VENV/bin/pip" install -q -c "$constraints" "$MANI_SKILL_REQ"
fi

after="$(pinned_version torch)"
[ "$after" = "$TORCH_VERSION" ] || die "torch changed from $TORCH_VERSION to $after"
"$PY" -c "import torch; assert torch.__version__ == '$TORCH_VERSION', torch.__version__"

# --- 2. Vulkan ---------------------------------------------------------------------------------

vulkan_works() {
    # Opening a SAPIEN render system is exactly what ManiSkill does at env creation; stdin is
    # /dev/null so nothing here can wait for input.
    "$PY" - </dev/null >/dev/null 2>&1 <<'PYEOF'
import warnings
# SAPIEN falls back to its bundled loader with this warning; we want the system's.
warnings.filterwarnings("error", message="Failed to find system libvulkan")
import sapien
sapien.render.RenderSystem()
PYEOF
}

add_backports_source() {
    local codename
    # shellcheck source=/dev/null
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    [ "$codename" = bookworm ] || die "software Vulkan setup is written for Debian 12 (bookworm), found '${codename:-unknown}'"
    if grep -rqsE '(^|[[:space:]])bookworm-backports([[:space:]]|$)' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; then
        log "bookworm-backports already in apt sources"
        return
    fi
    # deb822 (*.sources): the stanza whose Suites include "bookworm" and whose URI is a
    # Debian archive (not debian-security); copy its URIs and Signed-By.
    local file uri signed
    for file in /etc/apt/sources.list.d/*.sources; do
        [ -f "$file" ] || continue
        uri="" signed=""
        read -r uri signed < <(awk '
            function flush() {
                if (suites ~ /(^|[ \t])bookworm([ \t]|$)/ && uris != "" && uris !~ /security/ \
                    && enabled != "no") { print uris, (signed == "" ? "-" : signed); found = 1; exit }
                uris = ""; suites = ""; signed = ""; enabled = ""
            }
            /^[ \t]*$/ { flush(); next }
            /^#/ { next }
            tolower($1) == "uris:" { uris = $2 }
            tolower($1) == "suites:" { $1 = ""; suites = $0 }
            # Only a keyring path is copied; an inline key block is left to the apt defaults.
            tolower($1) == "signed-by:" && $2 ~ /^\// { signed = $2 }
            tolower($1) == "enabled:" { enabled = tolower($2) }
            END { if (!found) flush() }
        ' "$file") || true
        if [ -n "${uri:-}" ]; then
            log "adding bookworm-backports from $uri (as in $file)"
            {
                echo "# Added by JoyNexus scripts/setup-maniskill.sh: Mesa 25 Vulkan for ManiSkill."
                echo "Types: deb"
                echo "URIs: $uri"
                echo "Suites: bookworm-backports"
                echo "Components: main"
                [ "$signed" = - ] || echo "Signed-By: $signed"
            } >"$BACKPORTS_LIST"
            return
        fi
    done
    # One-line format: "deb [options] URI bookworm main ...".
    local line
    line="$(grep -hsE '^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?[^[:space:]]+[[:space:]]+bookworm[[:space:]]' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.list | grep -v security | head -n1 || true)"
    [ -n "$line" ] || die "no Debian bookworm apt source found to derive a backports entry from"
    log "adding bookworm-backports derived from: $line"
    {
        echo "# Added by JoyNexus scripts/setup-maniskill.sh: Mesa 25 Vulkan for ManiSkill."
        echo "$line" | sed -E 's/^([[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?[^[:space:]]+)[[:space:]]+bookworm[[:space:]].*/\1 bookworm-backports main/'
    } >"$BACKPORTS_LINE_LIST"
}

if vulkan_works; then
    log "a Vulkan device works already"
else
    [ "$(id -u)" = 0 ] || die "no working Vulkan device and not root: run this script as root to install Mesa's llvmpipe Vulkan driver from bookworm-backports"
    add_backports_source
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # -t bookworm-backports: Mesa 25 and the LLVM it is built against come from backports;
    # libvulkan1 is the loader (SAPIEN otherwise falls back to its own, with a warning).
    apt-get install -y -q --no-install-recommends -t bookworm-backports \
        mesa-vulkan-drivers libvulkan1 libegl1 libgl1
    vulkan_works || {
        log "Vulkan probe still fails; its output:"
        "$PY" -c "import sapien; sapien.render.RenderSystem()" </dev/null || true
        die "no usable Vulkan device after installing Mesa from bookworm-backports"
    }
    log "Vulkan works with $(dpkg-query -W -f='mesa-vulkan-drivers ${Version}' mesa-vulkan-drivers)"
fi

log "done: $("$PY" -c "import importlib.metadata as m; print('mani-skill', m.version('mani-skill'), 'sapien', m.version('sapien'), 'torch', m.version('torch'), 'gymnasium', m.version('gymnasium'))")"
