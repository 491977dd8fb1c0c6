#!/usr/bin/env bash
# Hunt intermittent failures: run the test suite N times (default 5) in a random order, half of the
# runs under CPU load, and report every test that ever failed with its failure count.
#
#   scripts/flake_hunt.sh [N] [pytest args...]      e.g. scripts/flake_hunt.sh 5
#                                                        scripts/flake_hunt.sh 3 plugins/loongsage-plugin-sglang
#
# * Order: pytest-randomly shuffles modules, then the tests inside each (a module's tests stay
#   together, so module-scoped fixtures are set up once); each run prints its seed, and
#   `.venv/bin/python -m pytest -p randomly --randomly-seed=SEED` replays that order (the suite's
#   own default, pyproject.toml's addopts, is file order: `-p no:randomly`).
# * Load: the odd-numbered runs (1, 3, 5, ...) share the CPUs with $FLAKE_LOAD_PROCS busy loops
#   (default 1: a parallel busy loop, the load of a CI machine running something beside the
#   suite; set it to `$(nproc)` for a harsher hunt), started before the run and stopped after it.
# * Leaks: after each run, scripts/check_leaks.py fails it if a process the run started (an engine
#   server, a Ray session) is still alive; those count as failures of "<leaked processes>".
# * Results: per-run logs and JUnit XML in $FLAKE_OUT (default a fresh temporary directory).
# Exit status: 0 when every run passed with nothing leaked, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
shift || true
case "$runs" in ''|*[!0-9]*) echo "flake_hunt: N must be a positive integer, got '$runs'" >&2; exit 2;; esac
[ "$runs" -ge 1 ] || { echo "flake_hunt: N must be >= 1" >&2; exit 2; }
PY="${PYTHON:-.venv/bin/python}"
"$PY" -c "import pytest_randomly" 2>/dev/null \
  || { echo "flake_hunt: pytest-randomly is missing from $PY; run scripts/setup.sh" >&2; exit 2; }
out="${FLAKE_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/flake-hunt.XXXXXX")}"
mkdir -p "$out"
load_procs="${FLAKE_LOAD_PROCS:-1}"
busy=()

stop_load() {
  for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  busy=()
}
trap 'stop_load' EXIT
trap 'stop_load; exit 130' INT TERM

echo "flake hunt: $runs run(s), results in $out"
for ((i = 1; i <= runs; i++)); do
  seed="$("$PY" -c 'import random; print(random.SystemRandom().randrange(2**32))')"
  load="none"
  if ((i % 2 == 1)); then
    for ((p = 0; p < load_procs; p++)); do
      ( trap 'exit 0' TERM; while :; do :; done ) &
      busy+=("$!")
    done
    load="$load_procs busy loop(s)"
  fi
  mark="flake-hunt-$$-$i"
  echo "run $i/$runs: seed $seed, load: $load"
  start="$(date +%s)"
  LOONGSAGE_RUN_MARK="$mark" "$PY" -m pytest -q -p randomly --randomly-seed="$seed" \
    --junitxml="$out/run$i.xml" -o junit_family=xunit2 "$@" >"$out/run$i.log" 2>&1
  status=$?
  stop_load
  "$PY" scripts/check_leaks.py "$mark" >"$out/run$i.leaks" 2>&1
  leak=$?
  echo "run $i/$runs: exit $status, $(($(date +%s) - start)) s: $(tail -n 1 "$out/run$i.log")" \
       "$([ "$leak" -ne 0 ] && echo '(LEAKED PROCESSES, see '"$out/run$i.leaks"')')"
  printf '%s\t%s\t%s\t%s\t%s\n' "$i" "$seed" "$load" "$status" "$leak" >>"$out/runs.tsv"
done

"$PY" - "$out" "$runs" <<'PYEOF'
"""Count the failures and errors of each test over every run's JUnit XML."""
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, runs = Path(sys.argv[1]), int(sys.argv[2])
failed = collections.Counter()
for line in (out / "runs.tsv").read_text().splitlines():
    i, seed, load, status, leak = line.split("\t")
    xml = out / f"run{i}.xml"
    if leak != "0":
        failed["<leaked processes>"] += 1
    if not xml.exists():
        failed[f"<run {i} produced no report: exit {status}, see {out / f'run{i}.log'}>"] += 1
        continue
    root = ET.parse(xml).getroot()
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            name = case.get("classname", "") + "::" + case.get("name", "")
            failed[name] += 1
    if status not in ("0", "1"):  # interrupted, internal error, usage error: not a clean run
        failed[f"<run {i} ended with exit {status}, see {out / f'run{i}.log'}>"] += 1
if failed:
    print(f"\nflake hunt: {len(failed)} test(s) failed at least once in {runs} run(s):")
    for name, count in failed.most_common():
        print(f"  {count}/{runs}  {name}")
    sys.exit(1)
print(f"\nflake hunt: no failures in {runs} run(s)")
PYEOF
