"""Sampling for Tinker clients on the job's rollout engine (``[rollout] engine``, bound through the
plugin host), one engine per set of weights.

A sampler checkpoint is a Hugging Face directory (:meth:`TrainingModel.save_for_sampler`); the
engine for it is started on first use and kept, so a sampling client always samples from the
weights it was made for (Tinker's snapshot semantics). Once ``max_engines`` are running, new
weights go into the least recently used idle engine of the same architecture
(``/update_weights_from_disk``, SGLang's and the embedded engine's) rather than a new engine: a
training loop that saves sampler weights every step starts its engines once. Otherwise the oldest
idle engine is stopped. An engine serving a request is neither reloaded nor stopped: the pool
then runs more than ``max_engines`` until those requests finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import attrs

from .batches import TinkerRequestError

log = logging.getLogger(__name__)


@attrs.define
class SampledSequence:
    """One sampled continuation: its tokens, their log-probs, ``"stop"`` or ``"length"``, and the
    most likely tokens at each position (``(token, log-prob)``; ``None`` unless asked)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    top: list[list[tuple[int, float]]] | None = None


@attrs.define
class Sampled:
    """What one ``sample`` request returns: the sequences and, when asked, the prompt's scores
    (one entry per prompt token, ``None`` where not scored)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None


@attrs.define
class _Engine:
    engine: Any
    client: Any
    model: str  # :func:`model_fingerprint` of the weights it serves
    in_use: int = 0


_NOT_ARCHITECTURE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def model_fingerprint(path: str) -> str:
    """The architecture of the Hugging Face directory ``path`` (its ``config.json`` without the
    keys that name no shape): weights with the same fingerprint load into each other's engines."""
    config = json.loads((Path(path) / "config.json").read_text())
    return json.dumps({k: v for k, v in config.items() if k not in _NOT_ARCHITECTURE}, sort_keys=True)


class EnginePool:
    """Engines by weights directory; :meth:`sample` generates on the one for a directory."""

    def __init__(self, job: Any, host: Any, *, max_engines: int = 2) -> None:
        self.job = job
        self.host = host
        self.max_engines = max(1, int(max_engines))
        self._engines: OrderedDict[str, _Engine] = OrderedDict()
        self._lock = asyncio.Lock()
        self.started = 0  # engines started, and weights loaded into a running one instead
        self.reloaded = 0

    def _start(self, path: str) -> _Engine:
        """Start an engine on ``path`` (blocking: loads the model)."""
        from loongsage_core.backend_api.engines import EngineClient
        from loongsage_hookspecs import ComponentRef, EngineContext

        job = attrs.evolve(self.job, model=attrs.evolve(self.job.model, path=path, tokenizer=path, config={}),
                           train=attrs.evolve(self.job.train, lora=None))
        ref = ComponentRef("rollout_engine", job.rollout.engine, where="[rollout] engine")
        engine = self.host.bind(ref, EngineContext(where=ref.where, job=job, components=self.host))
        url = engine.start()
        self.started += 1
        return _Engine(engine=engine, client=EngineClient(url), model=model_fingerprint(path))

    async def _acquire(self, path: str) -> _Engine:
        """The engine for ``path`` (reloaded or started if need be), marked in use."""
        async with self._lock:
            if path not in self._engines and not (len(self._engines) >= self.max_engines
                                                  and await self._reload_idle(path)):
                await self._evict(self.max_engines - 1)
                self._engines[path] = await asyncio.to_thread(self._start, path)
            self._engines.move_to_end(path)
            engine = self._engines[path]
            engine.in_use += 1
            return engine

    async def _reload_idle(self, path: str) -> bool:
        """Load ``path``'s weights into the least recently used idle engine of the same
        architecture (SGLang's ``/update_weights_from_disk``, which the embedded engine serves too)
        instead of stopping it and starting another: a loop that saves sampler weights every step
        keeps its engines (an SGLang server starts once). False when no engine could take them."""
        model = model_fingerprint(path)
        for old, engine in list(self._engines.items()):
            if engine.in_use or engine.model != model:
                continue
            try:
                await engine.client.update_weights_from_disk(path)
            except Exception as exc:  # it may hold part of them: stopped, and a new engine started instead
                log.warning("tinker sampling: reloading an engine with %s failed (%s); starting a new one", path, exc)
                del self._engines[old]
                await engine.client.aclose()
                await asyncio.to_thread(engine.engine.shutdown)
                return False
            del self._engines[old]
            self._engines[path] = engine
            self.reloaded += 1
            return True
        return False

    async def _evict(self, keep: int) -> None:
        """Stop the least recently used idle engines until at most ``keep`` run (under the lock)."""
        for path in [p for p, e in self._engines.items() if e.in_use == 0]:
            if len(self._engines) <= keep:
                break
            old = self._engines.pop(path)
            await old.client.aclose()
            await asyncio.to_thread(old.engine.shutdown)

    async def sample(self, path: str, prompt: list[int], num_samples: int, params: dict[str, Any], *,
                     prompt_from: int | None = None, top_k: int = 0) -> Sampled:
        """``num_samples`` continuations of ``prompt`` with Tinker ``SamplingParams``: each its
        tokens, their log-probs, ``"stop"`` or ``"length"`` and (``top_k``) the ``top_k`` most
        likely tokens at each; with ``prompt_from``, the log-probs (and ``top_k`` most likely tokens)
        of the prompt's tokens from that position on, scored once, by the first sample's prefill."""
        base = engine_params(params)
        # with a seed, sample i draws with seed + i: reproducible, and not n copies of one sample
        per_sample = [dict(base, sampling_seed=base["sampling_seed"] + i) if "sampling_seed" in base else base
                      for i in range(num_samples)]
        starts = None if prompt_from is None else [prompt_from] + [-1] * (num_samples - 1)
        engine = await self._acquire(path)
        try:
            results = await engine.client.generate([prompt] * num_samples, per_sample, top_logprobs_num=top_k,
                                                   logprob_start_len=starts)
        finally:
            engine.in_use -= 1
        out = Sampled(sequences=[])
        for r in results:
            logprobs = [float(x) if x is not None else 0.0 for x in (r.logprobs or [])]
            top = [[(int(t), float(lp)) for lp, t in row] for row in r.top_logprobs] if top_k and r.top_logprobs \
                else None
            out.sequences.append(SampledSequence(list(r.output_ids), logprobs,
                                                 "length" if r.finish_reason == "length" else "stop", top))
        if prompt_from is not None:
            meta = results[0].meta_info
            scored = meta.get("input_token_logprobs") or []
            out.prompt_logprobs = [None] * prompt_from + [None if e[0] is None else float(e[0]) for e in scored]
            if top_k:
                rows = meta.get("input_top_logprobs") or []
                out.prompt_top = [None] * prompt_from + [
                    None if row is None else [(int(e[1]), float(e[0])) for e in row] for row in rows]
        return out

    async def close(self) -> None:
        async with self._lock:
            for engine in self._engines.values():
                engine.in_use = 0
            await self._evict(0)

    @property
    def running(self) -> list[str]:
        """The weights directories with a running engine, least recently used first."""
        return list(self._engines)


