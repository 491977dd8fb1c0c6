#!/usr/bin/env bash
# GPU check of the SGLang rollout engine (not run in CI; needs a CUDA GPU with sglang and the
# train backend installed: pip install 'loongsage-plugin-sglang[sglang]' plus Megatron for the
# default backend).
#
# Builds a tiny random Qwen3 (bf16, head_dim 64, the repository's test tokenizer), then for each
# weight transport runs a few GRPO steps of plugins/loongsage-plugin-sglang/gpu_check.toml with
# SGLang serving rollouts, and prints per step the train-inference log-prob gap
# (train/is_approx_k3_kl) and the weight-sync time (perf/weight_sync_*) from metrics.jsonl.
#
# Usage:  bash scripts/gpu_check.sh
# Environment: PYTHON (default .venv/bin/python, else python3), OUT (default runs/gpu_check_sglang),
#   BACKEND (train backend, default megatron), TRANSPORTS (default "sglang_disk sglang_nccl
#   sglang_tensor"; sglang_tensor runs colocated: trainer and SGLang in one actor on one GPU, the
#   engine releasing its memory while the trainer trains, weights passed as CUDA IPC handles),
#   MAX_K3 (fail if the mean k3 gap of a run exceeds it; default 0.05).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT="${OUT:-runs/gpu_check_sglang}"
BACKEND="${BACKEND:-megatron}"
TRANSPORTS="${TRANSPORTS:-sglang_disk sglang_nccl sglang_tensor}"
MAX_K3="${MAX_K3:-0.05}"
JOB=plugins/loongsage-plugin-sglang/gpu_check.toml

"$PY" - <<'EOF'
import importlib.util, sys
import torch
missing = [m for m in ("sglang",) if importlib.util.find_spec(m) is None]
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch")
if missing:
    sys.exit("gpu_check: missing " + ", ".join(missing) + "; pip install 'loongsage-plugin-sglang[sglang]'")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
EOF

mkdir -p "$OUT"
MODEL="$(cd "$OUT" && pwd)/model"
"$PY" - "$MODEL" <<'EOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
out = Path(sys.argv[1])
if not (out / "config.json").exists():
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=512, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2,
                                  pad_token_id=0, torch_dtype="bfloat16")
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in Path("tests/data/tokenizer").iterdir():
        shutil.copy(f, out / f.name)
print(f"gpu_check: model in {out}")
EOF

NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
EXTRA=()
if [ "$NGPU" -lt 2 ]; then
  # trainer and engine share the only GPU; NCCL cannot link two ranks on one device
  EXTRA=(placement.trainer_gpus=0.5 placement.engine_gpus=0.5)
  case " $TRANSPORTS " in *" sglang_nccl "*)
    echo "gpu_check: one GPU visible; skipping sglang_nccl (it needs the engine on another GPU)" >&2
    TRANSPORTS="${TRANSPORTS//sglang_nccl/}";;
  esac
fi

status=0
for transport in $TRANSPORTS; do
  run_dir="$OUT/$transport"
  rm -rf "$run_dir"
  echo "=== $transport (train backend $BACKEND) ==="
  LAYOUT=(${EXTRA[@]+"${EXTRA[@]}"})
  if [ "$transport" = sglang_tensor ]; then
    # same device by construction: one actor holds the trainer rank and the SGLang server
    LAYOUT=(placement.colocate=true placement.offload=true placement.trainer_gpus=1)
  fi
  if ! "$PY" -m loongsage_core.cli run "$JOB" --output-dir "$run_dir" \
      "model.path=$MODEL" "rollout.weight_transport=$transport" "train.backend=$BACKEND" \
      "rollout.engine_args.log_dir=$(pwd)/$run_dir/logs" ${LAYOUT[@]+"${LAYOUT[@]}"}; then
    echo "gpu_check: $transport run failed; engine logs in $run_dir/logs" >&2
    status=1
    continue
  fi
  "$PY" - "$run_dir/metrics.jsonl" "$MAX_K3" <<'EOF' || status=1
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
limit = float(sys.argv[2])
k3s = []
print(f"{'step':>4} {'is_approx_k3_kl':>16} {'weight_sync_s':>14}")
for r in rows:
    k3 = r.get("train/is_approx_k3_kl")
    sync = r.get("perf/weight_sync_timing/weight_update_s", r.get("perf/weight_sync_seconds"))
    if k3 is not None:
        k3s.append(k3)
    print(f"{r.get('step', '?'):>4} {k3 if k3 is not None else float('nan'):>16.3e} "
          f"{sync if sync is not None else float('nan'):>14.3f}")
if not k3s:
    sys.exit("gpu_check: no train/is_approx_k3_kl in " + sys.argv[1])
mean = sum(k3s) / len(k3s)
print(f"mean train/is_approx_k3_kl = {mean:.3e} (limit {limit:g})")
sys.exit(0 if mean <= limit else f"gpu_check: log-prob parity gap {mean:.3e} above {limit:g}")
EOF
done
exit $status
