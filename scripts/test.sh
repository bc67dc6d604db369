#!/usr/bin/env bash
# Install Kiln with its test dependencies and run the whole test suite.
# Works on a fresh machine: Debian's chromium (for the HTML-report browser test) is installed
# when apt is available, and the PyTorch CPU wheel is pinned in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x scripts/install_test_deps.sh ] || [ -f scripts/install_test_deps.sh ]; then
  bash scripts/install_test_deps.sh
fi
python3 -m pip install -q -e ".[test]"
python3 -m pytest -q -m "not slow" "$@"
