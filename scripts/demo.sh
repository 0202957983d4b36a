#!/usr/bin/env bash
# Sets up what the demo needs (.venv, the Rust build, the `demo` extra; no system packages) and
# runs the main job: `waltz demo`, a bank ledger on a local cluster of real processes (embedded
# metadata, no ZooKeeper) with a storage node and a server killed midway, ending with its
# verification table. Arguments go to `waltz demo` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo
exec .venv/bin/waltz demo "$@"
