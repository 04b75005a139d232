#!/usr/bin/env bash
# Apply small deliberate bugs to a copy of the tree, one at a time, and show which ones the
# default test suite catches (scripts/mutation_check.py holds the list). Needs .venv
# (scripts/setup.sh). Every mutation must be caught; a "stale" one needs its text updated.
#
#   scripts/mutation-check.sh               # every mutation (about 1-2 minutes each when caught late)
#   scripts/mutation-check.sh kl_bonus      # only the named ones
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/mutation_check.py "$@"
