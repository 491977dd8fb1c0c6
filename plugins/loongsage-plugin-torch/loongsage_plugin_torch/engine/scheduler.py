"""The continuous-batching loop of the embedded engine.

One background thread owns the model, the KV cache and every request's state. Other threads talk
to it only through :meth:`Scheduler.call` (run a function between two model steps and get its
result as a ``concurrent.futures.Future``), so weight updates, aborts and pauses always land
between decode steps and never race with a forward pass.

Each loop iteration: run queued commands; unless paused, admit waiting requests into free slots
(one batched prefill, see below) and run one decode step for every running request; retire the
finished ones. Requests join and leave the batch between steps.

Admission shares work across requests: requests with identical token sequences in the same
admission round (the samples of one group) are prefilled once and the others copy the KV row;
a request whose tokens start with a sequence in the :class:`~.kv_cache.PrefixCache` (the prompt
of an earlier sample, the previous turn of the same conversation) copies that KV and prefills only
the rest. Prompts are prefilled packed together (no padding in the matrix products), and a prompt longer
than ``max_prefill_tokens`` in chunks.

Every generated token records the weight version of the model that produced it; a request that
stays across an in-place weight update therefore reports a list of versions.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import attrs

from .kv_cache import PrefixCache
from .protocol import GenerateItem, finish_json
from .sampling import sample
from .settings import EngineSettings
from .weights import copy_named_tensors

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .runner import ModelRunner

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine shut down before the request finished."""


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory tags for ``/release_memory_occupation`` and ``/resume_memory_occupation``."""


class MemoryReleased(RuntimeError):
    """A request arrived while the engine's memory is released (colocated training phase)."""


class MemoryBusy(ValueError):
    """Memory release was asked while requests are still running or waiting."""


class RidInUse(ValueError):
    """A new request reuses the ``rid`` of a request that is still queued or running."""


