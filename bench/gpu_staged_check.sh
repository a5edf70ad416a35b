#!/usr/bin/env bash
# The staged GPU path (issue 11) on a machine with 2 GPUs, from the repository root; writes under $OUT.
#
#   bash bench/gpu_staged_check.sh tests       # every GPU test (tests/gpu: server, copy, IPC, interpreter), four
#                                              # at a time (GPU_XDIST; empty: one at a time) ~4 min on 2 GPUs;
#                                              # GPU_TESTS picks others (a file), PYTEST_ARGS adds options (-k ...)
#   bash bench/gpu_staged_check.sh cpu         # the CPU suite (tests/ less gpu/ and vllm/) on this machine;
#                                              # PYTEST_ARGS="-n 24" (xdist, from scripts/gpu_wheels.sh) ~3.5 min
#   bash bench/gpu_staged_check.sh startup     # what a process's start-up costs here (bench/startup_cost.py)
#   bash bench/gpu_staged_check.sh latency     # small pulls + concurrent staged pulls (gpu_latency.py)      ~3 min
#   bash bench/gpu_staged_check.sh throughput  # 1 GiB staged rows, 512 MiB and 2 GiB rings of BIG_SLOTS (default 4,8,16) slots ~4 min
#   bash bench/gpu_staged_check.sh bench       # latency, then throughput
#   bash bench/gpu_staged_check.sh scaling     # node scaling: GPU pairs x pulls in flight (node_scaling.py) ~6 min
#   bash bench/gpu_staged_check.sh spread      # a TP 2 pair spread over a sidecar per rank against one sidecar,
#                                              # each rank on a GPU of its own where there are 2+ (spread_ranks.py) ~3 min
#   bash bench/gpu_staged_check.sh host        # issue 11's host rows on this machine (latency.py, cpu_pull.py) ~3 min
#   bash bench/gpu_staged_check.sh all         # everything (past a 10-minute limit: run tests, then bench)
#
# BASELINE_TREE=.baseline: the latency and throughput parts first run another revision's own script and
# packages from that directory (made here with `git archive REV sidecar client bench | tar -x -C .baseline`,
# carried to the GPU machine as an ignored path), into $OUT/baseline/, then this tree's: one run, one machine.
#
# Each part prints its results and a summary; logs, JSON and the docs sections land in $OUT:
#   gpu_tests.log, gpu_tests.xml, cpu_tests.log, gpu_latency.log, gpu_latency.json, gpu_latency_section.md,
#   throughput/gpu_pull.json, throughput/gpu_pull_section.md, throughput.log,
#   host_latency.log, host_cpu_pull.log, benchmarks.md (the checkout's, with the two host sections rewritten)
# Then, in the checkout: python bench/gpu_latency.py --splice $OUT/gpu_latency_section.md
#                        python bench/gpu_pull.py --splice $OUT/throughput/gpu_pull_section.md
# (the gpu_pull section then holds only the rows of this run's --only config); for the host part, copy
# the sections "Pull latency" and "CPU pull" of $OUT/benchmarks.md into docs/benchmarks.md.
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
  # shellcheck disable=SC2086
  $PY -m pytest -q -rs -p no:cacheprovider ${GPU_XDIST--n 4} ${GPU_TESTS:-tests/gpu} --junitxml "$OUT/gpu_tests.xml" \
    --durations=15 ${PYTEST_ARGS:-} >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  tail -n 40 "$OUT/gpu_tests.log"
  echo "GPU tests exit code: $rc"
  ((rc == 0)) || status=1
fi

# Where a process spends its start-up on this machine: imports, CUDA, the NIXL agent, a whole sidecar.
if [[ $part == startup ]]; then
  say "start-up costs"
  $PY bench/startup_cost.py 2>&1 | grep -v "NIXL INFO" | tee "$OUT/startup.log"
fi

# CPU_TESTS picks the tests (default: all but gpu/ and vllm/); PYTEST_ARGS adds options (-x, -k ...).
# A watchdog py-spy dumps every python process when the log has not grown for STALL_S seconds.
if [[ $part == cpu ]]; then
  say "CPU suite"
  # shellcheck disable=SC2086
  $PY -m pytest -q -rs -p no:cacheprovider ${CPU_TESTS:-tests --ignore=tests/gpu --ignore=tests/vllm} \
    -o timeout_method=thread --durations=10 ${PYTEST_ARGS:-} >"$OUT/cpu_tests.log" 2>&1 &
  pytest_pid=$!
  last=0 stalls=0
  while kill -0 $pytest_pid 2>/dev/null; do
    sleep 10
    size=$(stat -c %s "$OUT/cpu_tests.log")
    if ((size == last)); then
      stalls=$((stalls + 10))
      if ((stalls >= ${STALL_S:-60})) && command -v py-spy >/dev/null; then
        for pid in $(pgrep -f python); do
          { echo "=== $pid: $(tr '\0' ' ' </proc/$pid/cmdline | cut -c1-200)"; py-spy dump --pid "$pid" 2>&1; } \
            >>"$OUT/stalled_stacks.txt"
        done
        echo "stalled ${stalls}s at $(tail -c 300 "$OUT/cpu_tests.log" | tr '\n' ' ')" >>"$OUT/stalled_stacks.txt"
        stalls=0
      fi
    else
      stalls=0
    fi
    last=$size
  done
  wait $pytest_pid
  rc=$?
  tail -n 40 "$OUT/cpu_tests.log"
  echo "CPU tests exit code: $rc"
  ((rc == 0)) || status=1
