#!/usr/bin/env bash
# One GPU check (one H100/H200, < 10 min): install the CUDA jax build, run the kernel tests on
# the GPU and the three kernel benchmarks at a short setting, write ONE JSON of results.
#
#   bash bench/gpu_check.sh [gpu_check.json] [more bench/gpu_check.py options]
#
# Run from a checkout with kvq installed (pip install -e ".[test]"), in the environment to
# test; the install line is bench/gpu_check.py's INSTALL_LINE (`--install-line` prints it).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
[ $# -gt 0 ] && shift

install_line="$(python bench/gpu_check.py --install-line)"
echo "+ ${install_line}"
eval "${install_line}"
unset JAX_PLATFORMS  # the GPU, not the CPU
python bench/gpu_check.py --out "${out}" "$@"
