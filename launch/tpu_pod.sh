#!/usr/bin/env bash
# lclm on a Cloud TPU VM pod slice: optionally create it, copy this checkout's working tree (or
# clone --repo) to every worker, give every worker a Python >= 3.11 and install lclm[tpu,cloud]
# there (cloud: gcsfs, for a gs:// workdir: a pod slice has no shared disk),
# run the same train.py on all workers (jax.distributed.initialize() reads the TPU metadata),
# and collect each worker's log into ./logs/<name>/.
#
#   launch/tpu_pod.sh --name lclm-v4 --zone us-central2-b --type v4-64 \
#       [--version IMAGE] [--python 3.12] [--create] [--repo GIT_URL] [--dry-run] -- \
#       --config configs/llama7b_256k.py --config.workdir=gs://bucket/runs/7b
# (TPU_NAME, TPU_ZONE, TPU_TYPE, TPU_VERSION, LCLM_PYTHON, LCLM_REPO may be given as environment
# instead.)
#
# Image (--version, used with --create): by default the one Google's "TPU software versions"
# page names for JAX on that TPU generation: v2-alpha-tpuv6e (v6e), v2-alpha-tpuv5 (v5p),
# v2-alpha-tpuv5-lite (v5e), tpu-ubuntu2204-base (v4 and older).
#
# Python: the images' python3 is older than lclm needs (tpu-ubuntu2204-base: Ubuntu 22.04's
# 3.10), so every worker gets its own CPython (--python, default 3.12, at least 3.11) from uv
# (https://docs.astral.sh/uv): uv is taken from the PATH or ~/.local/bin, else installed to
# ~/.local/bin by its official installer (https://astral.sh/uv/install.sh), else by
# `pip install --user uv`; then `uv python install`, a virtual environment lclm/.venv with that
# Python, and `uv pip install -e '.[tpu,cloud]'` into it. train.py runs with lclm/.venv/bin/python.
#
# What is shipped: without --repo, the working tree of this checkout as it is now: tracked files
# (with their uncommitted edits) and untracked files that git does not ignore
# (`git ls-files --cached --others --exclude-standard`), packed into one tar and unpacked into
# lclm/ on every worker (files that an earlier launch shipped and that are gone from the tree
# are removed there; nothing else is). With --repo, each worker clones (or fast-forwards) that
# repository instead. The dry run says which, and which Python.
set -euo pipefail
name=${TPU_NAME:-}; zone=${TPU_ZONE:-}; type=${TPU_TYPE:-}; version=${TPU_VERSION:-}
python_version=${LCLM_PYTHON:-3.12}; repo=${LCLM_REPO:-}; create=0; dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --python) python_version=$2; shift 2 ;;
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
if [[ ! "$python_version" =~ ^3\.([0-9]+)(\.[0-9]+)?$ ]] || ((BASH_REMATCH[1] < 11)); then
  echo "--python $python_version: name a CPython version 3.11 or newer, e.g. --python 3.12" >&2
  exit 2
fi
python_minor=3.${BASH_REMATCH[1]}
if [[ -z "$version" ]]; then  # Google's documented JAX/PyTorch image of each TPU generation
  case "$type" in
    v6e*) version=v2-alpha-tpuv6e ;;
    v5p*) version=v2-alpha-tpuv5 ;;
    v5litepod*|v5e*) version=v2-alpha-tpuv5-lite ;;
    *) version=tpu-ubuntu2204-base ;;
  esac
fi
run() { if ((dry)); then printf '%q ' "$@"; echo; else "$@"; fi; }
ssh_all() { run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$1"; }

if ((create)); then
  run gcloud compute tpus tpu-vm create "$name" --zone="$zone" --accelerator-type="$type" \
      --version="$version"
fi
echo "# python: CPython $python_version from uv on every worker (the image's python3 is" \
     "not used), in lclm/.venv"
if [[ -n "$repo" ]]; then
  echo "# shipping: nothing from here; every worker clones or fast-forwards $repo"
  ssh_all "set -e; [ -d lclm ] || git clone $(printf %q "$repo") lclm
cd lclm && git pull --ff-only"
else  # ship the working tree of this checkout, uncommitted edits and new files included
  root=$(cd "$(dirname "$0")/.." && pwd)
  if ! git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    echo "$root is not a git checkout: pass --repo GIT_URL to have the workers clone one" >&2
    exit 2
  fi
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/lclm-ship.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  list=$tmp/files; tgz=$tmp/lclm-src.tgz
  # tracked (as they are now) + untracked but not ignored; tracked files deleted here are left out
  count=0
  while IFS= read -r -d '' f; do
    if [[ -e "$root/$f" || -L "$root/$f" ]]; then printf '%s\0' "$f"; count=$((count + 1)); fi
  done < <(git -C "$root" ls-files -z --cached --others --exclude-standard) > "$list"
  # files that differ from HEAD (modified, added, deleted, untracked), for the summary line
  changed=$(git -C "$root" status --porcelain --untracked-files=all | wc -l | tr -d ' ')
  if ((changed)); then state="$changed uncommitted change(s) included"; else state="clean"; fi
  echo "# shipping: the working tree of $root: $count files, tracked + untracked not ignored" \
       "($state; HEAD $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none))"
  run tar -C "$root" --null -T "$list" -czf "$tgz"
  run gcloud compute tpus tpu-vm scp "$tgz" "$name:lclm-src.tgz" --zone="$zone" --worker=all
  # unpack over lclm/; files an earlier launch shipped that are gone from the tree are removed,
  # nothing else (the venv, logs, a run directory under lclm/ stay)
  unpack=$(cat <<'EOF'
set -e; mkdir -p lclm; cd lclm; tar -tzf ../lclm-src.tgz | LC_ALL=C sort > .lclm-shipped.new
if [ -f .lclm-shipped ]; then
  LC_ALL=C comm -23 .lclm-shipped .lclm-shipped.new |
    while IFS= read -r f; do rm -f -- "$f" || true; done
fi
tar -xzf ../lclm-src.tgz; mv .lclm-shipped.new .lclm-shipped; rm -f ../lclm-src.tgz
EOF
)
  ssh_all "$unpack"
fi
# a Python >= 3.11 and lclm[tpu,cloud] on every worker (see the header)
setup=$(cat <<'EOF'
set -e; cd lclm; export PATH="$HOME/.local/bin:$PATH"
if ! command -v uv >/dev/null; then
  if curl -LsSf https://astral.sh/uv/install.sh -o /tmp/uv-install.sh; then
    env UV_INSTALL_DIR="$HOME/.local/bin" UV_NO_MODIFY_PATH=1 sh /tmp/uv-install.sh
  else
    python3 -m pip install --user -q uv
  fi
fi
uv python install @PY@
have=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
[ "$have" = @MINOR@ ] || { rm -rf .venv; uv venv -q --python @PY@ .venv; }
uv pip install -q --python .venv/bin/python -e '.[tpu,cloud]'
echo "$(hostname): lclm installed for $(.venv/bin/python --version)"
EOF
)
setup=${setup//@PY@/$python_version}
ssh_all "${setup//@MINOR@/$python_minor}"
train=".venv/bin/python train.py $(printf '%q ' "$@")"
ssh_all "cd lclm && mkdir -p logs && $train 2>&1 | tee logs/worker-\$(hostname).log"
run mkdir -p "logs/$name"
run gcloud compute tpus tpu-vm scp "$name:lclm/logs/*" "logs/$name/" --zone="$zone" --worker=all
