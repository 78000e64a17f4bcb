#!/usr/bin/env bash
# Prepare podman for tests/deploy/test_docker.py on a Debian/Ubuntu host without a Docker engine (CI).
#
#   eval "$(bash docker/ci-setup.sh)"      # then: python -m pytest tests/deploy/test_docker.py
#
# 1. installs podman, debootstrap and runc with apt when missing;
# 2. writes a containers.conf (runc, no default ulimits: this sandbox cannot raise them);
# 3. builds the base image (debootstrap: Debian bookworm minbase with python3, venv, pip and
#    the host's CA bundle) once, and keeps it: a later run reuses it;
# 4. prints, on stdout, the `export` lines the test reads: CONTAINERS_CONF,
#    TFSERVE_DOCKER_TESTS=1, TFSERVE_DOCKER_BASE and TFSERVE_TORCH_WHEELS (a local directory
#    holding the CPU torch wheel, mounted into the build) when one is found.
# Progress goes to stderr. No container registry is needed.
#
# Settings (env): TFSERVE_DOCKER_STATE (where containers.conf lives; default
# /var/cache/tfserve-docker), TFSERVE_DOCKER_BASE (the base image's name; default
# localhost/tfserve-base:bookworm), DEBOOTSTRAP_MIRROR (default deb.debian.org),
# TFSERVE_TORCH_WHEELS (default: pip's find-links when it holds a torch wheel).
set -euo pipefail

STATE=${TFSERVE_DOCKER_STATE:-/var/cache/tfserve-docker}
BASE_IMAGE=${TFSERVE_DOCKER_BASE:-localhost/tfserve-base:bookworm}
SUITE=bookworm
MIRROR=${DEBOOTSTRAP_MIRROR:-http://deb.debian.org/debian}

log() { echo "docker/ci-setup.sh: $*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi
}

missing=()
for tool in podman debootstrap runc; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} with apt"
    as_root timeout 600 apt-get update -q >&2
    as_root env DEBIAN_FRONTEND=noninteractive timeout 900 \
        apt-get install -y -q podman debootstrap runc >&2
fi

mkdir -p "$STATE"
CONF="$STATE/containers.conf"
cat > "$CONF" <<'EOF'
# written by docker/ci-setup.sh
[containers]
default_ulimits = []

[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$CONF"

if podman image exists "$BASE_IMAGE"; then
    log "base image $BASE_IMAGE: present, reused"
else
    log "building the base image $BASE_IMAGE with debootstrap ($SUITE, minbase)"
    ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/tfserve-rootfs.XXXXXX")
    trap 'as_root rm -rf "$ROOTFS"' EXIT
    as_root timeout 900 debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates \
        "$SUITE" "$ROOTFS" "$MIRROR" >&2
    as_root rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    # this network's TLS needs the host's CA bundle (pip inside the build reaches PyPI)
    as_root cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
    as_root tar -C "$ROOTFS" -c . | podman import - "$BASE_IMAGE" >&2
    as_root rm -rf "$ROOTFS"
    trap - EXIT
fi

WHEELS=${TFSERVE_TORCH_WHEELS:-}
if [ -z "$WHEELS" ]; then
    for dir in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
        if compgen -G "$dir/torch-*.whl" >/dev/null; then WHEELS=$dir; break; fi
    done
fi

echo "export CONTAINERS_CONF=$CONF"
echo "export TFSERVE_DOCKER_TESTS=1"
echo "export TFSERVE_DOCKER_BASE=$BASE_IMAGE"
if [ -n "$WHEELS" ]; then
    echo "export TFSERVE_TORCH_WHEELS=$WHEELS"
else
    log "no local torch wheel found: the build installs torch from the CPU wheel index"
fi
