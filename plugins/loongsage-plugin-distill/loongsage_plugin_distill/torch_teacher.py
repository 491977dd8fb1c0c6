"""The ``torch`` teacher backend: a frozen transformers causal LM scoring the student's samples.

The model comes from a local Hugging Face directory (``path``: config.json + weights) or, for
tests and tiny models, from an inline transformers ``config`` dict (randomly initialised from
``seed``), or is handed in ready-made (``model``). It lives on ``offload_device`` (the CPU) until
:meth:`TorchTeacher.load` moves it to ``device``; :meth:`TorchTeacher.offload` moves it back, so a
:class:`~loongsage_plugin_distill.teacher_manager.TeacherManager` can bound how many teachers
occupy the accelerator.

Outputs follow the batch layout of ``loongsage_hookspecs.records``: entry ``t`` describes the
distribution that produced token ``t`` (``logprobs[:, t] = log q(input_ids[:, t] | input_ids[:, :t])``);
position 0 and padding positions hold 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loongsage_core.backend_api.models import ModelLoadError, load_causal_lm
from loongsage_hookspecs import Batch, TeacherContext, TeacherOutputs, teacher_inputs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

DTYPES = ("float32", "bfloat16", "float16")


class TeacherLoadError(ValueError):
    """The teacher model cannot be built from the given arguments; the message says which."""


def _dtype(name: str) -> "torch.dtype":
    import torch

    if name not in DTYPES:
        raise TeacherLoadError(f"torch teacher: dtype must be one of {list(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def _build_model(path: str | None, config: dict[str, Any] | None, dtype: "torch.dtype", seed: int) -> Any:
    try:
        return load_causal_lm(path, config, dtype, seed, path_key="torch teacher: path",
                              config_key="torch teacher: config", owner="torch teacher")
    except ModelLoadError as exc:
        raise TeacherLoadError(str(exc)) from None


class TorchTeacher:
    """A frozen causal LM that scores batches of student samples (the ``Teacher`` protocol).

    Arguments (the ``[[teachers]]`` table's ``path`` and ``args``): ``path`` or ``config`` (see
    the module docstring) or ``model``; ``dtype`` of the weights; ``device`` it runs on when
    loaded (default: ``cuda`` when available, else ``cpu``); ``offload_device`` where it waits
    (``cpu``); ``micro_batch_size`` rows per forward pass; ``output_device`` of the returned
    tensors (``cpu``, where the host assembles training batches); ``logits_dtype`` of returned full
    logits; ``seed`` for an inline ``config``. The model starts offloaded.
    """

    def __init__(self, path: str | None = None, *, model: Any = None, config: dict[str, Any] | None = None,
                 dtype: str = "float32", device: str | None = None, offload_device: str = "cpu",
                 micro_batch_size: int = 8, output_device: str = "cpu", logits_dtype: str = "float32",
                 seed: int = 0) -> None:
        import torch

        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"torch teacher: micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
        self.dtype = _dtype(dtype)
        self.logits_dtype = _dtype(logits_dtype)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.offload_device = torch.device(offload_device)
        self.output_device = torch.device(output_device)
        self.micro_batch_size = micro_batch_size
        self.model = model if model is not None else _build_model(path, config, self.dtype, int(seed))
        self.model.eval()
        self.model.requires_grad_(False)
        self.model.to(self.offload_device)
        self.loaded = False

    # -- residency -------------------------------------------------------------------------------

    def load(self) -> None:
        """Move the model onto ``device`` (a no-op when it is already there)."""
        self.model.to(self.device)
        self.loaded = True

    def offload(self) -> None:
        """Move the model to ``offload_device`` and release cached accelerator memory."""
        import torch

        self.model.to(self.offload_device)
        self.loaded = False
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def model_device(self) -> "torch.device":
        """Where the model's parameters are now."""
        return next(self.model.parameters()).device

    # -- scoring ---------------------------------------------------------------------------------

    def forward(self, batch: Batch, *, topk: int = 0, return_logits: bool = False) -> TeacherOutputs:
        """Teacher log-probs of the sampled tokens, and optionally top-k and full logits.

        ``batch`` needs ``input_ids`` ``[B, T]`` (and uses ``attention_mask`` when present, else
        every position is a real token). Returns ``logprobs`` ``[B, T]``; with ``topk > 0`` also
        ``topk_ids`` / ``topk_logprobs`` ``[B, T, topk]`` (largest first); with ``return_logits``
        the raw ``logits`` ``[B, T, V]`` in ``logits_dtype``. Runs on the model's current device
        (call :meth:`load` first to use the accelerator), without gradient.
        """
        import torch

        ids, attention = teacher_inputs(batch, topk, "torch teacher")
        rows, width = ids.shape
        out_dev = self.output_device
        logprobs = torch.zeros((rows, width), dtype=torch.float32, device=out_dev)
        topk_ids = topk_lp = logits_out = None
        if topk:
            topk_ids = torch.zeros((rows, width, topk), dtype=torch.long, device=out_dev)
            topk_lp = torch.zeros((rows, width, topk), dtype=torch.float32, device=out_dev)

        dev = self.model_device
        with torch.inference_mode():
            for start in range(0, rows, self.micro_batch_size):
                stop = min(start + self.micro_batch_size, rows)
                a = attention[start:stop].to(dev)
                real = a.nonzero()
                w = int(real[:, 1].max()) + 1 if real.numel() else 1
                x = ids[start:stop, :w].to(dev)
                a = a[:, :w]
                raw = self.model(input_ids=x, attention_mask=a, use_cache=False).logits[:, :-1].float()
                vocab = raw.shape[-1]
                if topk > vocab:
                    raise ValueError(f"torch teacher: topk={topk} exceeds the vocabulary size {vocab}")
                log_q = torch.log_softmax(raw, -1)  # entry t scores token t + 1
                valid = a[:, 1:] != 0
                picked = log_q.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
                logprobs[start:stop, 1:w] = torch.where(valid, picked, 0.0).to(out_dev)
                if topk_ids is not None and topk_lp is not None:
                    values, index = log_q.topk(topk, dim=-1)
                    keep = valid.unsqueeze(-1)
                    topk_lp[start:stop, 1:w] = torch.where(keep, values, 0.0).to(out_dev)
                    topk_ids[start:stop, 1:w] = torch.where(keep, index, 0).to(out_dev)
                if return_logits:
                    if logits_out is None:
                        logits_out = torch.zeros((rows, width, vocab), dtype=self.logits_dtype, device=out_dev)
                    logits_out[start:stop, 1:w] = torch.where(valid.unsqueeze(-1), raw, 0.0).to(
                        device=out_dev, dtype=self.logits_dtype)
        return TeacherOutputs(logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_lp, logits=logits_out)

    __call__ = forward


def make_torch_teacher(ctx: TeacherContext, **args: Any) -> TorchTeacher:
    """Factory of the ``torch`` teacher spec: the ``[[teachers]]`` entry's ``path`` (from the
    context) and its ``args``."""
    return TorchTeacher(ctx.path, **args)
