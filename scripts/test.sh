#!/usr/bin/env bash
# Quickstart, part 2: set up, lint (ruff with its security rules: pyproject.toml [tool.ruff.lint];
# a finding fails the run before any test starts), then run the whole test suite (it starts its
# own throwaway PostgreSQL).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.local/bin:$PATH"
uv run --locked ruff check .
exec uv run --locked pytest "$@"
