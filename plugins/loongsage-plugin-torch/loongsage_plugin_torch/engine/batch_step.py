"""The steps of the embedded engine's batching loop: admit (prefill), decode, sample, retire.

:class:`BatchStepMixin` holds what one iteration of :class:`~.scheduler.Scheduler`'s loop does to
the batch, apart from the loop's threading and commands, so each reads on its own. Everything
here runs in the loop thread.

Admission takes waiting requests in priority order (SGLang's ``priority``: larger first, then
first come, first served). With ``strict_priority`` (the default) a request is not admitted while
a more urgent one is running: on a CPU every extra row lengthens each decode step, so the
requests a trainer is waiting for (an asynchronous run gives a group's priority by its deadline)
decode at the speed of their own batch, and the others start when they are done.

Admission shares work across requests: requests with identical token sequences in the same
admission round (the samples of one group) are prefilled once and the others copy the KV row;
a request whose tokens start with a sequence in the :class:`~.kv_cache.PrefixCache` (the prompt
of an earlier sample, the previous turn of the same conversation) copies that KV and prefills only
the rest. Prompts are prefilled packed together (no padding in the matrix products), and a prompt longer
than ``max_prefill_tokens`` in chunks.

With an unmerged LoRA adapter (``lora_mode = "unmerged"``) each forward tells the runner which
rows named the adapter, and the prefix cache and the identical-prompt sharing keep requests with
and without it apart (their KV differs).

Every generated token records the weight version of the model that produced it; a request that
stays across an in-place weight update therefore reports a list of versions.

With ``engine_args.speculative`` a decode step drafts tokens by prompt lookup and verifies them in
the same forward (:mod:`.speculative`): a request may then gain several tokens in one step.

A constrained request (``json_schema``, ``regex``, ``ebnf``) samples from its logits masked to the
tokens its grammar allows, one token per step (it is never drafted for).
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .kv_cache import PrefixCache
from .prompt_logprobs import PromptScorer
from .request_state import EngineStats, GenerationResult, RequestState, finish_json
from .sampling import sample
from .settings import EngineSettings
from .speculative import PromptLookup, verify_drafts

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .runner import ModelRunner


class BatchStepMixin:
    """Admission, prefill, decode and retirement of the scheduler's requests; the attributes below
    are set by :class:`~.scheduler.Scheduler`'s ``__init__``."""

    _torch: Any
    runner: "ModelRunner"
    settings: EngineSettings
    prefix_cache: PrefixCache
    waiting: collections.deque[RequestState]
    running: list[RequestState]
    version: int
    stats: EngineStats
    decode: Callable[[list[int]], str] | None
    drafter: PromptLookup | None
    token_grammar: Any

    def _admit(self) -> None:
        """Move waiting requests into free slots (one batched prefill that shares work, see the
        module docstring) and sample their first token."""
        torch = self._torch
        t0 = time.perf_counter()
        budget = self.settings.max_prefill_tokens
        free = self.settings.max_batch_size - len(self.running)
        reps: list[tuple[RequestState, Any, int]] = []  # (request, prefix entry, cached length)
        dups: list[tuple[RequestState, RequestState]] = []  # (request, the identical request prefilled for it)
        by_tokens: dict[tuple[Any, ...], RequestState] = {}  # (namespace, *tokens) -> request
        new_tokens = 0
        # the queue is in priority order (see Scheduler.submit); with strict priority a request
        # waits while a more urgent one runs, so the urgent ones decode in a batch of their own
        urgent = max((r.item.priority for r in self.running), default=None) \
            if self.settings.strict_priority else None
        while self.waiting and free > 0:
            req = self.waiting[0]
            if urgent is not None and req.item.priority < urgent:
                for held in self.waiting:
                    if held.item.priority < urgent and not held.held:
                        held.held = True
                        self.stats.priority_held_requests += 1
                break
            if req.num_output >= req.item.params.max_new_tokens:  # max_new_tokens == 0
                self.waiting.popleft()
                req.finish = finish_json("length", length=req.item.params.max_new_tokens)
                self._deliver(req)
                continue
            namespace = self._kv_namespace(req)
            key = (namespace, *self._cache_tokens(req))
            twin = None if req.scores_prompt else by_tokens.get(key)  # a scored prompt runs its own prefill
            if twin is not None:
                dups.append((req, twin))
            else:
                # positions from logprob_start_len - 1 on must run: their logits score the prompt
                limit = min(len(req.tokens) - 1, max(req.item.logprob_start_len - 1, 0)) if req.scores_prompt \
                    else len(req.tokens) - 1
                entry, cached = self.prefix_cache.lookup(self._cache_tokens(req), self.version, limit, namespace)
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
                self.runner.cache.write(req.slot, entry.keys, entry.values, cached, entry.routes)
            req.kv_len = req.cached_tokens = cached
        logits = self._prefill([r for r, _, _ in reps])
        for req, _, _ in reps:
            req.kv_len = len(req.tokens)
            self.stats.prefill_tokens += len(req.tokens) - req.cached_tokens
            self.stats.cached_tokens += req.cached_tokens
            if self.prefix_cache.capacity_tokens:
                self._remember_prefix(req, self._cache_tokens(req))
        row_of = {id(r): i for i, (r, _, _) in enumerate(reps)}
        for req, twin in dups:
            self.runner.cache.move(twin.slot, req.slot, twin.kv_len)
            req.kv_len = req.cached_tokens = twin.kv_len
            self.stats.cached_tokens += twin.kv_len
        rows = torch.tensor([row_of[id(r)] for r, _, _ in reps] + [row_of[id(t)] for _, t in dups])
        self._sample_and_append(joined, logits[rows])
        self.stats.prefill_seconds += time.perf_counter() - t0
        self._retire()

    def _prefill(self, reqs: list[RequestState]) -> "torch.Tensor":
        """Run the new tokens of ``reqs`` (slots assigned, contiguous); logits ``[len(reqs), V]``.

        Rows are packed up to ``max_prefill_tokens`` new tokens per forward; a row longer than
        that, or one whose prompt is scored (``logprob_start_len``), is prefilled alone, in chunks.
        """
        torch = self._torch
        budget = self.settings.max_prefill_tokens
        out: list[Any] = []
        i = 0
        while i < len(reqs):
            req = reqs[i]
            if len(req.tokens) - req.kv_len > budget or req.scores_prompt:  # alone, in chunks
                scorer = PromptScorer(req) if req.scores_prompt else None
                start = req.kv_len
                while start < len(req.tokens):
                    end = min(len(req.tokens), start + budget)
                    logits = self.runner.forward(torch.tensor(req.tokens[start:end]), req.slot,
                                                 torch.tensor([start]), torch.tensor([end - start]),
                                                 all_logits=scorer is not None,
                                                 adapter_rows=self._adapter_rows([req]), vision=self._vision([req]))
                    if scorer is not None:
                        scorer.add(logits, start)
                        logits = logits[-1:]
                    start = end
                if scorer is not None:
                    scorer.finish()
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
            out.append(self.runner.forward(torch.tensor(flat), group[0].slot, starts, counts,
                                           adapter_rows=self._adapter_rows(group), vision=self._vision(group)))
        return torch.cat(out, 0)

    def _decode(self) -> None:
        """One decode step: the next token of every running request (with speculative decoding,
        possibly several: :meth:`_speculative_decode`)."""
        torch = self._torch
        t0 = time.perf_counter()
        reqs = self.running
        drafts = self._drafts(reqs) if self.drafter is not None else None
        if drafts is not None and any(drafts):
            self._speculative_decode(reqs, drafts)
        else:
            ids = torch.tensor([r.tokens[-1] for r in reqs])
            starts = torch.tensor([r.kv_len for r in reqs])
            logits = self.runner.forward(ids, 0, starts, torch.ones(len(reqs), dtype=torch.long),
                                         adapter_rows=self._adapter_rows(reqs), vision=self._vision(reqs))
            for req in reqs:
                req.kv_len += 1
            if drafts is not None:
                for req in reqs:
                    req.speculation.verify_forwards += 1
                    req.speculation.emitted_tokens += 1
            self._sample_and_append(reqs, logits)
        self.stats.decode_steps += 1
        self.stats.decode_seconds += time.perf_counter() - t0
        self._retire()

    def _drafts(self, reqs: Sequence[RequestState]) -> list[list[int]]:
        """Each request's prompt-lookup draft, no longer than its token and context budget leaves
        room for (the step emits the accepted drafts and one more token)."""
        assert self.drafter is not None
        out: list[list[int]] = []
        for req in reqs:
            room = min(req.item.params.max_new_tokens - req.num_output,
                       self.settings.max_context_length - len(req.tokens)) - 1
            spec = req.speculation
            if req.grammar is not None:  # a constrained request samples one masked token per step
                out.append([])
                continue
            if spec.skip > 0:
                spec.skip -= 1
                out.append([])
                continue
            draft, spec.indexed = self.drafter.propose(req.tokens, spec.index, spec.indexed, room)
            out.append(draft)
        return out

    def _speculative_decode(self, reqs: list[RequestState], drafts: list[list[int]]) -> None:
        """One forward over every request's last token and its drafts (KV written for all of
        them), then per request the drafts accepted by :func:`~.speculative.verify_drafts` and one
        more token; the KV of rejected drafts stays behind the request's length, masked and later
        overwritten. Requests without a draft sample as in a plain decode step."""
        torch = self._torch
        counts = [1 + len(d) for d in drafts]
        flat = [t for req, d in zip(reqs, drafts) for t in (req.tokens[-1], *d)]
        logits = self.runner.forward(torch.tensor(flat), 0, torch.tensor([r.kv_len for r in reqs]),
                                     torch.tensor(counts), all_logits=True, adapter_rows=self._adapter_rows(reqs),
                                     vision=self._vision(reqs))
        ends = torch.tensor(counts).cumsum(0)
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:
            rows = (ends - 1)[plain]
            for i in plain:
                reqs[i].kv_len += 1
                reqs[i].speculation.verify_forwards += 1
                reqs[i].speculation.emitted_tokens += 1
            self._sample_and_append([reqs[i] for i in plain], logits[rows])
        for i, (req, draft) in enumerate(zip(reqs, drafts)):
            if not draft:
                continue
            first = int(ends[i]) - counts[i]
            rows = logits[first: first + counts[i]]
            emitted = verify_drafts(rows, draft, req.item.params, req.generator)
            spec = req.speculation
            spec.verify_forwards += 1
            spec.record(len(draft), len(emitted) - 1)
            self.stats.spec_draft_tokens += len(draft)
            self.stats.spec_accepted_tokens += len(emitted) - 1
            top = self._top_logprobs(req, rows)
            logprobs = torch.log_softmax(rows[: len(emitted)], dim=-1)
            for j, tok in enumerate(emitted):
                spec.emitted_tokens += 1
                self._append_token(req, tok, float(logprobs[j, tok]), top[j] if top else None)
                self.stats.generated_tokens += 1
                if req.finish is not None:
                    break
            req.kv_len = len(req.tokens) - 1  # the last token and the accepted drafts are in the KV

    def _top_logprobs(self, req: RequestState, logits: "torch.Tensor") -> list[list[tuple[float, int]]] | None:
        """SGLang's ``top_logprobs_num`` most likely tokens under raw ``logits`` rows of ``req``."""
        n = req.item.top_logprobs_num
        if not n:
            return None
        vals, ids = self._torch.log_softmax(logits.float(), dim=-1).topk(n, dim=-1)
        return [list(zip(v, t)) for v, t in zip(vals.tolist(), ids.tolist())]

    def _remember_prefix(self, req: RequestState, tokens: list[int]) -> None:
        """Copy the KV (and routing) of ``req``'s first ``len(tokens)`` positions into the prefix cache."""
        keys, values = self.runner.cache.read(req.slot, len(tokens))
        self.prefix_cache.insert(tokens, keys, values, self.version, self._kv_namespace(req),
                                 routes=self.runner.cache.read_routes(req.slot, len(tokens)) or None)

    def _kv_namespace(self, req: RequestState) -> str | None:
        """The adapter whose KV ``req`` computes: its ``lora_path`` when adapters apply per
        request, else ``None`` (a merged adapter is in every request's weights)."""
        return req.item.lora_path if self.settings.lora_mode == "unmerged" else None

    @staticmethod
    def _cache_tokens(req: RequestState) -> list[int]:
        """``req``'s tokens as the prefix cache keys them: an image's placeholder tokens stand for
        that image (:attr:`~.vision.VisionInputs.key_tokens`), since their KV is the image's."""
        vision = req.item.vision
        if vision is None:
            return req.tokens
        return vision.key_tokens + req.tokens[len(vision.key_tokens):]

    def _vision(self, reqs: Sequence[RequestState]) -> "list[Any] | None":
        """Each request's images for the runner, the vision encoder run on those not yet encoded
        (``None`` when no request has images)."""
        if not any(r.item.vision is not None for r in reqs):
            return None
        for req in reqs:
            if req.item.vision is not None:
                req.item.vision.ensure_embeddings(self.runner.model)
        return [r.item.vision for r in reqs]

    def _adapter_rows(self, reqs: Sequence[RequestState]) -> "torch.Tensor | None":
        """Which of ``reqs`` the runner's unmerged adapter applies to (``None``: it holds none)."""
        if not self.runner.has_unmerged_adapter:
            return None
        return self._torch.tensor([r.item.lora_path is not None for r in reqs])

    def _sample_and_append(self, reqs: Sequence[RequestState], logits: "torch.Tensor") -> None:
        """Sample one token per request from ``logits``, append it with its log-prob and weight
        version, and set the finish reason of requests that stop (stop token or string, length).

        A constrained request's row is masked to the tokens its grammar allows first, so its token
        and its log-prob are those of the restricted distribution (what a trainer replaying the
        grammar scores, :mod:`loongsage_core.backend_api.grammar`)."""
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            from loongsage_core.backend_api.grammar import mask_logits

            logits = logits.clone()
            for i in constrained:
                allowed = self.token_grammar.allowed(reqs[i].grammar, reqs[i].grammar_stops)
                logits[i] = mask_logits(logits[i], allowed)
        tokens, logprobs = sample(logits, [r.item.params for r in reqs], [r.generator for r in reqs])
        top_k = max(r.item.top_logprobs_num for r in reqs)
        top_vals = top_ids = None
        if top_k:  # SGLang's top_logprobs_num: the most likely tokens under the raw logits
            top_vals, top_ids = self._torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for i, (req, tok, lp) in enumerate(zip(reqs, tokens.tolist(), logprobs.tolist())):
            n = req.item.top_logprobs_num
            top = None
            if n and top_vals is not None and top_ids is not None:
                top = list(zip(top_vals[i][:n], top_ids[i][:n]))
            self._append_token(req, tok, lp, top)
        self.stats.generated_tokens += len(reqs)

    def _append_token(self, req: RequestState, tok: int, lp: float, top: list[tuple[float, int]] | None) -> None:
        """Append one token with its log-prob, weight version (and top log-probs) to ``req`` and set
        its finish reason when it stops (stop token or string, length)."""
        max_context = self.settings.max_context_length
        if req.grammar is not None:
            self.token_grammar.advance(req.grammar, tok, req.grammar_stops)
        req.tokens.append(tok)
        req.logprobs.append(lp)
        req.versions.append(self.version)
        if top is not None:
            req.top_logprobs.append(top)
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

    def _stop_string(self, req: RequestState) -> str | None:
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
            if req.item.return_routed_experts:  # the experts of every position the model ran
                req.routed_experts = self.runner.routed_experts(req.slot, req.kv_len)
            if self.prefix_cache.capacity_tokens and req.kv_len >= self.prefix_cache.block:
                self._remember_prefix(req, self._cache_tokens(req)[: req.kv_len])
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

    def _deliver(self, req: RequestState) -> None:
        """Resolve a finished request's future with its result (once) and count it."""
        if req.future.done():
            return
        self.stats.finished_requests += 1
        if req.finish and req.finish.get("type") == "abort":
            self.stats.aborted_requests += 1
        req.future.set_result(self._result(req, req.finish or finish_json("abort", message="no finish reason")))

    def _result(self, req: RequestState, finish: dict[str, Any]) -> GenerationResult:
        """The :class:`~.request_state.GenerationResult` of ``req`` so far, finished by ``finish``."""
        return GenerationResult(
            rid=req.item.rid, prompt_tokens=req.prompt_len, output_ids=req.tokens[req.prompt_len:],
            logprobs=list(req.logprobs), weight_versions=list(req.versions),
            weight_version=req.versions[-1] if req.versions else self.version,
            finish_reason=dict(finish),
            cached_tokens=req.cached_tokens, latency_s=time.monotonic() - req.created,
            top_logprobs=[list(row) for row in req.top_logprobs] if req.item.top_logprobs_num else None,
            routed_experts=req.routed_experts,
            speculative=req.speculation.as_dict() if self.drafter is not None else None,
            prompt_logprobs=req.prompt_logprobs, prompt_top_logprobs=req.prompt_top_logprobs)
