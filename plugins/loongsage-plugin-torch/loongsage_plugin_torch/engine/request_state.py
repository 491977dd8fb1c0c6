"""What the engine's batching loop keeps per request, what it hands back, and the errors it raises.

Plain data, apart from the loop (:mod:`.scheduler`) and its steps (:mod:`.batch_step`) so that
the HTTP server can name the results and errors without importing the loop's machinery.
:func:`finish_json` writes SGLang's ``finish_reason`` object, the one field of a result the loop
shapes for the wire.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import attrs

from .protocol import GenerateItem


def finish_json(kind: str, **extra: Any) -> dict[str, Any]:
    """SGLang's ``finish_reason`` object: ``{"type": "stop"|"length"|"abort", ...}``."""
    return {"type": kind, **extra}


class EngineStopped(RuntimeError):
    """The engine shut down before the request finished."""


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
    #: ``return_routed_experts``: int32 ``[positions, layers, top_k]`` expert ids of every position
    #: the model ran (prompt and output but the last token; -1 in dense layers)
    routed_experts: Any = None
    #: with speculative decoding: ``verify_forwards`` (decode forwards), ``draft_tokens``,
    #: ``accepted_tokens`` and ``emitted_tokens`` (the tokens those forwards produced)
    speculative: dict[str, int] | None = None
    #: ``logprob_start_len`` >= 0: the log-prob of each prompt token from that position on (``None``
    #: for position 0, which nothing precedes), and with ``top_logprobs_num`` its most likely tokens
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[float, int]] | None] | None = None


@attrs.define
class SpeculationCounts:
    """A request's speculative-decoding counters (see :mod:`.speculative`), and its n-gram index."""

    verify_forwards: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    index: dict[tuple[int, ...], int] = attrs.field(factory=dict, repr=False)
    indexed: int = 0
    skip: int = 0  # decode steps left without drafting (after drafts that were all rejected)
    backoff: int = 0  # the skip set after the latest all-rejected draft (doubles while they keep failing)

    def record(self, drafted: int, accepted: int, max_backoff: int = 32) -> None:
        """Count one verified draft; after one that was rejected outright the request drafts
        again only after 1, 2, 4, ... steps (up to ``max_backoff``), so text that does not copy
        its context costs few wasted draft positions; any acceptance resets the back-off."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if accepted:
            self.backoff = 0
        else:
            self.backoff = min(max_backoff, max(1, 2 * self.backoff))
            self.skip = self.backoff

    def as_dict(self) -> dict[str, int]:
        return {"verify_forwards": self.verify_forwards, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "emitted_tokens": self.emitted_tokens}


@attrs.define(eq=False)
class RequestState:
    """One request inside the loop: its tokens so far, sampling generator, KV slot and length,
    per-token log-probs and weight versions, and the future its :class:`GenerationResult` goes to."""

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
    routed_experts: Any = None
    speculation: SpeculationCounts = attrs.field(factory=SpeculationCounts)
    #: the llguidance matcher of a constrained request (``params.grammar``), else ``None``
    grammar: Any = None
    #: the stop tokens the grammar allows where it may end (the request's ``stop_token_ids``)
    grammar_stops: tuple[int, ...] = ()
    #: the prompt's token log-probs (``logprob_start_len``), computed by its prefill
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    #: whether admission held it back for a more urgent running request (counted once)
    held: bool = False

    @property
    def scores_prompt(self) -> bool:
        """Whether the next prefill must score the prompt's tokens (``logprob_start_len``)."""
        return self.item.return_logprob and self.item.logprob_start_len >= 0 and self.prompt_logprobs is None

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
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    priority_held_requests: int = 0
