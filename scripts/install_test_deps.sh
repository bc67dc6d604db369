#!/usr/bin/env bash
# Test dependencies pip cannot install: Debian's chromium and chromium-driver, which the
# HTML-report browser test (tests/cli/test_report_browser.py) drives through selenium.
# Does nothing when both are already installed; without apt-get or root it says so and
# leaves the browser test to skip.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_test_deps: no apt-get here; install Chromium and chromedriver yourself" \
       "(the browser test skips without them)" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo"
  else
    echo "install_test_deps: not root; run: sudo apt-get install chromium chromium-driver" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
chromium --version
