#!/usr/bin/env bash
# The staged GPU path (issue 11) on a machine with 2 GPUs, from the repository root; writes under $OUT.
#
#   bash bench/gpu_staged_check.sh tests       # every GPU test (tests/gpu: server, copy, IPC, interpreter) ~6 min
#   bash bench/gpu_staged_check.sh cpu         # the CPU suite (tests/ less gpu/ and vllm/) on this machine
#   bash bench/gpu_staged_check.sh latency     # small pulls + concurrent staged pulls (gpu_latency.py)      ~3 min
#   bash bench/gpu_staged_check.sh throughput  # 1 GiB staged rows, 512 MiB and 2 GiB rings (gpu_pull.py)    ~3 min
#   bash bench/gpu_staged_check.sh bench       # latency, then throughput
#   bash bench/gpu_staged_check.sh all         # everything (past a 10-minute limit: run tests, then bench)
#
# Each part prints its results and a summary; logs, JSON and the docs sections land in $OUT:
#   gpu_tests.log, gpu_tests.xml, cpu_tests.log, gpu_latency.log, gpu_latency.json, gpu_latency_section.md,
#   throughput/gpu_pull.json, throughput/gpu_pull_section.md, throughput.log
# Then, in the checkout: python bench/gpu_latency.py --splice $OUT/gpu_latency_section.md
#                        python bench/gpu_pull.py --splice $OUT/throughput/gpu_pull_section.md
# (the gpu_pull section then holds only the rows of this run's --only config).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvs-staged-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/sidecar:$PWD/client${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
part=${1:-all}
status=0
say() { printf '\n===== %s =====\n' "$*"; }

if [[ $part == tests || $part == all ]]; then
  say "GPU tests"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
  $PY -m pytest -q -rs -p no:cacheprovider tests/gpu --junitxml "$OUT/gpu_tests.xml" \
    --durations=15 >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  tail -n 40 "$OUT/gpu_tests.log"
  echo "GPU tests exit code: $rc"
  ((rc == 0)) || status=1
fi

if [[ $part == cpu ]]; then
  say "CPU suite"
  $PY -m pytest -q -rs -p no:cacheprovider tests --ignore=tests/gpu --ignore=tests/vllm \
    --durations=10 >"$OUT/cpu_tests.log" 2>&1
  rc=$?
  tail -n 40 "$OUT/cpu_tests.log"
  echo "CPU tests exit code: $rc"
  ((rc == 0)) || status=1
fi

if [[ $part == latency || $part == bench || $part == all ]]; then
  say "small pulls and concurrent staged pulls (bench/gpu_latency.py)"
  timeout 300 $PY bench/gpu_latency.py --out "$OUT" --machine "${MACHINE:-2x H200 (lent)}" \
    >"$OUT/gpu_latency.log" 2>&1
  rc=$?
  grep -v "NIXL INFO" "$OUT/gpu_latency.log" | tail -n 45
  echo "gpu_latency exit code: $rc"
  ((rc == 0)) || status=1
fi

if [[ $part == throughput || $part == bench || $part == all ]]; then
  say "1 GiB staged throughput, 512 MiB and 2 GiB rings (bench/gpu_pull.py --only 'homog 16KiB')"
  timeout 280 $PY bench/gpu_pull.py --only "homog 16KiB" --sidecars --nixl --iters 10 --warmup 2 \
    --out "$OUT/throughput" --machine "${MACHINE:-2x H200 (lent)}" >"$OUT/throughput.log" 2>&1
  rc=$?
  if [[ -f $OUT/throughput/gpu_pull_section.md ]]; then
    grep -E "^\| (ceiling|ours via|in-engine)" "$OUT/throughput/gpu_pull_section.md"
  else
    tail -n 30 "$OUT/throughput.log"
  fi
  echo "gpu_pull exit code: $rc"
  ((rc == 0)) || status=1
fi

say "summary"
[[ -f $OUT/cpu_tests.log ]] && grep -E "passed|failed|error" "$OUT/cpu_tests.log" | tail -n 1
[[ -f $OUT/gpu_tests.log ]] && grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -n 1
[[ -f $OUT/gpu_latency_section.md ]] && grep -E "^\|" "$OUT/gpu_latency_section.md"
exit $status
