#!/usr/bin/env bash
# The CPU test suite against the newest releases of every dependency, in a new virtualenv, instead of the versions
# pinned in constraints.txt (what CI and the README's test command install). Upgrading is then a decision: when the
# suite passes here, `scripts/test_newest.sh --write` replaces constraints.txt with the versions it installed.
#
#   scripts/test_newest.sh            # a new venv under a temporary directory; prints what differs from the pins
#   scripts/test_newest.sh --write    # the same, and on a green run writes constraints.txt
#
# torch stays at the CPU build the README names (torch==2.13.0): its newest release is a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
write=0
[ "${1:-}" = "--write" ] && write=1
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install --quiet --no-cache-dir --upgrade pip
pip install --quiet --no-cache-dir --upgrade torch==2.13.0 -e '.[dev]'
pip freeze --exclude-editable | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/' | sort -f > "$venv/../newest.txt"
echo "versions that differ from constraints.txt (< pinned, > newest):"
diff <(grep -v '^#' constraints.txt | sort -f) "$venv/../newest.txt" || true
status=0
python -m pytest -q -n 2 -p no:cacheprovider || status=$?
if [ "$status" -eq 0 ] && [ "$write" -eq 1 ]; then
  { sed -n '/^#/p' constraints.txt; cat "$venv/../newest.txt"; } > constraints.txt.new
  mv constraints.txt.new constraints.txt
  echo "constraints.txt: written with the versions above"
fi
exit "$status"
