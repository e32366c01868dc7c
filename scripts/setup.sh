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
[ -x /usr/sbin/haproxy ]                       || missing+=(haproxy)   # the failover lab's VIP (include/app/lab/two_nodes.py)
[ -x /usr/bin/patroni ]                        || missing+=(patroni)   # the replicated store (include/app/lab/replicated_store.py)
[ -x /usr/bin/etcd ]                           || missing+=(etcd-server) # Patroni's DCS in that lab
command -v systemd-analyze >/dev/null 2>&1     || missing+=(systemd)   # `systemd-analyze verify` of deploy/systemd/
[ -x /usr/bin/promtool ] && [ -x /usr/bin/prometheus ] || missing+=(prometheus) # promtool checks deploy/alerts.yml;
                                               # the server runs them live (tests/test_prometheus.py)
[ -x /usr/bin/chromium ]                       || missing+=(chromium)   # the Stageline view's browser test
[ -x /usr/bin/chromedriver ]                   || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: run this script as root, or: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # The tests run promtool and a Prometheus server of their own: keep the package's service (and any
  # other service a package would start) from starting, unless the machine already has a policy of its own.
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy"
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ -n "$policy" ]; then rm -f "$policy"; trap - EXIT; fi
fi

if ! command -v uv >/dev/null 2>&1; then
  echo "setup: installing uv"
  python3 -m pip install --quiet --user uv 2>/dev/null || python3 -m pip install --quiet uv
  export PATH="$HOME/.local/bin:$PATH"
fi

export UV_COMPILE_BYTECODE=1
uv sync --locked --quiet
