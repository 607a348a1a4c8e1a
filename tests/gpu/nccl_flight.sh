#!/usr/bin/env bash
# The hang forensics' check on a machine with an NVIDIA GPU, where NCCL's
# own heartbeat monitor runs (CI has no GPU: there the monitor is a test
# double, tests/fixtures/nccl_monitor_double). Simulated pods (127.0.0.N)
# run tests/fixtures/stall_job.py over NCCL on the machine's GPUs
# (STALL_BACKEND=nccl: ranks may share one GPU, each naming its own NCCL
# host); rank 2 sleeps at step 3 while the others wait for their
# all_reduce. trainlet must find each worker's monitor thread
# (pt_nccl_heartbt), ask for the dumps through exception_dump in the worker
# store, read NCCL's dumps (no variable set: torch's default, in its cache
# directory, e.g. ~/.cache/torch/nccl_trace_rank_N with torch 2.11) and name
# rank 2 from the Flight Recorder's sequence numbers.
# Two jobs: 2 pods x 2 workers, then 4 pods x 1.
#
# Usage, from the repository root: bash tests/gpu/nccl_flight.sh [TRAINLET]
# (default: the release build). The pods' output and reports go under $OUT
# (default /tmp/nccl-flight); it exits non-zero when a check fails, each
# failed check on a FAILED line. Needs python3 with a CUDA build of torch.
set -u
bin=${1:-target/x86_64-unknown-linux-gnu/release/trainlet}
out=${OUT:-/tmp/nccl-flight}
mkdir -p "$out"
fail=0
# Where torch writes a dump when no variable names the file.
cache=${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/torch
check() { if eval "$2"; then echo "ok: $1"; else echo "FAILED: $1"; fail=1; fi; }

[ -x "$bin" ] || { echo "error: no trainlet at $bin (build it: cargo build --release)"; exit 2; }
nvidia-smi -L || { echo "error: no NVIDIA GPU here (nvidia-smi -L failed)"; exit 2; }
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())' ||
  { echo "error: python3 has no CUDA build of torch"; exit 2; }

# The report's verdict and each rank's Flight Recorder summary.
show_report() {
  python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
print("report stall:", r.get("stall"))
for s in r.get("stacks", []):
    print("rank", s.get("rank"), "flight:", json.dumps(s.get("flight")))
' "$1"
}

# One job of $1 pods x $2 workers; its files under $out/$1x$2.
job() {
  local nnodes=$1 nproc=$2 world=$(($1 * $2)) dir=$out/$1x$2 i r p d report
  echo "=== $nnodes pods x $nproc workers"
  rm -rf "$dir" && rm -f "$cache"/*_trace_rank_* && mkdir -p "$dir"
  local port=$((20000 + RANDOM % 20000)) pids=() codes=()
  SECONDS=0
  for ((i = 0; i < nnodes; i++)); do
    mkdir -p "$dir/pod$i"
    # --preflight none: its count check refuses more workers than GPUs.
    env PET_NNODES="$nnodes" PET_NPROC_PER_NODE="$nproc" PET_NODE_RANK=$i PET_MASTER_ADDR=127.0.0.1 \
      PET_MASTER_PORT=$port PET_LOCAL_ADDR=127.0.0.$((i + 1)) STALL_RANK=2 STALL_HOW=sleep \
      STALL_BACKEND=nccl NCCL_SOCKET_IFNAME=lo TRAINLET_TERMINATION_LOG="$dir/pod$i/termination-log" \
      timeout 240 "$bin" run --preflight none --progress-timeout 5 --max-restarts 0 \
      --log-dir "$dir/pod$i/logs" tests/fixtures/stall_job.py >"$dir/pod$i/stdout" 2>"$dir/pod$i/stderr" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do
    wait "$p"
    codes+=($?)
  done
  echo "the pods ended with ${codes[*]} after $SECONDS s"
  for ((i = 0; i < nnodes; i++)); do
    d=$dir/pod$i
    check "pod $i ends 206 (hang)" "[ ${codes[$i]} = 206 ]"
    check "pod $i found NCCL's monitor and waited for the dumps" \
      "grep -q \"waiting for the workers' Flight Recorder dumps\" '$d/stderr'"
    check "pod $i names rank 2 from the Flight Recorder" \
      "grep -q 'the job hung: rank 2 never entered all_reduce #[0-9]* of default_pg (Flight Recorder), which the other $((world - 1)) wait in: stall_job.py:[0-9]* in stall_here' '$d/stderr'"
    report=$(ls "$d"/logs/*/failure_report.json 2>/dev/null | head -1)
    if [ -n "$report" ]; then show_report "$report"; else check "pod $i wrote failure_report.json" false; fi
  done
  ls -la "$cache"/*_trace_rank_* 2>&1
  for ((r = 0; r < world; r++)); do
    check "NCCL wrote rank $r's dump in $cache" "ls '$cache'/*_trace_rank_$r >/dev/null 2>&1"
  done
  cp "$cache"/*_trace_rank_* "$dir/" 2>/dev/null
  echo "--- NCCL's lines, counted:"
  grep -ho "Observed flight recorder dump signal.*\|Finished flight recorder.*\|Terminating the process.*\|Duplicate GPU.*" \
    "$dir"/pod*/std* | cut -c1-120 | sort | uniq -c
  echo "--- the end of pod 0's log:"
  tail -n 40 "$dir/pod0/stderr" | cut -c1-400
}

job 2 2
job 4 1
exit $fail
