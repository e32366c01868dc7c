#!/usr/bin/env bash
# Quickstart, part 2: set up and run the whole test suite (it starts its own throwaway PostgreSQL).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.local/bin:$PATH"
exec uv run --locked pytest "$@"
