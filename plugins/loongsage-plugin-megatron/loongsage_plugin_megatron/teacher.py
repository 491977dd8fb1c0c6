"""The ``megatron`` teacher backend: a frozen Megatron-Core GPT model scoring the student's samples.

The model is the megatron train backend's forward-only worker (:class:`~.worker.MegatronTrainWorker`
with role ``"reference"``): Megatron-Bridge converts the Hugging Face directory ``path`` into a
Megatron-Core ``GPTModel`` (float32, or bfloat16 / float16 as the train backend runs them:
Megatron-Core's ``Float16Module``, float32 outputs), and :meth:`~.worker.MegatronTrainWorker.score` runs batches
through Megatron-Core's forward schedule. Arguments, residency and outputs follow the distill
plugin's ``torch`` teacher, so the run's teacher manager (``[placement] teacher_manager``) treats both alike:

* outputs follow the batch layout of ``loongsage_hookspecs.records``: entry ``t`` describes the
  distribution that produced token ``t`` (``logprobs[:, t] = log q(input_ids[:, t] |
  input_ids[:, :t])``); position 0 and padding positions hold 0; top-k entries come largest
  first; everything is returned on ``output_device``;
* the teacher starts offloaded; :meth:`MegatronTeacher.load` brings the weights onto the
  accelerator and :meth:`MegatronTeacher.offload` sends them back to host memory, the way the
  train worker's ``onload`` / ``offload`` do (parameter storage emptied and refilled in place).
  On a machine without CUDA the model lives in host memory all along and both change nothing.

Teachers run in the run's teacher actor (one process beside the trainers), on one device:
tensor, pipeline and expert parallel sizes are 1 (other values are rejected). Megatron-Core
needs ``torch.distributed`` and its own parallel state; :func:`ensure_parallel_state` creates a
world of one (Gloo, file rendezvous) only where none exists and otherwise uses the process's as
it is, so several teachers, or a teacher beside a one-rank megatron worker, share one process.
Building a teacher leaves the process's random number generators as they were.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from loongsage_hookspecs import Batch, TeacherOutputs, teacher_inputs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .worker import MegatronTrainWorker

LOGITS_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes of the weights (``dtype``) and of returned full logits (``logits_dtype``)."""
PARALLEL_KEYS = {"tp": "tensor", "pp": "pipeline", "ep": "expert"}


