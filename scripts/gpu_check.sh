#!/usr/bin/env bash
# GPU check: a few GRPO steps of a tiny Qwen3 with SGLang serving the rollouts, for each train
# backend and each weight transport one GPU allows; prints one JSON object (train-inference k3 gap,
# weight-sync seconds and GB/s, step time, MFU, peak memory of trainer and engine) and exits 1 if
# a case failed or its gap is above MAX_K3. The cases and the report: scripts/gpu_check.py.
#
# Usage:  bash scripts/gpu_check.sh                 # on a CUDA machine, in the set-up .venv
#         bash scripts/gpu_check.sh --cpu-dry-run   # the same cases on the CPU (CI runs this)
#
# On a GPU it installs what it needs first: SGLang with its server extras
# (loongsage-plugin-sglang[sglang]) when it is not importable, and the Megatron backend's packages
# (scripts/install_megatron.sh) when a megatron case runs and they are missing.
# Environment: PYTHON (default .venv/bin/python, else python3), OUT (default runs/gpu_check),
#   BACKENDS (default "torch megatron"), TRANSPORTS (default "sglang_disk sglang_tensor auto",
#   plus sglang_nccl with two GPUs; auto runs with the first backend only), STEPS (default 4), MAX_K3 (default 0.05).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --cpu-dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$arg' (expected --cpu-dry-run)" >&2; exit 2 ;;
  esac
done

if [ "$DRY_RUN" = 0 ]; then
  "$PY" -c 'import sys, torch; torch.cuda.is_available() or sys.exit("gpu_check: no CUDA device visible to torch (--cpu-dry-run runs the cases on the CPU)")'
  if ! "$PY" -c 'import sglang' >/dev/null 2>&1; then
    echo "gpu_check: installing SGLang (loongsage-plugin-sglang[sglang])" >&2
    "$PY" -m pip install -q -e "plugins/loongsage-plugin-sglang[sglang]"
  fi
  case " ${BACKENDS:-torch megatron} " in *" megatron "*)
    if ! "$PY" -c 'import megatron.core, megatron.bridge' >/dev/null 2>&1; then
      PYTHON="$PY" bash scripts/install_megatron.sh
    fi;;
  esac
  "$PY" -c 'import torch; print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")' >&2
fi
exec "$PY" scripts/gpu_check.py "$@"
