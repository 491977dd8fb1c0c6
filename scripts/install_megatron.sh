#!/usr/bin/env bash
# Install the Megatron train backend's packages into PYTHON's environment (default .venv/bin/python):
# requirements-megatron.txt (Megatron-Core and what it imports), then Megatron-Bridge
# (requirements-megatron-bridge.txt) without its declared dependencies: it declares GPU-only packages (transformer-engine, mamba-ssm, ...) that
# the backend does not use and that do not build without CUDA. scripts/setup.sh and
# scripts/gpu_check.sh call this; `pip install loongsage-plugin-megatron` alone installs
# Megatron-Core but not Megatron-Bridge, which needs this second step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m pip install -q --disable-pip-version-check -r requirements-megatron.txt
"$PY" -m pip install -q --disable-pip-version-check --no-deps -r requirements-megatron-bridge.txt
