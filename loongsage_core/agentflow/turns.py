"""One model turn of a trajectory, whatever protocol asked for it: plan, generate, record.

Every protocol adapter translates its request into a chat-completions body and calls
:meth:`TurnRunner.run_turn`. Request middleware runs; the conversation is rendered to token ids
on a worker thread (:mod:`.tito`, :mod:`.conversation`) after the size check; the sampling policy
(:mod:`.sampling`) says how much may be generated; an engine generates from the ids (streaming
text to the agent as it comes when it asked for a stream, :mod:`.streaming`), resuming after
engine aborts (weight updates with partial rollouts); response middleware runs; the output tokens
are recorded with their log-probs and weight versions. A client that goes away has its generation
aborted at the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
import uuid
from typing import Any, Awaitable, Callable, Sequence

import attrs

from loongsage_hookspecs import GrammarSpan, RoutedExperts, SegmentImage, TrajectoryStatus

from ..grammar import TokenGrammar, token_grammar
from ._request_keys import MAX_NEW_TOKENS
from .constraints import TurnConstraint, turn_constraint
from .conversation import TurnPlan
from .engines import EngineBalancer, EngineOutput, EnginePool
from .errors import RouterError, bad_request, not_found
from .images import ImageInputs, image_spans, images_in_order, refuse_images
from .openai_api import ChatRequest, completion_body, new_completion_id, parse_chat_request
from .record import TurnInfo
from .registry import LiveTrajectory, TrajectoryRegistry
from .sampling import check_context_room, check_prompt_size, engine_sampling, max_new_tokens
from .streaming import TextStreamer, cut_at_stop
from .tito import ChatRenderer, TemplateError


def refuse_if_aborted(entry: LiveTrajectory) -> None:
    """A trajectory the host aborted takes no more turns: 409 ``trajectory_aborted``."""
    if entry.aborted:
        raise RouterError(409, f"trajectory '{entry.record.trajectory_id}' was aborted",
                          code="trajectory_aborted", retry=False)


def refuse_if_failed(entry: LiveTrajectory) -> None:
    """A trajectory that failed (its prompt overflowed the context) takes no more turns: its record
    stays ``failed`` with the reason, and every later request gets the same 400."""
    rec = entry.record
    if rec.status is TrajectoryStatus.FAILED:
        raise bad_request(f"trajectory '{rec.trajectory_id}' failed and takes no more turns: {rec.error}",
                          param="messages", code=rec.finish_reason or "trajectory_failed")


@attrs.define
class Generation:
    """What the engine generated for one turn (over every resumed call)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    engine: str = ""
    continuations: int = 0
    top_logprobs: list[list[tuple[float, int]]] | None = None
    content: str | None = None
    cached_tokens: int = 0
    #: prompt tokens the prefix cache served to the turn's first engine call (its input was the turn's prompt)
    prompt_cached_tokens: int = 0
    #: the latest engine call's routed experts (its input held every earlier token of the segment)
    routed_experts: RoutedExperts | None = None
    #: speculative decoding's counters, summed over the turn's engine calls (None: the engine reports none)
    speculative: dict[str, int] | None = None


@attrs.define
class TurnLimits:
    """The router's limits on one turn (see :class:`~.router.AgentFlowRouter`)."""

    max_prompt_chars: int
    max_continuations: int
    engine_retries: int = 0
    """How often one turn is sent again after its engine could not be reached (0: never)."""
    engine_wait_s: float = 0.0
    """How long a turn waits for an engine to come up again when every engine is down."""


