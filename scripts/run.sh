#!/usr/bin/env bash
# Quickstart, part 1: set up and run Stageline on the embedded default (SQLite store, single node).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.local/bin:$PATH"
exec uv run --locked stageline up "$@"
