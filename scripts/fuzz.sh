#!/usr/bin/env bash
# Coverage-guided fuzzing of every decoder that reads bytes from the network or the disk
# (docs/internals.md, "Fuzzing"). Installs cargo-fuzz and atheris when missing, builds the
# targets, replays the inputs of past crashes (fuzz/regressions/), then fuzzes each target in
# turn for RUNS inputs and prints the runs, speed, coverage and result of each.
#
#   bash scripts/fuzz.sh [RUNS] [TARGET...]
#
# RUNS defaults to 1000000 (or $FUZZ_RUNS); FUZZ_MAX_TIME caps each target's seconds (default
# 1800); FUZZ_PYTHON is the interpreter with waltz installed (default .venv/bin/python, set up by
# scripts/setup.sh if missing). Targets: storage_protocol admin_protocol control_file
# segment_recovery client_reader (cargo-fuzz, fuzz/fuzz_targets/) and client_protocol (atheris,
# fuzz/client_protocol.py). The corpus grows in fuzz/corpus/, crashes land in
# fuzz/artifacts/<target>/, logs in fuzz/logs/ (none of them in git). Exits 1 on any crash.
#
# The targets are built without a sanitizer (-s none: the engine is safe Rust) but with debug
# assertions, so an integer overflow is a crash as it is in `cargo test`; that build works on
# stable Rust. FUZZ_SANITIZER=address (or another of cargo-fuzz's) adds one: cargo-fuzz then
# passes -Zsanitizer to rustc, which stable accepts only with RUSTC_BOOTSTRAP=1 (set here then).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${1:-${FUZZ_RUNS:-1000000}}
[ $# -gt 0 ] && shift
all=(storage_protocol admin_protocol control_file segment_recovery client_reader client_protocol)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
max_time=${FUZZ_MAX_TIME:-1800}
sanitizer=${FUZZ_SANITIZER:-none}
[ "$sanitizer" = none ] || export RUSTC_BOOTSTRAP=1

PY=${FUZZ_PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { bash scripts/setup.sh; PY=.venv/bin/python; }
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz (cargo install, a few minutes)"
  cargo install cargo-fuzz --locked -q
fi
if [[ " ${targets[*]} " == *" client_protocol "* ]] && ! "$PY" -c "import atheris" 2>/dev/null; then
  echo "fuzz: installing atheris"
  "$PY" -m pip install -q atheris
fi

echo "fuzz: building the targets"
(cd fuzz && cargo fuzz build -s "$sanitizer" >/dev/null 2>&1) || (cd fuzz && cargo fuzz build -s "$sanitizer")
bin=fuzz/target/x86_64-unknown-linux-gnu/release
"$PY" fuzz/seeds.py >/dev/null
mkdir -p fuzz/logs

summary=()
failed=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/artifacts/$t"
  if [ "$t" = client_protocol ]; then
    cmd=("$PY" fuzz/client_protocol.py)
    max_len=4096
  else
    cmd=("$bin/$t")
    max_len=$([ "$t" = segment_recovery ] && echo 8192 || echo 4096)
  fi
  log=fuzz/logs/$t.log
  result=ok
  # Every input that ever crashed a target must pass now.
  if compgen -G "fuzz/regressions/$t/*" >/dev/null; then
    if ! nice "${cmd[@]}" -runs=1 fuzz/regressions/"$t"/* >"$log.regressions" 2>&1; then
      result="REGRESSION (see $log.regressions)"
      failed=1
    fi
  fi
  echo "fuzz: $t, $runs runs (at most ${max_time}s)"
  set +e
  nice "${cmd[@]}" -runs="$runs" -max_total_time="$max_time" -timeout=30 -rss_limit_mb=2048 \
    -max_len="$max_len" -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$t/" \
    "fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  set -e
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\) ft: \([0-9]*\) corp: \([^ ]*\).*/cov \1, features \2, corpus \3/p' <<<"$done_line")
  if [ "$rc" != 0 ]; then
    crash=$(sed -n 's/.*Test unit written to \(.*\)/\1/p' "$log" | tail -1)
    result="CRASH ${crash:-(see $log)}"
    failed=1
  elif [ "$result" = ok ] && [ "${execs:-0}" -lt "$runs" ]; then
    result="ok (time cap reached first)"
  fi
  summary+=("$(printf '%-18s %10s runs %8s exec/s  %-40s %s' "$t" "${execs:-?}" "${speed:-?}" "${cov:-?}" "$result")")
done

echo
echo "fuzz: summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
