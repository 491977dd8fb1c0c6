"""The state of a Tinker service: its models, training models, checkpoints and sampling sessions.

Training work runs on one thread (one worker at a time holds the CPU or GPU), in each model's
``seq_id`` order: the SDK numbers a training client's requests and may send them out of order
(chunks of one ``forward_backward`` in parallel), and Tinker runs them in that order. Checkpoints
live under the service's state directory and are named by Tinker paths:
``tinker://<model_id>/weights/<name>`` (:meth:`save_state`, the worker's checkpoint) and
``tinker://<model_id>/sampler_weights/<name>`` (a Hugging Face directory an engine samples from).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

import attrs

from .batches import TinkerRequestError
from .sampling import EnginePool
from .trainer import ModelSpec, TrainingModel

T = TypeVar("T")
log = logging.getLogger("loongsage.tinker")

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_SEQ_WAIT_S = 10.0


@attrs.define(frozen=True)
class SamplingSession:
    """What a sampling session samples from: a weights directory, the base model's name, and the
    sampler checkpoint's Tinker path (``None`` for the base model itself)."""

    weights_dir: str
    base_model: str
    model_path: str | None = None


@attrs.define
class ModelEntry:
    """A training model of the service and its request order."""

    model: TrainingModel
    next_seq: int = 1
    turn: asyncio.Condition = attrs.field(factory=asyncio.Condition)
    sampler_saves: int = 0


