"""The continuous-batching loop of the embedded engine.

One background thread owns the model, the KV cache and every request's state. Other threads talk
to it only through :meth:`Scheduler.call` (run a function between two model steps and get its
result as a ``concurrent.futures.Future``), so weight updates, aborts and pauses always land
between decode steps and never race with a forward pass.

Each loop iteration: run queued commands; unless paused, admit waiting requests into free slots
(one batched prefill, see below) and run one decode step for every running request; retire the
finished ones. Requests join and leave the batch between steps.

The admission round shares work across requests (identical prompts prefilled once, prefixes
reused from the :class:`~.kv_cache.PrefixCache`, prompts packed or chunked): see
:mod:`.batch_step`, which holds the steps of an iteration; this module holds the thread, the
commands and the loop.

Every generated token records the weight version of the model that produced it; a request that
stays across an in-place weight update therefore reports a list of versions.

The loop thread retires after :data:`IDLE_RETIRE_SECONDS` with nothing to do, and the next
:meth:`Scheduler.call` starts a new one. A thread that has run torch's parallel operators keeps
an OpenMP thread team (GNU libgomp) for as long as it lives; with more such threads alive than
cores, libgomp stops spinning between parallel regions, and every parallel operator of the
process pays for waking its workers. A colocated trainer in the same process ran its training
step 10-25% slower beside an idle engine thread that had decoded once (135M model, 2-core CPU:
elementwise operators and the optimizer step slowed by a third, matmuls not at all); with the
idle thread gone it runs as fast as alone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import attrs

from .batch_step import BatchStepMixin
from .kv_cache import PrefixCache
from .protocol import GenerateItem
from .request_checks import InvalidRequest
from .request_state import (
    EngineStats,
    EngineStopped,
    GenerationResult,
    MemoryBusy,
    MemoryReleased,
    RequestState,
    RidInUse,
    finish_json,
)
from .settings import EngineSettings
from .speculative import PromptLookup
from .weights import copy_named_tensors

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .runner import ModelRunner

log = logging.getLogger(__name__)

#: seconds without requests or commands after which the loop thread ends (see the module docstring)
IDLE_RETIRE_SECONDS = 0.2


class Scheduler(BatchStepMixin):
    """Continuous batching over a :class:`~.runner.ModelRunner`; see the module docstring."""

    def __init__(self, runner: "ModelRunner", settings: EngineSettings, eos_token_ids: Iterable[int]) -> None:
        import torch

        self._torch = torch
        self.runner = runner
        self.settings = settings
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefix_cache = PrefixCache(settings.prefix_cache_tokens)
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.paused = False
        self.released: set[str] = set()
        self.version = 0
        self.adapter: Any = None  # an engine.adapter.AdapterUpdater when the job trains a LoRA adapter
        self.stats = EngineStats()
        self._generator = torch.Generator().manual_seed(settings.seed)
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stopping = False
        self._started = False
        self._thread: threading.Thread | None = None  # None while the loop has retired (idle)
        self.decode: Callable[[list[int]], str] | None = None  # for stop strings (set by the engine)
        #: the tokenizer as llguidance sees it, for constrained requests (set by an engine with a tokenizer)
        self.token_grammar: Any = None
        self.drafter = PromptLookup(settings.speculative) if settings.speculative is not None else None

    # ------------------------------------------------------------------------------------------
    # thread-safe API
    # ------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            self._stopping = False
            self._started = True
            self._spawn()

    def _spawn(self) -> None:
        """Start a loop thread unless one runs (called with ``_cond`` held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="loongsage-engine-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
        with self._cond:
            self._thread = None
            self._started = False
        if thread is None:  # the loop had retired: nothing runs, nothing waits; fail what stayed paused
            self._finish_stopped()

    @property
    def alive(self) -> bool:
        """Started and not stopped; the loop thread itself may have retired while idle (the next
        call starts it again), but one that died with work to do is not alive."""
        thread = self._thread
        return self._started and not self._stopping and (thread is None or thread.is_alive())

    @property
    def loop_running(self) -> bool:
        """Whether a loop thread runs now (it retires after :data:`IDLE_RETIRE_SECONDS` idle)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` in the loop thread between two steps; its result or error goes to the future.

        Before :meth:`start` and after :meth:`stop` ``fn`` runs right away, in the caller's thread.
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
            if not self._started or self._stopping:
                inline = True
            else:
                inline = False
                self._commands.append(run)
                self._spawn()  # the loop may have retired while idle
                self._cond.notify_all()
        if inline:
            run()
        return fut

    def _start_grammar(self, req: RequestState) -> None:
        """Give a constrained request its grammar matcher, advanced over the prompt's last
        ``grammar_offset`` tokens (generated under it before an abort); a grammar this tokenizer
        cannot follow, or tokens it does not allow, are a 400 naming the field."""
        from loongsage_core.backend_api.grammar import GrammarError

        p = req.item.params
        if self.token_grammar is None:
            raise InvalidRequest("constrained decoding ('json_schema', 'regex', 'ebnf') needs the engine's "
                                 "tokenizer, and this engine has none", "sampling_params")
        try:
            req.grammar = self.token_grammar.matcher(p.grammar)
        except GrammarError as exc:
            raise InvalidRequest(f"the constraint cannot be followed with this tokenizer: {exc}",
                                 "sampling_params") from None
        req.grammar_stops = p.stop_token_ids or tuple(sorted(req.stop_ids))
        done = req.item.input_ids[len(req.item.input_ids) - p.grammar_offset:] if p.grammar_offset else []
        for token in done:
            if token not in req.grammar_stops and not req.grammar.consume_token(int(token)):
                raise InvalidRequest(f"'sampling_params.custom_params.grammar_offset': token {token} of the "
                                     "prompt's last tokens does not follow the constraint",
                                     "sampling_params.custom_params.grammar_offset")

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
            req = RequestState(item=item, tokens=list(item.input_ids), stop_ids=stop, generator=gen,
                               future=concurrent.futures.Future(), created=now, progress=progress)
            if p.grammar is not None:
                self._start_grammar(req)
            requests.append(req)

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
                    self._queue(req)

        self.call(enqueue)
        return [r.future for r in requests]

    def _queue(self, req: RequestState) -> None:
        """Put ``req`` in the waiting queue behind every request of its priority or higher."""
        waiting = self.waiting
        if not waiting or waiting[-1].item.priority >= req.item.priority:
            waiting.append(req)  # the usual case: equal priorities, first come first served
            return
        at = next(i for i, r in enumerate(waiting) if r.item.priority < req.item.priority)
        waiting.insert(at, req)

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
            # back to the queue ahead of the waiters of their priority, in their order (a stable sort
            # of a queue already in priority order)
            queue = sorted([*self.running, *self.waiting], key=lambda r: -r.item.priority)
            self.waiting, self.running = collections.deque(queue), []
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
    def _has_work(self) -> bool:
        """Whether the loop has something to do (called with ``_cond`` held)."""
        return bool(self._stopping or self._commands or (not self.paused and (self.waiting or self.running)))

    def _loop(self) -> None:
        torch = self._torch
        if self.settings.num_threads:
            torch.set_num_threads(self.settings.num_threads)
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._has_work():
                        if not self._cond.wait(timeout=IDLE_RETIRE_SECONDS) and not self._has_work():
                            self._thread = None  # idle: retire (the next call starts a new loop)
                            return
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
        self._finish_stopped()

    def _finish_stopped(self) -> None:
        """Fail what is left after a stop, and run the commands that came in meanwhile."""
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
