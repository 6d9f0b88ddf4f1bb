#!/usr/bin/env bash
# N processes of train.py on this machine, joined by jax.distributed with CPU collectives;
# each simulates its share of the mesh's devices. Process 0 prints to the console, the others
# write to $LCLM_LOG_DIR/process_<i>.log (default: ./logs). Ctrl-C stops all of them.
#
#   launch/local.sh 2 --config configs/demo.py --config.workdir=/tmp/run
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
  echo "usage: launch/local.sh N [train.py arguments]" >&2
  exit 2
fi
n=$1; shift
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
logs=${LCLM_LOG_DIR:-logs}
mkdir -p "$logs"
port=${LCLM_PORT:-$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup INT TERM
for ((i = 0; i < n; i++)); do
  env LCLM_COORDINATOR="127.0.0.1:$port" LCLM_NUM_PROCESSES="$n" LCLM_PROCESS_ID="$i" \
      JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} \
      "$python" "$root/train.py" "$@" > >(bash "$root/launch/quiet_gloo.sh" | if ((i == 0)); then cat; else cat > "$logs/process_$i.log"; fi) 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit "$status"
