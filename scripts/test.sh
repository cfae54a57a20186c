#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install what is missing, start the
# local Slurm cluster (shared by every Slurm test), run pytest.
# Usage: scripts/test.sh [pytest args...]
source "$(dirname "${BASH_SOURCE[0]}")/prepare.sh"
exec python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
