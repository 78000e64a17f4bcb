#!/usr/bin/env bash
# Install headless Chromium and its WebDriver for tests/serving/test_playground.py on a Debian/Ubuntu
# host (CI): the Debian packages chromium and chromium-driver, with apt, only when missing.
# Without them the playground test is skipped, not failed; with this script in .ci/run a
# failed install fails CI. Progress goes to stderr.
#
#   bash .ci/browser-setup.sh && python -m pytest tests/serving/test_playground.py
set -euo pipefail

log() { echo ".ci/browser-setup.sh: $*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi
}

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    log "chromium and chromedriver: present"
    exit 0
fi
log "installing chromium and chromium-driver with apt"
as_root timeout 600 apt-get update -q >&2
as_root env DEBIAN_FRONTEND=noninteractive timeout 900 \
    apt-get install -y -q --no-install-recommends chromium chromium-driver >&2
