#!/usr/bin/env bash
# Kiln on a GPU machine in one command, against the CUDA build of torch found there.
#
#   benchmarks/gpu_run.sh check            # CUDA tests, ONNX conformance on cuda and cpu,
#                                          # every zoo model's accuracy on the GPU
#   benchmarks/gpu_run.sh quick            # the CUDA tests, conformance on cuda, zoo on cuda
#   benchmarks/gpu_run.sh speed [ARGS...]  # benchmarks/gpu_speed.py ARGS
#   benchmarks/gpu_run.sh accuracy         # benchmarks/gpu_accuracy.py: errors per precision
#
# Missing pure-Python dependencies travel as wheels in .whl/ (see the device notes);
# the zoo is built there, in $KILN_ZOO_DIR. Logs and JSON go to $OUT (default /tmp/kiln-gpu).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export KILN_ZOO_DIR=${KILN_ZOO_DIR:-/tmp/kiln-zoo}
log=$OUT/$1.log
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, onnx, onnxruntime, numpy, sys; print('python', sys.version.split()[0],
'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(),
'onnx', onnx.__version__, 'onnxruntime', onnxruntime.__version__, 'numpy', numpy.__version__)"
  lscpu | grep -m1 "Model name"
  echo "cores $(nproc)"
} 2>&1 | tee "$log"

zoo_in_background() {  # the zoo, built while the tests run
  (python3 -c "from kiln import zoo; zoo.build(progress=False)" >"$OUT/zoo_build.txt" 2>&1
   echo "zoo build exit $?" >>"$OUT/zoo_build.txt") &
  zoo_pid=$!
}
section() {  # section TITLE PATTERN CMD...: run CMD into the log, show its PATTERN lines
  local title=$1 pattern=$2 part
  shift 2
  part=$(mktemp)
  echo "== $title" | tee -a "$log"
  timeout 300 "$@" >"$part" 2>&1
  cat "$part" >>"$log"
  grep -E "$pattern" "$part" | tail -14
}
torch_tests() {
  section "tests/runtime/test_torch_backend.py $*" "^FAILED|passed|failed" \
    python3 -m pytest -q -p no:cacheprovider -rfs tests/runtime/test_torch_backend.py "$@"
}
conformance() {
  section "conformance, torch on $1" "^FAILED|passed" python3 -W ignore -m kiln.conformance \
    --backend torch --device "$1" -j 8 --json "$OUT/conformance_$1.json"
}
zoo_tests() {
  wait "$zoo_pid"
  grep -E "FAILED|exit" "$OUT/zoo_build.txt" | tee -a "$log"
  if [ "${1:-}" = accuracy ]; then
    section "zoo accuracy on cuda" "ERROR| fp32 .*tol NO" \
      python3 benchmarks/gpu_accuracy.py --json "$OUT/accuracy.json"
  fi
  section "tests/cli/test_zoo_models.py -k cuda" "^FAILED|passed|failed|skipped" \
    python3 -m pytest -q -p no:cacheprovider -rf tests/cli/test_zoo_models.py -k cuda
}

case "$1" in
check)
  zoo_in_background
  torch_tests
  conformance cuda
  conformance cpu
  zoo_tests accuracy
  ;;
quick)
  zoo_in_background
  torch_tests -k "cuda or bad_options or constant_slices"
  conformance cuda
  zoo_tests
  ;;
speed)
  python3 benchmarks/gpu_speed.py --json "$OUT/speed.json" "${@:2}" 2>&1 | tee -a "$log"
  ;;
accuracy)
  section "zoo accuracy on cuda" "ERROR|rel_l2" \
    python3 benchmarks/gpu_accuracy.py --json "$OUT/accuracy.json" "${@:2}"
  ;;
*)
  echo "usage: $0 check|quick|speed|accuracy [ARGS...]" >&2
  exit 2
  ;;
esac
