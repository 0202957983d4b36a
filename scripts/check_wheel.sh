#!/usr/bin/env bash
# What a user without a Rust toolchain gets: builds the wheel (scripts/wheel.sh), installs it
# into a fresh venv in a temporary directory with no cargo or rustc on PATH, and runs it:
#  1. the core install alone (what an application's client needs): no optional dependency comes
#     with it, the engine appends and reads back, a client commits and applies transactions
#     through a local cluster of `waltz-node` processes (scripts/check_wheel_client.py),
#     `waltz-node --version` prints Cargo.toml's version, and `waltz` without the `cli` extra
#     is one line and exit 2;
#  2. with the `demo` extra: `waltz --version`, then `waltz demo --short` (a local cluster of
#     real processes, client processes, kills, the verification table).
# Called by scripts/test.sh after pytest, so CI runs it. Prints how long each part took.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
started=$SECONDS

bash scripts/wheel.sh
built=$SECONDS
wheel=$(ls "$repo"/dist/*.whl)
expected=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m venv "$tmp/venv"
# The venv's python links to the interpreter it was made from and needs no PATH. Nothing else
# of the build host is reachable: no cargo, rustc or maturin, nor the source tree (run in $tmp).
clean=(env "PATH=$tmp/venv/bin:/usr/bin:/bin" "PYTHONPATH=" "VIRTUAL_ENV=$tmp/venv")
in_venv() { (cd "$tmp" && "${clean[@]}" "$@"); }
if in_venv sh -c 'command -v cargo || command -v rustc || command -v maturin'; then
  echo "check_wheel: a Rust toolchain is still on PATH" >&2
  exit 1
fi
in_venv python -m pip install -q --upgrade pip

echo "check_wheel: the core install (no extras)"
in_venv python -m pip install -q --only-binary waltz-log "$wheel"
in_venv python "$repo/scripts/check_wheel_client.py" "$tmp/venv" "$expected"
version=$(in_venv waltz-node --version)
[ "$version" = "waltz-node $expected" ] || { echo "check_wheel: waltz-node --version printed '$version'" >&2; exit 1; }
echo "check_wheel: $version"
version=$(in_venv waltz --version)
[ "$version" = "waltz $expected" ] || { echo "check_wheel: waltz --version without rich printed '$version'" >&2; exit 1; }
echo "check_wheel: without the cli extra, $version"
set +e
missing=$(in_venv waltz --help 2>&1)
rc=$?
set -e
want="waltz: The waltz command needs the 'cli' extra: pip install 'waltz-log[cli]'"
if [ "$rc" != 2 ] || [ "$missing" != "$want" ]; then
  printf 'check_wheel: waltz without rich exited %s and printed:\n%s\n' "$rc" "$missing" >&2
  exit 1
fi
echo "check_wheel: without the cli extra, waltz prints one line and exits 2: $missing"

echo "check_wheel: the demo extra"
in_venv python -m pip install -q --only-binary waltz-log "$wheel[demo]"
version=$(in_venv waltz --version)
[ "$version" = "waltz $expected" ] || { echo "check_wheel: waltz --version printed '$version'" >&2; exit 1; }
echo "check_wheel: $version"
demo_started=$SECONDS
in_venv waltz demo --short --directory "$tmp/demo"  # exits 1 when a verification fails

echo "check_wheel: passed; wheel build $((built - started)) s, installs and checks $((demo_started - built)) s, demo $((SECONDS - demo_started)) s, total $((SECONDS - started)) s"