class TinkerService:
    """Everything a Tinker client reaches; ``models`` maps each servable model name to its directory."""

    def __init__(self, job: Any, host: Any, models: dict[str, str], state_dir: Path, *, max_engines: int = 2) -> None:
        self.job = job
        self.host = host
        self.models = dict(models)
        self.state_dir = state_dir
        self.training: dict[str, ModelEntry] = {}
        self.sampling_sessions: dict[str, SamplingSession] = {}
        self.engines = EnginePool(job, host, max_engines=max_engines)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")

    # -- helpers -------------------------------------------------------------------------------------

    async def on_trainer(self, fn: Callable[[], T]) -> T:
        """Run blocking training work on the training thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def model_path(self, name: str) -> str:
        if name not in self.models:
            raise TinkerRequestError(f"base_model {name!r} is not served here (served: {sorted(self.models)}); "
                                     "start `loongsage tinker-serve` with --model DIR for it")
        return self.models[name]

    def entry(self, model_id: str) -> ModelEntry:
        if model_id not in self.training:
            raise TinkerRequestError(f"model_id {model_id!r} is unknown (created by another service, or unloaded)")
        return self.training[model_id]

    async def in_order(self, model_id: str, seq_id: int | None, fn: Callable[[ModelEntry], T]) -> T:
        """Run ``fn`` on the training thread in the model's ``seq_id`` order.

        A request whose predecessors have not arrived after a while runs anyway (a client may
        have given up on a request before sending it)."""
        entry = self.entry(model_id)
        async with entry.turn:
            if seq_id is not None:
                try:
                    await asyncio.wait_for(entry.turn.wait_for(lambda: entry.next_seq >= seq_id), _SEQ_WAIT_S)
                except TimeoutError:
                    log.warning("tinker: %s request %d ran without request %d..%d, which never arrived", model_id,
                                seq_id, entry.next_seq, seq_id - 1)
            try:
                return await self.on_trainer(lambda: fn(entry))
            finally:
                if seq_id is not None:
                    entry.next_seq = max(entry.next_seq, seq_id + 1)
                entry.turn.notify_all()

    def checkpoint_dir(self, path: str, kind: str) -> Path:
        """The directory of a ``tinker://<model_id>/<kind>/<name>`` path."""
        prefix = "tinker://"
        parts = path[len(prefix):].split("/") if path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] != kind or not _NAME.match(parts[2]):
            raise TinkerRequestError(f"path {path!r} is not a tinker://<model_id>/{kind}/<name> path of this service")
        directory = self.state_dir / parts[0].replace(":", "_") / kind / parts[2]
        if not (directory / "tinker_model.json").is_file():
            raise TinkerRequestError(f"path {path!r}: no such checkpoint on this service")
        return directory

    def _new_dir(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        if not _NAME.match(name):
            raise TinkerRequestError(f"checkpoint name {name!r} may hold only letters, digits, '.', '_' and '-'")
        return f"tinker://{model_id}/{kind}/{name}", self.state_dir / model_id.replace(":", "_") / kind / name

    @staticmethod
    def _write_meta(directory: Path, spec: ModelSpec) -> None:
        (directory / "tinker_model.json").write_text(json.dumps(attrs.asdict(spec)))

    @staticmethod
    def read_meta(directory: Path) -> ModelSpec:
        return ModelSpec(**json.loads((directory / "tinker_model.json").read_text()))

    # -- operations ----------------------------------------------------------------------------------

    async def create_model(self, model_id: str, spec: ModelSpec) -> None:
        if model_id in self.training:
            return  # a retried request
        model = await self.on_trainer(lambda: TrainingModel(self.job, self.host, spec))
        self.training[model_id] = ModelEntry(model=model)

    async def save_state(self, model_id: str, seq_id: int | None, name: str | None) -> str:
        path, directory = self._new_dir(model_id, "weights", name or f"state_{uuid.uuid4().hex[:8]}")

        def save(entry: ModelEntry) -> None:
            directory.mkdir(parents=True, exist_ok=True)
            entry.model.save_state(directory / "trainer")
            self._write_meta(directory, entry.model.spec)

        await self.in_order(model_id, seq_id, save)
        return path

    async def load_state(self, model_id: str, seq_id: int | None, path: str, *, optimizer: bool) -> None:
        directory = self.checkpoint_dir(path, "weights")
        spec = self.read_meta(directory)
        entry = self.entry(model_id)
        if (spec.path, spec.lora_rank) != (entry.model.spec.path, entry.model.spec.lora_rank):
            raise TinkerRequestError(f"path {path!r} holds a checkpoint of {spec.name!r} (LoRA rank "
                                     f"{spec.lora_rank}), not of this model's {entry.model.spec.name!r} "
                                     f"(LoRA rank {entry.model.spec.lora_rank})")
        await self.in_order(model_id, seq_id, lambda e: e.model.load_state(directory / "trainer", optimizer=optimizer))

    async def save_for_sampler(self, model_id: str, seq_id: int | None, name: str | None) -> tuple[str, Path]:
        entry = self.entry(model_id)
        entry.sampler_saves += 1
        path, directory = self._new_dir(model_id, "sampler_weights", name or f"sampler_{entry.sampler_saves:06d}")

        def save(e: ModelEntry) -> None:
            directory.mkdir(parents=True, exist_ok=True)
            e.model.save_for_sampler(directory)
            self._write_meta(directory, e.model.spec)

        await self.in_order(model_id, seq_id, save)
        return path, directory

    def new_sampling_session(self, session: SamplingSession) -> str:
        session_id = f"sampling-{uuid.uuid4().hex}"
        self.sampling_sessions[session_id] = session
        return session_id

    def sampling_target(self, base_model: str | None, model_path: str | None) -> SamplingSession:
        """What a sampling client samples from: a sampler checkpoint, or a base model."""
        if model_path:
            directory = self.checkpoint_dir(model_path, "sampler_weights")
            return SamplingSession(weights_dir=str(directory), base_model=self.read_meta(directory).name,
                                   model_path=model_path)
        if base_model:
            return SamplingSession(weights_dir=self.model_path(base_model), base_model=base_model)
        raise TinkerRequestError("sampling needs a model_path (tinker://.../sampler_weights/...) or a base_model")

    async def unload(self, model_id: str) -> None:
        entry = self.training.pop(model_id, None)
        if entry is not None:
            await self.on_trainer(entry.model.close)

    async def close(self) -> None:
        await self.engines.close()
        for model_id in list(self.training):
            await self.unload(model_id)
        self._pool.shutdown(wait=False)
