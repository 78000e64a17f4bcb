#!/usr/bin/env bash
# Install HAProxy for tests/deploy/test_scale_out.py on a Debian/Ubuntu host (CI): the Debian package
# haproxy, with apt, only when missing. The test runs docker/proxy/haproxy.cfg with it in the
# foreground (no service is started). Without it the proxy test is skipped, not failed; with
# this script in .ci/run a failed install fails CI. Progress goes to stderr.
#
#   bash .ci/proxy-setup.sh && python -m pytest tests/deploy/test_scale_out.py
set -euo pipefail

log() { echo ".ci/proxy-setup.sh: $*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi
}

if command -v haproxy >/dev/null 2>&1; then
    log "haproxy: present"
    exit 0
fi
log "installing haproxy with apt"
as_root timeout 600 apt-get update -q >&2
# the package's own /etc/haproxy/haproxy.cfg binds no port, so a haproxy service that the
# host starts with it does not get in the test's way
as_root env DEBIAN_FRONTEND=noninteractive timeout 900 \
    apt-get install -y -q --no-install-recommends haproxy >&2
