#!/usr/bin/env bash
# Install what Stageline needs on Debian 12 with Python 3.11: Debian packages (only the missing
# ones; needs root), uv, and the locked Python environment (.venv, bytecode compiled).
# Idempotent and quick when nothing is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v java >/dev/null 2>&1                || missing+=(openjdk-17-jre-headless)
[ -x /usr/lib/postgresql/15/bin/initdb ]       || missing+=(postgresql-15)
[ -f /usr/share/java/postgresql.jar ]          || missing+=(libpostgresql-jdbc-java)
[ -f /usr/share/java/sqlite-jdbc.jar ]         || missing+=(libxerial-sqlite-jdbc-java)
[ -f /usr/share/java/jtds.jar ]                || missing+=(libjtds-java)
[ -x /usr/sbin/haproxy ]                       || missing+=(haproxy)   # the failover lab's VIP (include/lab/cluster.py)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: run this script as root, or: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v uv >/dev/null 2>&1; then
  echo "setup: installing uv"
  python3 -m pip install --quiet --user uv 2>/dev/null || python3 -m pip install --quiet uv
  export PATH="$HOME/.local/bin:$PATH"
fi

export UV_COMPILE_BYTECODE=1
uv sync --locked --quiet
