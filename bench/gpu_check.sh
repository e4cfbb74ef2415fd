#!/usr/bin/env bash
# One GPU check on the lent machine as it is (Python 3.12, its own jax / torch / triton, no
# package index): kvq runs from this working tree (PYTHONPATH); nothing is installed or fetched.
# Kernel tests on the GPU, the three kernel benchmarks, the kernels' compiled resources: one
# JSON, one table (bench/gpu_check.py says what each step does).
#
#   bash bench/gpu_check.sh [gpu_check.json] [--dry-run] [more bench/gpu_check.py options]
#
# --dry-run: every step on the CPU at the smallest settings (CI runs it on the device's stack).
# PYTHON=/path/to/python picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
[ $# -gt 0 ] && shift
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python3}" bench/gpu_check.py --out "${out}" "$@"