@attrs.define(frozen=True)
class GenerationResult:
    """What the scheduler hands back for one finished request."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    weight_version: int
    finish_reason: dict[str, Any]
    cached_tokens: int
    latency_s: float
    top_logprobs: list[list[tuple[float, int]]] | None = None


@attrs.define(eq=False)
class _Request:
    item: GenerateItem
    tokens: list[int]
    stop_ids: frozenset[int]
    generator: Any
    future: concurrent.futures.Future
    created: float
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    top_logprobs: list[list[tuple[float, int]]] = attrs.field(factory=list)
    progress: Callable[["GenerationResult"], None] | None = None
    slot: int = -1
    kv_len: int = 0
    cached_tokens: int = 0
    finish: dict[str, Any] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.item.input_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.item.input_ids)

    def matches(self, rid: str) -> bool:
        return self.item.rid == rid or self.item.parent_rid == rid


@attrs.define
class EngineStats:
    """Counters of the loop (shown by ``/get_server_info``)."""

    prefill_tokens: int = 0
    cached_tokens: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0


class Scheduler:
    """Continuous batching over a :class:`~.runner.ModelRunner`; see the module docstring."""

    def __init__(self, runner: "ModelRunner", settings: EngineSettings, eos_token_ids: Iterable[int]) -> None:
        import torch

        self._torch = torch
        self.runner = runner
        self.settings = settings
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefix_cache = PrefixCache(settings.prefix_cache_tokens)
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []
        self.paused = False
        self.released: set[str] = set()
        self.version = 0
        self.adapter: Any = None  # an engine.adapter.AdapterMerger when the job trains a LoRA adapter
        self.stats = EngineStats()
        self._generator = torch.Generator().manual_seed(settings.seed)
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.decode: Callable[[list[int]], str] | None = None  # for stop strings (set by the engine)

    # ------------------------------------------------------------------------------------------
    # thread-safe API
    # ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="loongsage-engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` in the loop thread between two steps; its result or error goes to the future.

        Without a running loop (before :meth:`start`, after :meth:`stop`) ``fn`` runs right away.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to the caller
                fut.set_exception(exc)

        with self._cond:
            if self._thread is None or self._stopping:
                inline = True
            else:
                inline = False
                self._commands.append(run)
                self._cond.notify_all()
        if inline:
            run()
        return fut

    def submit(self, items: Sequence[GenerateItem],
               progress: Callable[[GenerationResult], None] | None = None) -> list[concurrent.futures.Future]:
        """Queue generation requests; each future resolves to a :class:`GenerationResult`.

        ``progress`` (streaming) is called in the loop thread with the request's state so far
        (``finish_reason`` empty) after every token but the last; the future brings the last.
        """
        requests = []
        now = time.monotonic()
        for item in items:
            p = item.params
            stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
            gen = None
            if not p.greedy:
                gen = self._torch.Generator().manual_seed(p.seed) if p.seed is not None else self._generator
            requests.append(_Request(item=item, tokens=list(item.input_ids), stop_ids=stop, generator=gen,
                                     future=concurrent.futures.Future(), created=now, progress=progress))

        def enqueue() -> None:
            active = {r.item.rid for r in self.running} | {r.item.rid for r in self.waiting}
            for req in requests:
                if self.released:
                    req.future.set_exception(MemoryReleased(
                        f"the engine's memory is released ({', '.join(sorted(self.released))}); POST "
                        "/resume_memory_occupation before generating"))
                elif req.item.rid in active:
                    req.future.set_exception(RidInUse(f"rid '{req.item.rid}' is already in use"))
                else:
                    self.waiting.append(req)

        self.call(enqueue)
        return [r.future for r in requests]

    # ------------------------------------------------------------------------------------------
    # commands (run in the loop thread through ``call``)
    # ------------------------------------------------------------------------------------------
    def abort(self, rid: str | None, abort_all: bool, message: str = "aborted") -> int:
        """Finish matching requests now with ``finish_reason`` type ``abort``; returns how many."""
        hit = [r for r in (*self.running, *self.waiting) if abort_all or (rid is not None and r.matches(rid))]
        for req in hit:
            req.finish = finish_json("abort", message=message)
        if hit:
            self.waiting = collections.deque(r for r in self.waiting if r.finish is None)
            for req in hit:
                if req.slot < 0:
                    self._deliver(req)
            self._retire()
        return len(hit)

    def pause(self, mode: str) -> None:
        """``abort``: abort everything, then pause. ``in_place``: keep requests and their KV.
        ``retract``: move running requests back to the queue, dropping their KV (recomputed on resume)."""
        if mode == "abort":
            self.abort(None, True, "aborted by pause_generation")
        elif mode == "retract":
            for req in self.running:
                req.slot, req.kv_len = -1, 0
            self.waiting.extendleft(reversed(self.running))
            self.running = []
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def flush_cache(self) -> None:
        self.prefix_cache.clear()

    def release_memory(self, tags: Iterable[str]) -> list[str]:
        """Give back the memory of ``tags`` while the trainer uses the device (colocated runs).

        ``kv_cache`` drops the KV storage and the prefix cache (reallocated on demand). The
        embedded engine keeps its weights in host memory, so ``weights`` and ``cuda_graph`` free
        nothing here, but requests are refused until every released tag is resumed, as on SGLang.
        """
        busy = len(self.running) + len(self.waiting)
        if busy:
            raise MemoryBusy(f"{busy} requests are running or waiting; finish or abort them before releasing memory")
        tags = set(tags)
        if "kv_cache" in tags:
            self.runner.cache.reset()
            self.prefix_cache.clear()
        self.released |= tags
        return sorted(self.released)

    def resume_memory(self, tags: Iterable[str]) -> list[str]:
        """Take back what :meth:`release_memory` gave (the KV cache is reallocated on demand)."""
        self.released -= set(tags)
        return sorted(self.released)

    def set_version(self, version: int) -> None:
        if version != self.version:
            self.prefix_cache.clear()  # cached prefixes were computed by other weights
        self.version = version

    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: int | None) -> int:
        """Copy tensors into the model in place and set the weight version (``None``: current + 1)."""
        if self.adapter is not None:  # LoRA: adapter tensors are merged, full ones copied
            count = self.adapter.load(self.runner.named_tensors(), named_tensors)
        else:
            count = copy_named_tensors(self.runner.named_tensors(), named_tensors)
        self.prefix_cache.clear()
        self.version = self.version + 1 if version is None else version
        return count

    def snapshot(self) -> dict[str, Any]:
        return {"running": len(self.running), "waiting": len(self.waiting), "paused": self.paused,
                "memory_released": sorted(self.released),
                "weight_version": self.version, "prefix_cache_entries": len(self.prefix_cache),
                "prefix_cache_tokens": self.prefix_cache.tokens, "kv_slots": self.runner.cache.slots,
                "kv_capacity": self.runner.cache.capacity, **attrs.asdict(self.stats)}

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch = self._torch
        if self.settings.num_threads:
            torch.set_num_threads(self.settings.num_threads)
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._stopping or self._commands or
                               (not self.paused and (self.waiting or self.running))):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                for command in commands:
                    command()
                if self.paused:
                    continue
                try:
                    if self.waiting and len(self.running) < self.settings.max_batch_size:
                        self._admit()
                    if self.running:
                        self._decode()
                except Exception as exc:  # a model failure fails the requests, not the server
                    log.exception("embedded engine step failed")
                    self._fail_all(exc)
        self._fail_all(EngineStopped("the engine shut down"))
        with self._cond:
            commands, self._commands = self._commands, []
        for command in commands:
            command()

    def _fail_all(self, exc: BaseException) -> None:
        for req in (*self.running, *self.waiting):
            if not req.future.done():
                req.future.set_exception(exc)
        self.running, self.waiting = [], collections.deque()
        self.runner.cache.reset()

    # ------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        torch = self._torch
        t0 = time.perf_counter()
        budget = self.settings.max_prefill_tokens
        free = self.settings.max_batch_size - len(self.running)
        reps: list[tuple[_Request, Any, int]] = []  # (request, prefix entry, cached length)
        dups: list[tuple[_Request, _Request]] = []  # (request, the identical request prefilled for it)
        by_tokens: dict[tuple[int, ...], _Request] = {}
        new_tokens = 0
        while self.waiting and free > 0:
            req = self.waiting[0]
            if req.num_output >= req.item.params.max_new_tokens:  # max_new_tokens == 0
                self.waiting.popleft()
                req.finish = finish_json("length", length=req.item.params.max_new_tokens)
                self._deliver(req)
                continue
            key = tuple(req.tokens)
            twin = by_tokens.get(key)
            if twin is not None:
                dups.append((req, twin))
            else:
                entry, cached = self.prefix_cache.lookup(req.tokens, self.version, len(req.tokens) - 1)
                n = len(req.tokens) - cached
                if reps and new_tokens + n > budget:
                    break
                reps.append((req, entry, cached))
                by_tokens[key] = req
                new_tokens += n
            self.waiting.popleft()
            free -= 1
        if not reps:
            return
        reps.sort(key=lambda r: len(r[0].tokens) - r[2], reverse=True)
        base = len(self.running)
        joined = [r for r, _, _ in reps] + [r for r, _ in dups]
        for i, req in enumerate(joined):
            req.slot = base + i
        self.running.extend(joined)  # from here on a failure reaches these requests too
        for req, entry, cached in reps:
            if entry is not None:
                self.runner.cache.write(req.slot, entry.keys, entry.values, cached)
            req.kv_len = req.cached_tokens = cached
        logits = self._prefill([r for r, _, _ in reps])
        for req, _, _ in reps:
            req.kv_len = len(req.tokens)
            self.stats.prefill_tokens += len(req.tokens) - req.cached_tokens
            self.stats.cached_tokens += req.cached_tokens
            if self.prefix_cache.capacity_tokens:
                keys, values = self.runner.cache.read(req.slot, req.kv_len)
                self.prefix_cache.insert(req.tokens, keys, values, self.version)
        row_of = {id(r): i for i, (r, _, _) in enumerate(reps)}
        for req, twin in dups:
            self.runner.cache.move(twin.slot, req.slot, twin.kv_len)
            req.kv_len = req.cached_tokens = twin.kv_len
            self.stats.cached_tokens += twin.kv_len
        rows = torch.tensor([row_of[id(r)] for r, _, _ in reps] + [row_of[id(t)] for _, t in dups])
        self._sample_and_append(joined, logits[rows])
        self.stats.prefill_seconds += time.perf_counter() - t0
        self._retire()

    def _prefill(self, reqs: list[_Request]) -> "torch.Tensor":
        """Run the new tokens of ``reqs`` (slots assigned, contiguous); logits ``[len(reqs), V]``.

        Rows are packed up to ``max_prefill_tokens`` new tokens per forward; a row longer than
        that is prefilled alone, in chunks.
        """
        torch = self._torch
        budget = self.settings.max_prefill_tokens
        out: list[Any] = []
        i = 0
        while i < len(reqs):
            req = reqs[i]
            if len(req.tokens) - req.kv_len > budget:  # one long prompt: prefill it in chunks
                start = req.kv_len
                while start < len(req.tokens):
                    end = min(len(req.tokens), start + budget)
                    logits = self.runner.forward(torch.tensor(req.tokens[start:end]), req.slot,
                                                 torch.tensor([start]), torch.tensor([end - start]))
                    start = end
                out.append(logits)
                i += 1
                continue
            group, total = [], 0
            while i < len(reqs) and total + len(reqs[i].tokens) - reqs[i].kv_len <= budget:
                group.append(reqs[i])
                total += len(reqs[i].tokens) - reqs[i].kv_len
                i += 1
            flat = [t for r in group for t in r.tokens[r.kv_len:]]
            starts = torch.tensor([r.kv_len for r in group])
            counts = torch.tensor([len(r.tokens) - r.kv_len for r in group])
            out.append(self.runner.forward(torch.tensor(flat), group[0].slot, starts, counts))
        return torch.cat(out, 0)

    def _decode(self) -> None:
        torch = self._torch
        t0 = time.perf_counter()
        reqs = self.running
        ids = torch.tensor([r.tokens[-1] for r in reqs])
        starts = torch.tensor([r.kv_len for r in reqs])
        logits = self.runner.forward(ids, 0, starts, torch.ones(len(reqs), dtype=torch.long))
        for req in reqs:
            req.kv_len += 1
        self._sample_and_append(reqs, logits)
        self.stats.decode_steps += 1
        self.stats.decode_seconds += time.perf_counter() - t0
        self._retire()

    def _sample_and_append(self, reqs: Sequence[_Request], logits: "torch.Tensor") -> None:
        tokens, logprobs = sample(logits, [r.item.params for r in reqs], [r.generator for r in reqs])
        max_context = self.settings.max_context_length
        top_k = max(r.item.top_logprobs_num for r in reqs)
        top_vals = top_ids = None
        if top_k:  # SGLang's top_logprobs_num: the most likely tokens under the raw logits
            top_vals, top_ids = self._torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for i, (req, tok, lp) in enumerate(zip(reqs, tokens.tolist(), logprobs.tolist())):
            req.tokens.append(tok)
            req.logprobs.append(lp)
            req.versions.append(self.version)
            n = req.item.top_logprobs_num
            if n and top_vals is not None and top_ids is not None:
                req.top_logprobs.append(list(zip(top_vals[i][:n], top_ids[i][:n])))
            params = req.item.params
            matched = self._stop_string(req) if params.stop else None
            if tok in req.stop_ids:
                req.finish = finish_json("stop", matched=tok)
            elif matched is not None:
                req.finish = finish_json("stop", matched=matched)
            elif req.num_output >= params.max_new_tokens or len(req.tokens) >= max_context:
                req.finish = finish_json("length", length=req.num_output)
            if req.progress is not None and req.finish is None:
                req.progress(self._result(req, {}))
        self.stats.generated_tokens += len(reqs)

    def _stop_string(self, req: _Request) -> str | None:
        """The stop string the newest token completed, if any (the tail of the output is decoded)."""
        if self.decode is None:
            return None
        stops = req.item.params.stop
        window = max(len(s) for s in stops) + 8  # tokens: enough to hold any stop string and its neighbours
        out = req.tokens[req.prompt_len:]
        text = self.decode(out[-window:])
        before = self.decode(out[-window:-1]) if len(out) > 1 else ""
        for stop in stops:
            if stop in text and stop not in before:
                return stop
        return None


    def _retire(self) -> None:
        """Hand back finished requests and keep the running ones in slots ``0..B-1``."""
        done = [r for r in self.running if r.finish is not None]
        if not done:
            return
        alive = [r for r in self.running if r.finish is None]
        for req in done:
            if self.prefix_cache.capacity_tokens and req.kv_len >= self.prefix_cache.block:
                keys, values = self.runner.cache.read(req.slot, req.kv_len)
                self.prefix_cache.insert(req.tokens[: req.kv_len], keys, values, self.version)
        n = len(alive)
        holes = sorted(r.slot for r in done if r.slot < n)
        movers = [r for r in alive if r.slot >= n]
        for hole, req in zip(holes, movers):
            self.runner.cache.move(req.slot, hole, req.kv_len)
            req.slot = hole
        alive.sort(key=lambda r: r.slot)
        self.running = alive
        if not alive and not self.waiting:
            self.runner.cache.reset()  # idle: give the KV memory back
        for req in done:
            req.slot = -1
            self._deliver(req)

    def _deliver(self, req: _Request) -> None:
        if req.future.done():
            return
        self.stats.finished_requests += 1
        if req.finish and req.finish.get("type") == "abort":
            self.stats.aborted_requests += 1
        req.future.set_result(self._result(req, req.finish or finish_json("abort", message="no finish reason")))

    def _result(self, req: _Request, finish: dict[str, Any]) -> GenerationResult:
        return GenerationResult(
            rid=req.item.rid, prompt_tokens=req.prompt_len, output_ids=req.tokens[req.prompt_len:],
            logprobs=list(req.logprobs), weight_versions=list(req.versions),
            weight_version=req.versions[-1] if req.versions else self.version,
            finish_reason=dict(finish),
            cached_tokens=req.cached_tokens, latency_s=time.monotonic() - req.created,
            top_logprobs=[list(row) for row in req.top_logprobs] if req.item.top_logprobs_num else None)
