#!/usr/bin/env bash
# Sets up Waltz from this checkout: a virtualenv in .venv with the native extension (release
# build) installed in editable mode.
#
#   bash scripts/setup.sh          everything the tests and benchmarks need: system packages
#                                  (strace, ZooKeeper and a JRE, PostgreSQL), every extra, and
#                                  the `test` and `bench` dependency groups
#   bash scripts/setup.sh --demo   only what `waltz demo` needs: the `demo` extra, no system
#                                  packages (the demo runs on embedded metadata)
#
# Both need a Rust toolchain to build the engine. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=full
case "${1:-}" in
  "") ;;
  --demo) mode=demo ;;
  *) echo "usage: bash scripts/setup.sh [--demo]" >&2; exit 2 ;;
esac

if [ "$mode" = full ]; then
  need_apt=()
  command -v strace >/dev/null || need_apt+=(strace)
  # Real ZooKeeper for the integration tests (the demo runs on the embedded store without it).
  [ -f /usr/share/java/zookeeper.jar ] || need_apt+=(zookeeper)
  command -v java >/dev/null || need_apt+=(default-jre-headless)
  # A real PostgreSQL for the client's exactly-once tests (waltz.client.sql).
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
  # systemd-analyze and systemd-sysusers check the unit files of deploy/systemd (tests/deploy).
  command -v systemd-analyze >/dev/null || need_apt+=(systemd)
  # libfuse 2 for the torture runs' LazyFS-style file system (waltz.torture.lazyfs, via fusepy).
  ldconfig -p | grep -q 'libfuse\.so\.2' || need_apt+=(libfuse2)
  if ((${#need_apt[@]})); then
    if [ "$(id -u)" = 0 ]; then
      echo "setup: installing ${need_apt[*]} (apt)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
    else
      echo "setup: please install: ${need_apt[*]} (sudo apt-get install ${need_apt[*]})" >&2
      exit 1
    fi
  fi
fi

if ! command -v cargo >/dev/null; then
  echo "setup: a Rust toolchain (cargo, rustc >= 1.80) is required to build the storage engine" >&2
  echo "setup: (without one: pip install 'waltz-log[demo]' installs a prebuilt wheel)" >&2
  exit 1
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
# pip >= 25.1 installs PEP 735 dependency groups (--group).
.venv/bin/python -m pip install -q --upgrade 'pip>=25.1'
# The distribution was called `waltz` before it became `waltz-log`: both would own the same
# files and commands, so the old one goes first (uninstalling it later would delete the commands).
if .venv/bin/python -m pip show -q waltz >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y waltz
fi
if [ "$mode" = demo ]; then
  echo "setup: building the native engine and installing waltz-log[demo] (first build takes a minute or two)"
  .venv/bin/python -m pip install -q -e '.[demo]'
else
  echo "setup: building the native engine and installing waltz-log[all] and the test and bench groups (first build takes a minute or two)"
  .venv/bin/python -m pip install -q -e '.[all]' --group test --group bench
fi
.venv/bin/python -c "import waltz; print('setup: waltz', waltz.__version__, 'ready in .venv')"
