"""Model FLOPs of the step's phases and the device's peak: the ``perf/mfu_*`` metrics.

Model FLOPs (the useful work, as in the PaLM paper's MFU, not what a kernel happens to run) of a
dense decoder with ``N`` matmul parameters per token (every projection of every layer plus the
output head; the embedding lookup is no matmul), ``L`` layers and attention width ``d``
(heads x head_dim), for one sequence of ``S`` tokens, causal attention counting each token's
``t`` visible positions once:

* forward (scoring: old log-probs, reference, teachers): ``2 N S + 4 L d sum_{t=1..S} t``
  (``2 L d S (S + 1)``);
* training (forward + backward): three times the forward;
* generation: the forward FLOPs of every row's tokens, its prompt counted once per group (the
  engine shares a group's prompt prefix).

MFU = FLOPs / (seconds x peak FLOP/s x devices). The peak comes from ``[train] peak_tflops`` when
set, else from a table of accelerators by name and dtype, else (a CPU) from a short matmul probe
at start (:func:`probe_matmul_flops`): on a CPU the MFU is then relative to the machine's own best
fp32 matmul rate, which is what the issue's "training MFU at least 85% of the probed rate" means.
Mixture-of-experts models are not modelled (their active parameters differ per token).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch

# dense peak TFLOP/s per device by (name fragment, dtype); the first fragment found in the
# device name wins (fp32 on Ampere and later: the TF32 tensor-core rate PyTorch does not use by
# default is not counted)
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("H800", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("A800", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}),
    ("A10", {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2}),
    ("4090", {"bfloat16": 165.0, "float16": 165.0, "float32": 82.6}),
)


@attrs.define(frozen=True)
class ModelShape:
    """What the FLOPs of a dense decoder depend on."""

    matmul_params: int
    num_layers: int
    attention_width: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "ModelShape":
        """From a Hugging Face ``config.json`` table (Llama / Qwen2 / Qwen3 names)."""
        h = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or h // heads)
        inter = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
        per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 3 * h * inter
        return cls(matmul_params=layers * per_layer + vocab * h, num_layers=layers, attention_width=heads * head_dim)

    @classmethod
    def from_job(cls, job: Any) -> "ModelShape | None":
        """The shape of ``[model]`` (its inline ``config`` or ``path/config.json``); ``None`` when it
        cannot be read (then no MFU is reported)."""
        cfg = dict(job.model.config or {})
        if not cfg and job.model.path:
            file = Path(job.model.path).expanduser() / "config.json"
            try:
                cfg = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
        cfg = dict(cfg.get("text_config") or cfg)
        try:
            return cls.from_config(cfg)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None

    def forward_flops(self, length: float) -> float:
        """Forward FLOPs of one sequence of ``length`` tokens."""
        s = float(length)
        return 2.0 * self.matmul_params * s + 2.0 * self.num_layers * self.attention_width * s * (s + 1.0)

    def training_flops(self, length: float) -> float:
        """Forward + backward FLOPs of one sequence of ``length`` tokens."""
        return 3.0 * self.forward_flops(length)


def batch_lengths(batch: Any) -> list[int]:
    """Tokens per row of a step batch (its attention mask)."""
    return [int(x) for x in batch["attention_mask"].sum(dim=1).tolist()]


def scoring_flops(shape: ModelShape, batch: Any, *, shared_prompts: bool = False) -> float:
    """Forward FLOPs of one scoring pass over the rows of ``batch``; with ``shared_prompts`` (a
    trainer that runs the prompt of a group's rows once) each group's prompt counts once, as in
    :func:`generation_flops`."""
    if shared_prompts and "loss_mask" in batch:
        return generation_flops(shape, batch)
    return sum(shape.forward_flops(n) for n in batch_lengths(batch))


def generation_flops(shape: ModelShape, batch: Any) -> float:
    """Forward FLOPs of generating ``batch``'s rows: every row's tokens after its prompt (the
    tokens before its first trained token), and each group's prompt once."""
    import torch

    lengths = batch_lengths(batch)
    mask = batch["loss_mask"] > 0
    has = mask.any(dim=1)
    first = torch.where(has, mask.float().argmax(dim=1), torch.tensor(lengths)).tolist()
    groups = batch.get("group_index")
    group_ids = groups.tolist() if groups is not None else list(range(len(lengths)))
    total = 0.0
    prompts: dict[int, int] = {}
    for n, p, g in zip(lengths, first, group_ids):
        total += shape.forward_flops(n) - shape.forward_flops(p)
        prompts.setdefault(int(g), int(p))
    return total + sum(shape.forward_flops(p) for p in prompts.values())


def probe_matmul_flops(size: int = 1024, repeats: int = 20, dtype: "torch.dtype | None" = None,
                       device: "torch.device | str" = "cpu") -> float:
    """The best FLOP/s of ``repeats`` ``size x size`` matmuls on ``device`` (after one warm-up).

    Twenty on the CPU (0.15 s on 2 cores): with five, a probe taken while the host was busy read
    up to 20% under the machine's rate, and every MFU of the run as much over."""
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    (a @ b).sum().item()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / max(best, 1e-12)


def table_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a known accelerator (:data:`GPU_PEAK_TFLOPS`), or ``None``."""
    for fragment, rates in GPU_PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            rate = rates.get(dtype)
            return rate * 1e12 if rate else None
    return None


def device_peak_flops(device: "torch.device | str", dtype: str, override_tflops: float | None = None) -> float:
    """The peak FLOP/s MFU is measured against, for one device of the trainer: ``override_tflops``
    (``[train] peak_tflops``), else the accelerator table, else a matmul probe on ``device``."""
    import torch

    if override_tflops:
        return float(override_tflops) * 1e12
    device = torch.device(device)
    if device.type == "cuda":
        peak = table_peak_flops(torch.cuda.get_device_name(device), dtype)
        if peak is not None:
            return peak
        return probe_matmul_flops(4096, dtype=getattr(torch, dtype), device=device)
    return probe_matmul_flops()


def mfu(flops: float, seconds: float, peak: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: ``flops / (seconds x peak x devices)`` (0 without time or peak)."""
    if seconds <= 0 or peak <= 0 or devices <= 0:
        return 0.0
    return flops / (seconds * peak * devices)


__all__ = ["GPU_PEAK_TFLOPS", "ModelShape", "batch_lengths", "device_peak_flops", "generation_flops", "mfu",
           "probe_matmul_flops", "scoring_flops", "table_peak_flops"]
