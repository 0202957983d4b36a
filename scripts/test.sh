#!/usr/bin/env bash
# Sets everything up, then runs every test: the Rust unit tests, the pytest suite, and the
# wheel check (scripts/check_wheel.sh: the distributable wheel installed and run without a Rust
# toolchain; WALTZ_WHEEL_CHECK=0 skips it). Slow variants (long crash loops, big benchmarks) are
# marked `slow` and skipped unless WALTZ_SLOW=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== cargo fmt --check (rustfmt.toml)"
cargo fmt --check
cargo fmt --check --manifest-path fuzz/Cargo.toml

echo "== ruff format --check, ruff check ([tool.ruff] in pyproject.toml)"
.venv/bin/ruff format --check .
.venv/bin/ruff check .

echo "== cargo test (engine units)"
cargo test --quiet --no-default-features

wheel_rc=0
if [ "${WALTZ_WHEEL_CHECK:-1}" != 0 ]; then
  echo "== wheel check"
  # Before pytest, so that pytest's summary closes the output; a failure here still fails the
  # run after the suite has run, so one CI run reports both.
  bash scripts/check_wheel.sh || wheel_rc=1
fi

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
  rc=1
fi

[ "$rc" != 0 ] || rc=$wheel_rc
[ "$wheel_rc" = 0 ] || echo "the wheel check failed (above)" >&2
exit "$rc"
