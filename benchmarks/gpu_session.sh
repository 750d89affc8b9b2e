#!/usr/bin/env bash
# The GPU figures the project lacks most, in one command that fits a lent
# GPU's 15 minutes (about 5 minutes on one H100 with torch 2.11, cold kernel
# caches): torchtitan's pattern beside FSDP2 under the emulated network at 8
# and 64 GPUs (step, first step, peak memory, exposed communication), then
# the whole model compiled at 8, as one graph and with compile regions (the
# default, never yet run on a GPU), and the regions cut in parts
# (--split-regions). Run from the repository root:
#
#     bash benchmarks/gpu_session.sh OUT_DIR
#
# Then CPU offload at world size 1 beside FSDP2, and, where torchao imports,
# float8 all-gather (gpu_check.py --parts f8offload). The GPU machine has no
# network: carry torchao's wheel. Here, once: `echo /.whl/ >> .git/info/exclude;
# pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation
# cp --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0`; there, with
# `.whl` carried, first: `pip install -q --no-index --no-deps --target
# /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site`.
#
# Each table is printed and its JSON written to OUT_DIR. Record what it shows,
# dated and with the GPU's name, in benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash benchmarks/gpu_session.sh OUT_DIR}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# (a checkout without `pip install -e .`: the passes are installed as compiled_fsdp.passes)
[ -e compiled_fsdp/passes ] || ln -s ../passes compiled_fsdp/passes
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
run() {  # name, then emulated.py's arguments
    local name=$1 tmp
    shift
    tmp=$(mktemp -d)
    python3 benchmarks/emulated.py --device cuda --layers 8 --links nccl --out "$tmp" "$@" 2>&1 \
        | tee "$out/$name.log" | grep -v '^RESULT'
    cp "$tmp/emulated.json" "$out/$name.json" 2>/dev/null
    rm -rf "$tmp"
}
run titan_plain --pattern titan_plain --worlds 8 64 --kinds floor ours_blocks fsdp2_blocks --warmup 3 --steps 10
run whole_model --pattern plain --worlds 8 --kinds ours ours_regions --warmup 2 --steps 6
# (every region cut in parts: off by default, as on the CPU its collectives' host work outweighed what it hid)
run regions_split --pattern plain --worlds 8 --kinds ours_regions --split-regions --warmup 2 --steps 6
kinds="offload_ours_compiled offload_ours_blocks offload_fsdp2_blocks"
if python3 -c 'import torchao.float8' 2>/dev/null; then
    kinds="f8_ours_compiled f8_ours_blocks f8_fsdp2_blocks $kinds"
else
    echo "gpu_session: torchao not importable: the float8 rows skipped, the offload rows run"
fi
# shellcheck disable=SC2086
python3 benchmarks/gpu_check.py --parts f8offload --kinds $kinds --out "$out/f8offload" --warmup 2 --steps 4 \
    --worker-timeout 240 2>&1 | tee "$out/f8offload.log" | tail -12