fi

if [[ -n ${BASELINE_TREE:-} && $part =~ ^(latency|throughput|bench)$ ]]; then
  say "baseline ($BASELINE_TREE): $part"
  OUT="$OUT/baseline" bash "$BASELINE_TREE/bench/gpu_staged_check.sh" "$part" | grep -v "NIXL INFO" | tail -n 25
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
  timeout 420 $PY bench/gpu_pull.py --only "homog 16KiB" --sidecars --nixl --iters 10 --warmup 2 --big-slots "${BIG_SLOTS:-4,8,16}" \
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

# Node scaling (issue 32): GPU pairs x pulls in flight x pull size, both GPU paths, engines as processes.
# PAIRS (default 1,2), SCALING_PATHS, SCALING_ARGS (more options); BASELINE_TREE adds that tree's
# sidecars side by side; PROFILE=1 py-spies both sidecars at 16 in flight into $OUT/profile.tgz.
if [[ $part == scaling ]]; then
  say "node scaling (bench/node_scaling.py)"
  # A small row first: a set-up that fails costs seconds, not the whole run.
  timeout 240 $PY bench/node_scaling.py --paths gpu-staged --pairs 1 --concurrency 1 --blocks 1 --pulls 20 \
    --out "$OUT/smoke" >"$OUT/scaling_smoke.log" 2>&1 || { grep -v "NIXL INFO" "$OUT/scaling_smoke.log" | tail -n 40; exit 1; }
  base=()
  [[ -n ${BASELINE_TREE:-} ]] && base=(--baseline-tree "$BASELINE_TREE")
  # shellcheck disable=SC2086
  timeout "${SCALING_TIMEOUT:-420}" $PY bench/node_scaling.py --paths "${SCALING_PATHS:-gpu-staged,gpu-direct}" \
    --pairs "${PAIRS:-1,2}" "${base[@]}" ${PROFILE:+--profile "$OUT/profile"} ${SCALING_ARGS:-} --out "$OUT" \
    2>&1 | grep -v "NIXL INFO" | tee "$OUT/scaling.log" | grep -v "^|"
  rc=${PIPESTATUS[0]}
  [[ -d $OUT/profile ]] && tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -rf "$OUT/profile"
  rm -rf "$OUT/smoke"
  echo "node_scaling exit code: $rc"
  ((rc == 0)) || status=1
fi

# control_shard_ranks: spread timed (issue 32): 1 MiB and 32 MiB a rank, ranks placed on this machine's GPUs.
if [[ $part == spread ]]; then
  say "spread ranks against whole (bench/spread_ranks.py)"
  n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  ((n_gpus >= 1)) || n_gpus=1
  for blocks in 1 32; do
    pulls=$((blocks == 1 ? 4096 : 256))
    timeout 300 $PY bench/spread_ranks.py --gpu --gpus "$n_gpus" --blocks "$blocks" --pulls "$pulls" \
      --rounds "${ROUNDS:-3}" --no-write --out "$OUT/spread_b$blocks" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/spread_b$blocks.log" | tail -n 12
    rc=${PIPESTATUS[0]}
    echo "spread_ranks --blocks $blocks exit code: $rc"
    ((rc == 0)) || status=1
  done
fi

# The host rows of issue 11 (one-block pulls, CPU host-nixl throughput) on this machine's idle cores.
if [[ $part == host || $part == all ]]; then
  say "host pulls: one-block latency (bench/latency.py), throughput (bench/cpu_pull.py)"
  timeout 240 $PY bench/latency.py --iters 300 --first-contact 10 >"$OUT/host_latency.log" 2>&1
  rc=$?
  grep -E "^\|" "$OUT/host_latency.log" | tail -n 16
  echo "latency exit code: $rc"
  ((rc == 0)) || status=1
  timeout 240 $PY bench/cpu_pull.py --max-mib 16 --iters 10 >"$OUT/host_cpu_pull.log" 2>&1
  rc=$?
  grep -E "^\| homogeneous" "$OUT/host_cpu_pull.log"
  echo "cpu_pull exit code: $rc"
  ((rc == 0)) || status=1
  cp docs/benchmarks.md "$OUT/benchmarks.md"
fi

say "summary"
[[ -f $OUT/cpu_tests.log ]] && grep -E "passed|failed|error" "$OUT/cpu_tests.log" | tail -n 1
[[ -f $OUT/gpu_tests.log ]] && grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -n 1
[[ -f $OUT/gpu_latency_section.md ]] && grep -E "^\|" "$OUT/gpu_latency_section.md"
exit $status
