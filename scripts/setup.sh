#!/usr/bin/env bash
# Sets up everything Waltz needs on a fresh machine of this project's kind: system packages,
# a virtualenv in .venv, the native extension (release build) and the Python dependencies.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v strace >/dev/null || need_apt+=(strace)
# Real ZooKeeper for the integration tests (the demo runs on the embedded store without it).
[ -f /usr/share/java/zookeeper.jar ] || need_apt+=(zookeeper)
command -v java >/dev/null || need_apt+=(default-jre-headless)
# A real PostgreSQL for the client's exactly-once tests (waltz.client.sql).
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
# systemd-analyze and systemd-sysusers check the unit files of deploy/systemd (tests/deploy).
command -v systemd-analyze >/dev/null || need_apt+=(systemd)
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${need_apt[*]} (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: please install: ${need_apt[*]} (sudo apt-get install ${need_apt[*]})" >&2
    exit 1
  fi
fi

if ! command -v cargo >/dev/null; then
  echo "setup: a Rust toolchain (cargo, rustc >= 1.80) is required to build the storage engine" >&2
  exit 1
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
extras=${WALTZ_EXTRAS:-test,arrow,bench,sql,spark}
echo "setup: building the native engine and installing waltz[$extras] (first build takes a minute or two)"
.venv/bin/python -m pip install -q -e ".[${extras}]"
.venv/bin/python -c "import waltz; print('setup: waltz', waltz.__version__, 'ready in .venv')"