def ensure_parallel_state() -> None:
    """Make Megatron-Core usable in this process for a model with TP = PP = EP = 1.

    Without ``torch.distributed``, starts a world of one (Gloo, file rendezvous) and Megatron's
    parallel state over it. An existing process group and parallel state are used as they are
    (never destroyed or re-initialised); ValueError if that state has a tensor, pipeline or
    expert parallel size other than 1, or if the process group spans several ranks while
    Megatron's state is missing (initialising it is collective: every rank would have to join).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from .parallel import tmp_rendezvous

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_rendezvous()}", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        sizes = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                 "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                 "ep": parallel_state.get_expert_model_parallel_world_size()}
        wrong = {key: size for key, size in sizes.items() if size != 1}
        if wrong:
            raise ValueError(f"megatron teacher: this process's Megatron parallel state is already initialised with "
                             f"{wrong}; a teacher needs tensor, pipeline and expert parallel sizes of 1 and does not "
                             "replace a state in use")
        return
    if dist.get_world_size() > 1:
        raise ValueError(f"megatron teacher: torch.distributed spans {dist.get_world_size()} ranks in this process "
                         "but Megatron's parallel state is not initialised; initialise it (tp = pp = ep = 1) on "
                         "every rank before building a teacher")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=1)


def _check_parallel_sizes(sizes: dict[str, Any]) -> None:
    for key, value in sizes.items():
        if isinstance(value, bool) or value != 1:
            raise ValueError(f"megatron teacher: {key} = {value!r}: a teacher runs in the teacher actor on one "
                             f"device, so its {PARALLEL_KEYS[key]}-parallel size must be 1")


def _torch_device(value: Any, key: str) -> "torch.device":
    import torch

    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"megatron teacher: {key} = {value!r} is not a torch device") from None


def _run_device(device: str | None) -> "torch.device":
    """The device the model runs on: CUDA wherever it is available (the train backend's rule)."""
    import torch

    cuda = torch.cuda.is_available()
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dev = _torch_device(device, "device")
    if dev.type == "cuda":
        if not cuda:
            raise ValueError(f"megatron teacher: device = {device!r} but CUDA is not available here")
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    if dev.type == "cpu":
        if cuda:
            raise ValueError("megatron teacher: device = 'cpu' on a machine with CUDA: Megatron-Core runs on the GPU "
                             "wherever CUDA is available; use 'cuda' (or the torch teacher for a CPU teacher)")
        return dev
    raise ValueError(f"megatron teacher: device = {device!r}: use 'cuda', 'cuda:N' or, without CUDA, 'cpu'")


class MegatronTeacher:
    """A frozen Megatron-Core GPT model that scores batches of student samples (the ``Teacher`` protocol).

    Arguments (the ``[[teachers]]`` table's ``path`` and ``args``): ``path``, a Hugging Face
    model directory Megatron-Bridge converts; ``dtype`` of the weights and the compute
    (``"float32"``, ``"bfloat16"`` or ``"float16"``; the logits leave the model in float32);
    ``device`` it runs on when
    loaded (default: the current CUDA device when CUDA is available, else ``cpu``);
    ``offload_device`` where it waits (``cpu``, the only choice); ``micro_batch_size`` rows per
    forward pass; ``output_device`` of the returned tensors (``cpu``); ``logits_dtype`` of returned
    full logits; ``seed`` of the model-parallel RNG; ``tp`` / ``pp`` / ``ep``, which must be 1.
    The model starts offloaded.
    """

    def __init__(self, path: str | None = None, *, dtype: str = "float32", device: str | None = None,
                 offload_device: str = "cpu", micro_batch_size: int = 8, output_device: str = "cpu",
                 logits_dtype: str = "float32", seed: int = 0, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
        import torch

        _check_parallel_sizes({"tp": tp, "pp": pp, "ep": ep})
        if dtype not in LOGITS_DTYPES:
            raise ValueError(f"megatron teacher: dtype must be one of {list(LOGITS_DTYPES)}, got {dtype!r}")
        if logits_dtype not in LOGITS_DTYPES:
            raise ValueError(f"megatron teacher: logits_dtype must be one of {list(LOGITS_DTYPES)}, "
                             f"got {logits_dtype!r}")
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"megatron teacher: micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"megatron teacher: seed must be an integer, got {seed!r}")
        if not path:
            raise ValueError("megatron teacher: set 'path' (a Hugging Face model directory; Megatron-Bridge "
                             "converts it)")
        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise ValueError(f"megatron teacher: no config.json in model directory '{directory}'")
        self.offload_device = _torch_device(offload_device, "offload_device")
        if self.offload_device.type != "cpu":
            raise ValueError(f"megatron teacher: offload_device must be 'cpu' (offloaded weights wait in host memory), "
                             f"got {offload_device!r}")
        self.output_device = _torch_device(output_device, "output_device")
        self.device = _run_device(device)
        self.logits_dtype: torch.dtype = getattr(torch, logits_dtype)
        self.micro_batch_size = micro_batch_size
        self.path, self.dtype = str(directory), dtype
        self.worker = self._build_worker(int(seed))
        self.loaded = True  # built on the device; start offloaded like the torch teacher
        self.offload()

    def _build_worker(self, seed: int) -> "MegatronTrainWorker":
        """The forward-only megatron worker on ``self.path``, built without touching the caller's RNG."""
        import torch

        from loongsage_core.backend_api.schema import JobConfig, ModelConfig, RunConfig, TrainConfig
        from loongsage_hookspecs import TrainWorkerContext

        from .worker import MegatronTrainWorker

        job = JobConfig(model=ModelConfig(path=self.path, dtype=self.dtype),
                        train=TrainConfig(backend="megatron", micro_batch_size=self.micro_batch_size),
                        run=RunConfig(seed=seed))
        cuda_devices = [self.device.index] if self.device.type == "cuda" else []
        with self._on_device(), torch.random.fork_rng(devices=cuda_devices):
            ensure_parallel_state()
            try:
                return MegatronTrainWorker(TrainWorkerContext(job=job, components=None, role="reference"))
            except OSError as exc:
                raise ValueError(f"megatron teacher: cannot load model from '{self.path}': {exc}") from None

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Make ``self.device`` CUDA's current device meanwhile (Megatron places tensors there)."""
        import torch

        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            yield

    # -- residency -------------------------------------------------------------------------------

    def load(self) -> None:
        """Bring the weights back onto ``device`` (a no-op when they are there, and on the CPU)."""
        with self._on_device():
            self.worker.onload()
        self.loaded = True

    def offload(self) -> None:
        """Move the weights to host memory and release cached accelerator memory (no-op on the CPU)."""
        with self._on_device():
            self.worker.offload()
        self.loaded = False

    @property
    def model_device(self) -> "torch.device":
        """Where the weights are now: ``offload_device`` while offloaded from an accelerator, else ``device``."""
        return self.offload_device if self.worker.offloaded else self.worker.device

    @property
    def vocab_size(self) -> int:
        """The Hugging Face vocabulary size (the last axis of returned logits)."""
        return int(self.worker.vocab_size)

    # -- scoring ---------------------------------------------------------------------------------

    def forward(self, batch: Batch, *, topk: int = 0, return_logits: bool = False) -> TeacherOutputs:
        """Teacher log-probs of the sampled tokens, and optionally top-k and full logits.

        ``batch`` needs ``input_ids`` ``[B, T]`` (and uses ``attention_mask`` when present, else
        every position is a real token; rows are right-padded). Returns ``logprobs`` ``[B, T]``
        (float32); with ``topk > 0`` also ``topk_ids`` / ``topk_logprobs`` ``[B, T, topk]``
        (largest first); with ``return_logits`` the raw ``logits`` ``[B, T, V]`` in
        ``logits_dtype``; all on ``output_device``, without gradient. On CUDA, call :meth:`load`
        first (RuntimeError while offloaded).
        """
        ids, attention = teacher_inputs(batch, topk, "megatron teacher")
        if topk > self.vocab_size:
            raise ValueError(f"megatron teacher: topk={topk} exceeds the vocabulary size {self.vocab_size}")
        if self.worker.offloaded:
            raise RuntimeError("megatron teacher: the model is offloaded; call load() first")
        inputs = Batch(tensors={"input_ids": ids, "attention_mask": attention})
        with self._on_device():
            out = self.worker.score(inputs, topk=topk, return_logits=return_logits,
                                    logits_dtype=self.logits_dtype, output_device=self.output_device)
        return TeacherOutputs(logprobs=out["logprobs"], topk_ids=out.get("topk_ids"),
                              topk_logprobs=out.get("topk_logprobs"), logits=out.get("logits"))

    __call__ = forward

