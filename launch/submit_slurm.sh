#!/usr/bin/env bash
# Submit launch/slurm_gpu.sbatch with the cluster shape as options.
#
#   launch/submit_slurm.sh --nodes 4 --gpus-per-node 8 [--per-node] [--dry-run] -- \
#       --config configs/llama7b_256k.py --config.workdir=/shared/runs/7b
set -euo pipefail
nodes=2; gpus=8; per_node=0; dry=0; extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --gpus-per-node) gpus=$2; shift 2 ;;
    --per-node) per_node=1; shift ;;
    --dry-run) dry=1; shift ;;
    --sbatch-arg) extra+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (train.py arguments go after --)" >&2; exit 2 ;;
  esac
done
tasks_per_node=$gpus; procs=$gpus
if ((per_node)); then tasks_per_node=1; procs=1; fi
cmd=(sbatch --nodes="$nodes" --gpus-per-node="$gpus" --ntasks-per-node="$tasks_per_node"
     "--export=ALL,LCLM_PROCS_PER_NODE=$procs" "${extra[@]}"
     "$(dirname "$0")/slurm_gpu.sbatch" "$@")
if ((dry)); then echo "${cmd[*]}"; else "${cmd[@]}"; fi