def engine_params(params: dict[str, Any]) -> dict[str, Any]:
    """Tinker ``SamplingParams`` as the engine's ``sampling_params``."""
    out: dict[str, Any] = {"temperature": float(params.get("temperature", 1.0)),
                           "top_p": float(params.get("top_p", 1.0)), "top_k": int(params.get("top_k", -1))}
    if params.get("max_tokens") is not None:
        out["max_new_tokens"] = int(params["max_tokens"])
    if params.get("seed") is not None:
        out["sampling_seed"] = int(params["seed"])
    stop = params.get("stop")
    if isinstance(stop, str):
        out["stop"] = [stop]
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        out["stop"] = stop
    elif isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
        out["stop_token_ids"] = stop
    elif isinstance(stop, list) and not stop:
        out["ignore_eos"] = True
    elif stop is not None:
        raise TinkerRequestError(f"sampling_params.stop must be a string, a list of strings or of token ids, "
                                 f"got {stop!r}")
    return out


MAX_TOPK = 1000
"""The most likely tokens a request may ask for per position (the embedded engine's bound)."""


def prompt_scores_from(req: Any, prompt_len: int) -> int | None:
    """The first prompt position a ``SampleRequest`` wants scored: ``None`` when it asks for no
    prompt log-probs, 0 for the whole prompt (``prompt_logprobs`` or ``topk_prompt_logprobs``),
    ``len(prompt) - N`` with ``prompt_logprobs_last_n`` = N; a bad request is a
    :class:`TinkerRequestError` naming the field."""
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = int(getattr(req, name) or 0)
        if not 0 <= k <= MAX_TOPK:
            raise TinkerRequestError(f"sample: {name} must be between 0 and {MAX_TOPK}, got {k}")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not req.prompt_logprobs:
            raise TinkerRequestError("sample: prompt_logprobs_last_n requires prompt_logprobs")
        if not 1 <= int(last_n) <= prompt_len - 1:
            raise TinkerRequestError(f"sample: prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = "
                                     f"{prompt_len - 1}, got {last_n}")
        return prompt_len - int(last_n)
    return 0 if req.prompt_logprobs or int(req.topk_prompt_logprobs or 0) > 0 else None
