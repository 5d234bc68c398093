#!/bin/sh
# liferaft's CUDA paths on a GPU, with correctness checks (benchmarks/gpu_check.py): async save from GPU tensors
# (pinned pool, side-stream copies, events) saved == original bitwise, the per-step mode killed and resumed ==
# uninterrupted bitwise, and the D2H bandwidth achieved vs the copy engine's limit. Exit status non-zero on any
# mismatch; without a GPU it says so and runs the checks on the CPU (--require-gpu: exit 3 instead).
#   sh benchmarks/gpu_check.sh [--mib 1024] [--require-gpu]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
PYTHONPATH="$here/../src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" "$here/gpu_check.py" "$@"
