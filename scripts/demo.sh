#!/usr/bin/env bash
# Sets everything up and runs the main job. Until the cluster demo exists (issue 8), the main
# job is the storage engine benchmark in quick mode, on this machine's disk.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python benches/engine.py --quick "$@"
