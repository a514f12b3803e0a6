#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs every test: the C++ suite
# through ctest (GoogleTest, the replay runs, the example consumer) and the
# Python suite through pytest, then the C++ suite again under ASan+UBSan and
# TSan, and the fuzz target for a bounded time (scripts/sanitize.sh).
# The GPU tests themselves run on a GPU machine: scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
# The frameworks the Python suite tests where they install (its tests skip
# without them, as on a GPU machine without network): here they must be.
.venv/bin/python -c "import mlx.core, jax, torch, transformers"
.venv/bin/python -m pytest tests/python -q
# The GPU suite's device-agnostic tests on the CPU backend (about 2 minutes
# here, in a process per core up to four: a quarter less than in one), so
# that a change to the Python layer cannot break it unseen between GPU
# sessions; the CUDA-only ones skip.
workers=$(( $(nproc) < 4 ? $(nproc) : 4 ))
ROPEKV_TEST_DEVICE=cpu .venv/bin/python -m pytest tests/gpu/test_cuda.py -q -n "$workers"
scripts/sanitize.sh
