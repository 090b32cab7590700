#!/usr/bin/env bash
# Headless Chromium + chromedriver for tests/test_site.py, from Debian's packages. Idempotent: does nothing when both
# are already on PATH. Needs root (CI runs as root); without it, says what to run and exits 0 so the test can skip
# with a reason outside CI (in CI, where CI is set, the test fails instead).
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if have chromium && have chromedriver; then
  echo "chromium: $(chromium --version 2>/dev/null | head -1)"; exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "chromium/chromedriver missing and not root: run 'sudo apt-get install -y chromium chromium-driver'" >&2
  exit 0
fi
if ! have apt-get; then
  echo "chromium/chromedriver missing and apt-get is not available: install Chromium and chromedriver yourself" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q chromium chromium-driver >/dev/null
have chromium && have chromedriver || { echo "installing chromium failed" >&2; exit 1; }
echo "installed $(chromium --version 2>/dev/null | head -1)"
