#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job: ropekv-replay
# on its built-in default (Llama-3.1-8B, a seeded synthetic serving run).
# Extra arguments go to ropekv-replay, e.g. scripts/run.sh --threads 1.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec build/tools/replay/ropekv-replay "$@"
