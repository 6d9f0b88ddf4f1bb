#!/usr/bin/env bash
# lclm on a Cloud TPU VM pod slice: optionally create it, copy this checkout (or clone
# --repo) to every worker and install lclm[tpu] there,
# run the same train.py on all workers (jax.distributed.initialize() reads the TPU metadata),
# and collect each worker's log into ./logs/<name>/.
#
#   launch/tpu_pod.sh --name lclm-v4 --zone us-central2-b --type v4-64 \
#       --version tpu-ubuntu2204-base [--create] [--repo GIT_URL] [--dry-run] -- \
#       --config configs/llama7b_256k.py --config.workdir=gs://bucket/runs/7b
# (TPU_NAME, TPU_ZONE, TPU_TYPE, TPU_VERSION, LCLM_REPO may be given as environment instead.)
set -euo pipefail
name=${TPU_NAME:-}; zone=${TPU_ZONE:-}; type=${TPU_TYPE:-}; version=${TPU_VERSION:-tpu-ubuntu2204-base}
repo=${LCLM_REPO:-}; create=0; dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --repo) repo=$2; shift 2 ;;
    --create) create=1; shift ;;
    --dry-run) dry=1; shift ;;
    --) shift; break ;;
    *) echo "unknown option $1 (train.py arguments go after --)" >&2; exit 2 ;;
  esac
done
if [[ -z "$name" || -z "$zone" ]] || { ((create)) && [[ -z "$type" ]]; }; then
  echo "need --name and --zone (and --type with --create)" >&2
  exit 2
fi
run() { if ((dry)); then printf '%q ' "$@"; echo; else "$@"; fi; }
ssh_all() { run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$1"; }

if ((create)); then
  run gcloud compute tpus tpu-vm create "$name" --zone="$zone" --accelerator-type="$type" \
      --version="$version"
fi
if [[ -n "$repo" ]]; then
  ssh_all "set -e; [ -d lclm ] || git clone $repo lclm; cd lclm && git pull --ff-only"
else  # ship the committed state of this checkout
  root=$(cd "$(dirname "$0")/.." && pwd)
  run git -C "$root" archive --format=tar.gz -o /tmp/lclm-src.tgz HEAD
  run gcloud compute tpus tpu-vm scp /tmp/lclm-src.tgz "$name:" --zone="$zone" --worker=all
  ssh_all "set -e; mkdir -p lclm && tar -xzf lclm-src.tgz -C lclm"
fi
ssh_all "cd lclm && python3 -m pip install -q -e '.[tpu]'"
train_args=$(printf '%q ' "$@")
ssh_all "cd lclm && mkdir -p logs && python3 train.py $train_args 2>&1 | tee logs/worker-\$(hostname).log"
run mkdir -p "logs/$name"
run gcloud compute tpus tpu-vm scp "$name:lclm/logs/*" "logs/$name/" --zone="$zone" --worker=all
