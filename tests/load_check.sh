#!/usr/bin/env bash
# The whole suite N times in a row (default 5) while another process keeps one core busy:
# how flaky tests are hunted (a flaky test is a bug). Not run by CI; run it by hand:
#   bash tests/load_check.sh [N]
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "while True: pass" &
busy=$!
trap 'kill "$busy"' EXIT
failed=0
for i in $(seq 1 "${1:-5}"); do
  start=$(date +%s)
  python -m pytest -q -p no:cacheprovider > "/tmp/akv-load-$i.log" 2>&1
  rc=$?
  echo "run $i: rc=$rc in $(( $(date +%s) - start )) s: $(tail -1 "/tmp/akv-load-$i.log")"
  [ "$rc" -eq 0 ] || failed=1
done
exit "$failed"
