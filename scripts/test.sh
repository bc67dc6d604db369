#!/usr/bin/env bash
# Install Kiln's test dependencies and run the test suite: the README's second command, and
# what CI runs (.ci/run). In order:
#   1. scripts/install_test_deps.sh: `apt-get install chromium chromium-driver` (through sudo
#      when not root) for the HTML-report browser test. Skipped when both are installed;
#      without apt-get or root it only says so, and the browser test then skips.
#   2. pip install -e ".[test]": Kiln with PyTorch (the CPU wheel pinned in pyproject.toml),
#      onnxruntime, transformers, onnxscript, selenium, ...
#   3. pytest -m "not slow": every test except those marked slow (vgg16 and resnet50, the
#      build checks of all but two zoo models, the optimizer's differential test on ONNX's
#      light models and on the heavier zoo models). The zoo models the tests use are built
#      into the zoo cache ($KILN_ZOO_DIR, else ~/.cache/kiln/zoo) when missing there or
#      built by other package versions.
# Usage: bash scripts/test.sh [--slow] [PYTEST ARGS...]   (--slow: run the slow tests too)
set -euo pipefail
cd "$(dirname "$0")/.."
select=(-m "not slow")
if [ "${1:-}" = "--slow" ]; then
  select=()
  shift
fi
# A line per stage: the first run spends minutes in apt-get and pip before any test runs.
echo "test.sh: [1/3] Chromium for the browser test (apt-get; skipped when installed)" >&2
bash scripts/install_test_deps.sh
echo "test.sh: [2/3] pip install -e \".[test]\" (PyTorch CPU, onnxruntime, ...: minutes the" \
     "first time, seconds after)" >&2
# One line per package pip fetches or installs (-q said nothing for minutes; all of pip's
# output is a hundred "already satisfied" lines on every later run).
python3 -m pip install --progress-bar off -e ".[test]" \
  | { grep --line-buffered -E '^(Collecting|Installing collected|Successfully installed)' \
      || true; }
echo "test.sh: [3/3] pytest ${select[*]+${select[*]}} $* (the first run also builds the zoo" \
     "models the tests use, ~3.5 min on 2 cores, a line each)" >&2
python3 -m pytest -q ${select[@]+"${select[@]}"} "$@"
