#!/usr/bin/env bash
# onnxruntime's own Python API tests as the judge of kiln.onnxruntime (issue 40): runs
# ../shared/ort_api/run.py (onnxruntime's tests, kept beside the repository, never in it)
# with the real onnxruntime and with kiln.onnxruntime in its place, and fails when Kiln
# passes fewer of them than MIN, the figure reached so far (so it can only go up).
# About 4 minutes on 2 cores. Usage: bash scripts/ort_api.sh [RESULTS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
MIN=87
judge=""
for d in "${KILN_ORT_API:-}" ../shared/ort_api ../../shared/ort_api; do
  if [ -n "$d" ] && [ -f "$d/run.py" ]; then judge="$d"; break; fi
done
if [ -z "$judge" ]; then
  echo "ort_api: the judge (../shared/ort_api/run.py, or \$KILN_ORT_API) is not here"
  [ "${CI:-}" = "true" ] && exit 1
  exit 0
fi
out="${1:-$(mktemp -d)}"
mkdir -p "$out"
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python3 "$judge/run.py" --out "$out" \
  > "$out/log.txt" 2>&1 || { tail -n 40 "$out/log.txt"; exit 1; }
line=$(grep "^ort_api: kiln passes" "$out/log.txt" | tail -n 1)
echo "$line (details: $out/results.md)"
read -r passed total < <(echo "$line" | sed -n 's/.*passes \([0-9]*\) of the \([0-9]*\) .*/\1 \2/p')
echo "ort_api: ${passed} passed, $((total - passed)) failed"
if [ "${passed:-0}" -lt "$MIN" ]; then
  echo "ort_api: Kiln passes ${passed:-0}, fewer than the $MIN reached before"
  exit 1
fi
