#!/usr/bin/env bash
# Proves a torture fault able to fail: applies one mutant (a patch that breaks the property the
# fault tests) to a temporary git worktree of HEAD, runs a short seeded torture of that fault
# against it, and expects the run to FAIL (docs/torture.md, "Mutants").
#
#   tests/torture/mutants/run_mutant.sh MUTANT FAULTS [SEED] [DURATION] [-- extra torture options]
#   e.g. tests/torture/mutants/run_mutant.sh zombie zombie 1 30s -- --zookeeper
#
# The mutants patch Python only: the worktree runs with this checkout's .venv and native
# extension (copied next to the mutated package). Exit 0 when the mutant was caught.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,10p "$0"; exit 2; }
mutant=$1 faults=$2 seed=${3:-1} duration=${4:-30s}
shift $(($# < 4 ? $# : 4))
[ "${1:-}" = "--" ] && shift
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
patch=$repo/tests/torture/mutants/$mutant.patch
[ -f "$patch" ] || { echo "no mutant $patch" >&2; exit 2; }
tmp=$(mktemp -d)
cleanup() { git -C "$repo" worktree remove --force "$tmp/wt" >/dev/null 2>&1 || true; rm -rf "$tmp"; }
trap cleanup EXIT
git -C "$repo" worktree add --quiet --detach "$tmp/wt" HEAD
git -C "$tmp/wt" apply "$patch"
cp "$repo"/python/waltz/_native*.so "$tmp/wt/python/waltz/"
echo "mutant $mutant applied to $(git -C "$repo" rev-parse --short HEAD); torture --faults $faults --seed $seed --duration $duration $*"
set +e
(cd "$tmp" && PYTHONPATH="$tmp/wt/python" "$repo/.venv/bin/python" -m waltz.cli.main torture \
    --faults "$faults" --seed "$seed" --duration "$duration" --clients 2 --partitions 2 \
    --heal-timeout 30s --directory "$tmp/run" "$@") 2>&1 | tee "$tmp/out.txt"
code=${PIPESTATUS[0]}
set -e
grep -h -A3 '"problems"' "$tmp/run/report.json" 2>/dev/null || true
for f in "$tmp"/run/clients/bad-clients-*.log; do [ -f "$f" ] && echo "$(basename "$f"): $(tail -1 "$f")"; done
if [ "$code" -ne 0 ]; then
    echo "CAUGHT: mutant $mutant made the run fail (exit $code)"
    exit 0
fi
echo "NOT CAUGHT: mutant $mutant passed the run"
exit 1
