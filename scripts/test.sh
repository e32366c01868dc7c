#!/usr/bin/env bash
# Quickstart, part 2: set up, lint and format-check (ruff: pyproject.toml [tool.ruff*]), type-check (mypy:
# [tool.mypy]) — a finding of either fails the run before any test starts — then run the whole
# test suite (it starts its own throwaway PostgreSQL).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.local/bin:$PATH"
uv run --locked ruff check .
uv run --locked ruff format --check .
uv run --locked mypy
exec uv run --locked pytest "$@"
