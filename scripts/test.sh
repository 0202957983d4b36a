#!/usr/bin/env bash
# Sets everything up, then runs every test: the Rust unit tests and the pytest suite.
# Slow variants (long crash loops, big benchmarks) are marked `slow` and skipped unless
# WALTZ_SLOW=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== cargo fmt --check (rustfmt.toml)"
cargo fmt --check
cargo fmt --check --manifest-path fuzz/Cargo.toml

echo "== cargo test (engine units)"
cargo test --quiet --no-default-features

echo "== pytest"
# The Spark tests (marked `spark`) are part of the suite here: a missing PySpark fails the run.
export WALTZ_REQUIRE_SPARK=1
markers=${WALTZ_SLOW:+"slow or not slow"}
set +e
.venv/bin/python -m pytest -m "${markers:-not slow}" "$@"  # a later -m overrides pyproject's
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