class TurnRunner:
    """Serves the turns of a router's trajectories (runs on the router's event loop only)."""

    def __init__(self, registry: TrajectoryRegistry, renderer: ChatRenderer, balancer: EngineBalancer,
                 engines: EnginePool, middlewares: Sequence[Any], model_name: str, limits: TurnLimits,
                 render_pool: concurrent.futures.Executor,
                 on_engine_lost: Callable[[str], None] | None = None, images: ImageInputs | None = None) -> None:
        self.registry = registry
        self.renderer = renderer
        self.balancer = balancer
        self.engines = engines
        self.middlewares = list(middlewares)
        self.model_name = model_name
        self.limits = limits
        self.render_pool = render_pool
        self.on_engine_lost = on_engine_lost
        self.images = images
        """The model's image handling (``None``: a text-only model, image parts are a 400)."""
        self.stats = {"requests": 0, "errors": 0, "engine_calls": 0, "completion_tokens": 0, "engine_retries": 0}
        self._engine_ctx: dict[str, int | None] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._token_grammar: TokenGrammar | None = None

    # ------------------------------------------------------------------------ engine plumbing
    def abort_at_engine(self, url: str, rid: str) -> None:
        """Ask ``url`` to abort ``rid`` in the background (the registry's abort hook)."""
        task = asyncio.get_running_loop().create_task(self.engines.abort(url, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _engine_context(self, url: str) -> int | None:
        """The engine's context length, cached once known."""
        if url not in self._engine_ctx:
            reachable, found = await self.engines.context_length(url)
            if not reachable:
                return None  # ask again next time
            self._engine_ctx[url] = found
        return self._engine_ctx[url]

    # ------------------------------------------------------------------------ what adapters call
    def lookup(self, request: Any) -> LiveTrajectory:
        """The trajectory ``request``'s URL names (404 when unknown or a stale attempt)."""
        return self.registry.lookup(request.match_info["tid"], request.match_info["attempt"])

    def protocol_state(self, request: Any, protocol: str) -> dict[str, Any]:
        """A dict that lives as long as the trajectory ``request`` names, for one protocol's own state."""
        return self.lookup(request).protocol_state.setdefault(protocol, {})

    async def count_prompt_tokens(self, request: Any, body: Any) -> int:
        """Tokens the chat-completions ``body`` would send to the engine (nothing is recorded)."""
        entry = self.lookup(request)
        req = parse_chat_request(body)
        self._resolve_images(entry, req)
        return len((await self._plan(entry, req)).context)

    async def run_turn(self, request: Any, body: Any, stream: Any = None) -> tuple[ChatRequest, dict[str, Any]]:
        """Serve one model turn of the trajectory that ``request``'s URL names; any protocol.

        ``body`` is a chat-completions request (protocol adapters translate theirs into one).
        Request middleware runs, the turn is planned, generated and recorded, response middleware
        runs; returns the validated request and the ``chat.completion`` answer. With ``stream``
        (an object with ``async start(*, prompt_tokens, model)`` and ``async delta(increments)``,
        see :class:`~.openai_api.ChatCompletionStream`), ``start`` is awaited once the turn is
        accepted (errors before it are ordinary error answers) and ``delta`` with each piece of
        new text (``{"content": ..., "reasoning_content": ...}``) as tokens arrive from the
        engine, the last piece before this returns.
        """
        self.stats["requests"] += 1
        entry = self.lookup(request)
        tid = entry.record.trajectory_id
        parse_chat_request(body)  # middleware sees only valid requests
        for mw in self.middlewares:
            body = mw.on_request(tid, body)
            if not isinstance(body, dict):
                raise RouterError(500, f"middleware {type(mw).__name__}.on_request returned "
                                       f"{type(body).__name__}, expected a dict", type="server_error")
        req = parse_chat_request(body)
        self._resolve_images(entry, req)
        async with entry.lock:
            refuse_if_aborted(entry)
            refuse_if_failed(entry)
            if not self.registry.is_live(entry):
                raise not_found(f"unknown trajectory '{tid}'", code="trajectory_not_found")
            response = await self._complete(entry, req, body, stream, request)
        return req, response

    # ------------------------------------------------------------------------ one turn
    def _resolve_images(self, entry: LiveTrajectory, req: ChatRequest) -> None:
        """Decode and check the request's images, keep their bytes with the trajectory and put
        their placeholders in the messages (:class:`~.images.ImageInputs`); a 400 for a model
        that takes no images."""
        if self.images is None:
            refuse_images(req.messages)
        else:
            self.images.resolve(req.messages, entry.record.images)

    async def _plan(self, entry: LiveTrajectory, req: ChatRequest) -> TurnPlan:
        """The turn plan, rendered and tokenized on a worker thread after the size check; the
        images of its context are placed on their placeholder tokens."""
        check_prompt_size(req.messages, req.offered_tools, self.limits.max_prompt_chars)
        work = functools.partial(entry.tracker.plan, req.messages, req.offered_tools, req.chat_template_kwargs,
                                 req.continue_final_message)
        try:
            plan = await asyncio.get_running_loop().run_in_executor(self.render_pool, work)
        except TemplateError as exc:
            raise bad_request(str(exc), param="messages", code="chat_template_error") from None
        if self.images is not None:
            hashes = images_in_order(plan.messages)
            spans = image_spans(plan.context, self.images.image_token_id)
            if len(spans) != len(hashes):
                raise bad_request(f"the chat template rendered {len(spans)} image placeholders for the "
                                  f"conversation's {len(hashes)} images", param="messages", code="chat_template_error")
            plan.images = [SegmentImage(h, start, length) for h, (start, length) in zip(hashes, spans)]
        return plan

    def _image_data(self, entry: LiveTrajectory, plan: TurnPlan) -> list[str] | None:
        """The base64 bytes of the plan's images in token order, for the engine (``None``: none)."""
        return [entry.record.images[image.sha256] for image in plan.images] or None

    async def _constraint(self, req: ChatRequest, body: dict[str, Any]) -> TurnConstraint | None:
        """The turn's constraint (:mod:`.constraints`); the tokenizer's grammar view is built on a
        worker thread the first time a turn needs one."""
        if req.response_format is None and req.tool_choice != "required" and not isinstance(req.tool_choice, dict):
            return None
        if self._token_grammar is None:
            tokenizer = self.renderer.tokenizer
            self._token_grammar = await asyncio.get_running_loop().run_in_executor(
                self.render_pool, token_grammar, tokenizer, len(tokenizer))
        return turn_constraint(req, body, self.middlewares, self._token_grammar)

    async def _complete(self, entry: LiveTrajectory, req: ChatRequest, body: dict[str, Any],
                        stream: Any = None, request: Any = None) -> dict[str, Any]:
        """Plan, generate, run response middleware, commit: one turn. The tokens the turn may
        generate (a request's limit lowered to what the trajectory may still generate) are kept
        on ``request`` for the answer's ``x-loongsage-max-new-tokens`` header."""
        rec = entry.record
        started = time.perf_counter()
        constraint = await self._constraint(req, body)
        plan = await self._plan(entry, req)
        engine_ctx = await self._engine_context(self.balancer.pick(rec.trajectory_id))
        # planning awaited: an abort that landed meanwhile must not be overwritten by GENERATING below
        refuse_if_aborted(entry)
        check_context_room(rec, len(plan.context), engine_ctx)
        max_new = max_new_tokens(entry.sampling, rec, req, len(plan.context), engine_ctx)
        if request is not None:
            request[MAX_NEW_TOKENS] = max_new
        streamer = None
        if stream is not None:
            await stream.start(prompt_tokens=len(plan.context), model=req.model or self.model_name)
            streamer = TextStreamer(self.renderer.content_of, self.middlewares, rec.trajectory_id, body, req.stop)

        async def on_tokens(ids: list[int]) -> None:
            assert streamer is not None
            increments = streamer.update(ids)
            if increments:
                await stream.delta(increments)

        if max_new > 0:
            rec.status = TrajectoryStatus.GENERATING
            gen = await self._generate(entry, plan, req, max_new, on_tokens if streamer is not None else None,
                                       constraint)
            gen.content, matched_stop = cut_at_stop(self.renderer.content_of(gen.ids), req.stop)
            if matched_stop is not None:
                gen.finish_reason = "stop"
        else:  # a budget is spent: end the turn without generating
            gen, matched_stop = Generation([], [], [], "length", content=""), None
        response = completion_body(
            completion_id=new_completion_id(), model=req.model or self.model_name,
            message={"role": "assistant", "content": gen.content}, finish_reason=gen.finish_reason,
            prompt_tokens=len(plan.context), completion_tokens=len(gen.ids),
            logprobs=self._logprobs_body(gen) if req.logprobs else None,
            cached_tokens=max(0, min(gen.prompt_cached_tokens, len(plan.context))))
        if matched_stop is not None:
            response["choices"][0]["matched_stop"] = matched_stop  # as SGLang reports it
        for mw in self.middlewares:
            response = mw.on_response(rec.trajectory_id, body, response)
            if not isinstance(response, dict):
                raise RouterError(500, f"middleware {type(mw).__name__}.on_response returned "
                                       f"{type(response).__name__}, expected a dict", type="server_error")
        message = response["choices"][0]["message"]
        if max_new > 0:
            seg = entry.tracker.commit(plan, gen.ids, gen.logprobs, gen.versions, message, gen.routed_experts)
            if constraint is not None and gen.ids:  # the trainer replays the grammar over these tokens
                start, end = seg.turns[-1]
                seg.constraints.append(GrammarSpan(start, end, constraint.grammar, self._stop_ids(entry)))
            versions = [v for v in gen.versions if v >= 0] or [-1]
            rec.turns.append(TurnInfo(segment=plan.segment_index, prompt_tokens=len(plan.context),
                                      new_prompt_tokens=len(plan.delta), completion_tokens=len(gen.ids),
                                      finish_reason=gen.finish_reason, weight_versions=(min(versions), max(versions)),
                                      engine=gen.engine, latency_s=time.perf_counter() - started,
                                      continuations=gen.continuations, new_segment=plan.new_segment,
                                      cached_tokens=gen.cached_tokens, speculative=gen.speculative,
                                      segment_reason=plan.reason if plan.new_segment else ""))
            self.stats["completion_tokens"] += len(gen.ids)
        rec.messages = plan.answered(message)
        rec.finish_reason = response["choices"][0]["finish_reason"]
        if streamer is not None:
            rest = streamer.finish(message)  # what the stream has not shown yet of the final message
            if rest:
                await stream.delta(rest)
        return response

    def _stop_ids(self, entry: LiveTrajectory) -> list[int]:
        """The stop tokens every turn of ``entry`` is sent (what a grammar allows where it may end)."""
        return list(dict.fromkeys([*self.renderer.turn_end_ids, *entry.sampling.stop_token_ids]))

    async def _generate(self, entry: LiveTrajectory, plan: TurnPlan, req: ChatRequest, max_new: int,
                        on_tokens: Callable[[list[int]], Awaitable[None]] | None = None,
                        constraint: TurnConstraint | None = None) -> Generation:
        """Generate one turn, resuming after engine aborts (weight updates) up to a limit.

        With ``on_tokens`` the engine streams, and ``on_tokens`` gets all tokens of the turn so
        far after every engine update. A ``constraint`` is sent with every call, a resumed call
        saying how many of its prompt's tokens the turn generated under it already.
        """
        tid = entry.record.trajectory_id
        url = self.balancer.pick(tid)
        gen = Generation([], [], [], "length", engine=url, top_logprobs=[] if req.top_logprobs else None)
        turn = len(entry.record.turns)
        retries = 0
        while True:
            remaining = max_new - len(gen.ids)
            rid = f"{tid}-{entry.record.attempt}-{turn}-{gen.continuations}-{uuid.uuid4().hex[:8]}"
            params = engine_sampling(entry.sampling, req, turn, self.renderer.turn_end_ids, remaining)
            if constraint is not None:
                params.update(constraint.sampling_params(len(gen.ids)))
            call = (url, plan.context + gen.ids, params, rid, req.top_logprobs, self._image_data(entry, plan),
                    entry.priority)
            entry.in_flight[rid] = url
            self.balancer.acquire(url)
            self.stats["engine_calls"] += 1
            streamed: list[EngineOutput] = []  # a stream's last update, kept when the engine goes away
            try:
                if on_tokens is None:
                    out: EngineOutput = await self.engines.generate(*call)
                else:
                    out = await self._generate_streaming(call, gen.ids, on_tokens, streamed)
            except RouterError as exc:
                await asyncio.shield(self.engines.abort(url, rid))
                if not self._retry_elsewhere(exc, retries) or entry.aborted:
                    raise
                retries += 1
                # nothing of the failed call is recorded, except what a stream already showed the agent
                partial = streamed[-1] if streamed else None
                if partial is not None and partial.output_ids:
                    self._extend(gen, partial)
                    gen.continuations += 1
                if not await self.balancer.wait_until_up(self.limits.engine_wait_s):
                    raise
                url = self.balancer.pick(tid)
                gen.engine = url
                continue
            except BaseException:  # the client went away or the stream broke: free the engine
                await asyncio.shield(self.engines.abort(url, rid))
                raise
            finally:
                entry.in_flight.pop(rid, None)
                self.balancer.release(url)
            self._extend(gen, out)
            refuse_if_aborted(entry)
            if out.finish_reason != "abort":
                gen.finish_reason = "length" if out.finish_reason == "length" else "stop"
                return gen
            if len(gen.ids) >= max_new:
                gen.finish_reason = "length"
                return gen
            gen.continuations += 1
            if gen.continuations > self.limits.max_continuations:
                raise RouterError(503, f"engine {url} aborted the generation {gen.continuations} times",
                                  type="api_error", code="engine_aborted", retry=False)
            await asyncio.sleep(min(0.05 * gen.continuations, 1.0))
            url = self.balancer.pick(tid)

    def _retry_elsewhere(self, exc: RouterError, retries: int) -> bool:
        """Whether a turn whose engine call failed with ``exc`` is sent again: only when the
        engine may be gone (it could not be reached, or a load balancer in front of engines
        answered 5xx: ``exc.engine_url`` is set), within ``engine_retries``. The engine is marked
        down and the host told (``on_engine_lost``), which may replace it."""
        url = exc.engine_url
        if url is None or retries >= self.limits.engine_retries:
            return False
        self.balancer.mark_down(url)
        if self.on_engine_lost is not None:
            self.on_engine_lost(url)
        self.stats["engine_retries"] += 1
        return True

    @staticmethod
    def _extend(gen: Generation, out: EngineOutput) -> None:
        """Append one engine call's tokens, log-probs and versions to the turn."""
        if not gen.ids and gen.continuations == 0:
            gen.prompt_cached_tokens = out.cached_tokens
        gen.ids += out.output_ids
        gen.logprobs += out.logprobs
        gen.versions += out.weight_versions
        gen.cached_tokens += out.cached_tokens
        if out.speculative is not None:
            gen.speculative = {k: (gen.speculative or {}).get(k, 0) + v for k, v in out.speculative.items()}
        if out.routed_experts is not None:
            gen.routed_experts = out.routed_experts
        if gen.top_logprobs is not None:
            gen.top_logprobs += out.top_logprobs or [[] for _ in out.output_ids]

    async def _generate_streaming(self, call: tuple[Any, ...], before: list[int],
                                  on_tokens: Callable[[list[int]], Awaitable[None]],
                                  streamed: list[EngineOutput]) -> EngineOutput:
        """One streamed engine call; ``before`` are the turn's tokens from earlier (aborted) calls.
        ``streamed`` holds the last update the agent was shown (kept when the stream breaks)."""
        out: EngineOutput | None = None
        seen = 0
        async for out in self.engines.generate_stream(*call):
            if len(out.output_ids) > seen:
                streamed[:] = [out]
                seen = len(out.output_ids)
                await on_tokens(before + out.output_ids)
        assert out is not None  # generate_stream raises when nothing finished
        return out

    def _logprobs_body(self, gen: Generation) -> dict[str, Any]:
        """The chat-completions ``logprobs`` of the turn (the turn-end token left out)."""
        ids = gen.ids
        if ids and ids[-1] in self.renderer.turn_end_ids:
            ids = ids[:-1]
        content = []
        for i, tok in enumerate(ids):
            text = self.renderer.decode([tok])
            tops = []
            for lp, tid in (gen.top_logprobs[i] if gen.top_logprobs else []):
                t = self.renderer.decode([tid])
                tops.append({"token": t, "logprob": lp, "bytes": list(t.encode())})
            content.append({"token": text, "logprob": gen.logprobs[i], "bytes": list(text.encode()),
                            "top_logprobs": tops})
        return {"content": content, "refusal": None}
