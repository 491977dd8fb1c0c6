"""The forward passes of a torch train worker: per-token log-probs and entropies of a batch.

:class:`ForwardPassMixin` holds what :class:`~.worker.TorchTrainWorker` computes without
training: moving micro-batches to the device, the padded or packed (:mod:`.packing`) token
outputs, :meth:`~ForwardPassMixin.forward` in forward micro-batches, and the LoRA run's KL
reference (the base model, the adapter disabled). It is a mixin rather than a helper object so
that the critic (:class:`~.critic.TorchCriticWorker`) reuses the chunking and overrides the rest
exactly as it did when everything lived in one class.

A mixture-of-experts policy trained with ``[algorithm] router_replay`` replays the engine's
routing in every forward (:mod:`.router_replay`): the batch's ``routed_experts`` are laid out as
the forward's tokens (padded or packed) and handed to the routers' hooks; the old-log-prob pass
also scores the rows without replay and reports both passes' router agreement.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from loongsage_hookspecs import Batch

from .grammar_replay import GrammarReplay, padded_positions
from .logits import logprobs_and_entropy, next_token_logits
from .packing import PackedRows, canonical_order, packed_token_outputs, plan_micro_batches, prompt_groups
from .router_replay import RouterReplay
from .vision_inputs import VisionBatchInputs


class ForwardPassMixin:
    """Forward passes of a worker; the attributes below are set by the worker's ``__init__``."""

    model: Any
    peft_model: Any
    device: torch.device
    compute_dtype: torch.dtype
    fp32_lm_head: bool
    forward_micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    share_prompts: bool
    #: tokens of the micro-batches since the last reset: (prompt tokens shared, not run; all given)
    prompt_tokens: tuple[int, int]
    _offloaded: bool
    #: Router Replay of a mixture-of-experts policy (``[algorithm] router_replay``), else ``None``
    router_replay: RouterReplay | None = None
    #: whether the policy's scoring pass also runs without replay (``[algorithm] router_replay_compare``)
    router_replay_compare: bool = False
    #: (replay, measure agreement) of the forwards that follow, see :meth:`_routing`
    _route_mode: tuple[bool, bool] = (True, False)
    #: the last forward's flat tokens ``[N]`` back in the micro-batch's ``[b, T]`` layout
    _route_layout: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: scores constrained turns under their grammars (:mod:`.grammar_replay`), set by the worker
    grammar_replay: GrammarReplay | None = None
    #: a vision-language policy's image inputs (:mod:`.vision_inputs`), else ``None``
    vision_inputs: VisionBatchInputs | None = None

    def _to_device(self, micro: Batch) -> Batch:
        return Batch(tensors={k: v.to(self.device, non_blocking=True) for k, v in micro.tensors.items()},
                     meta=micro.meta)

    def _token_outputs(self, micro: Batch, *, entropy_grad: bool, keep_logits: bool = False,
                       ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]":
        """Log-probs, entropies ``[b, T]`` and (optionally) next-token logits of one micro-batch.

        Only the tokens of the micro-batch's ``loss_mask`` (the responses) are scored, unless the
        logits are kept (every position's, for a loss that reads them) or there is no loss mask:
        the output projection and the log-softmax skip the prompts (:func:`.logits.next_token_logits`).
        Every other position holds 0; columns past the micro-batch's longest row are not computed.
        """
        ids = micro["input_ids"]
        attention = micro.get("attention_mask")
        if attention is None:
            attention = torch.ones_like(ids)
        loss_mask = micro.get("loss_mask")
        scored = None if keep_logits or loss_mask is None else loss_mask > 0
        routes = micro.get("routed_experts") if self.router_replay is not None else None
        if routes is None:
            self._clear_routes()  # no record: the routers route on their own
        # padding-free micro-batches and shared prompts (.packing); rows that are already packed
        # (SFT) keep their own positions
        images = micro.meta.get("images")
        with_images = self.vision_inputs is not None and images is not None and any(images)
        packable = not keep_logits and "position_ids" not in micro and bool(attention.any()) and not with_images
        one_row = bool(self.max_tokens_per_micro_batch)
        constrain = self.grammar_replay.filter_for(micro.meta, ids) if self.grammar_replay is not None else None
        groups = self._prompt_groups(ids, attention, scored, one_row=one_row, routes=routes) if packable else None
        self._count_prompt_tokens(attention, groups)
        if packable:
            if one_row or groups is not None:
                packed_logprobs, packed_entropy = packed_token_outputs(
                    self.model, ids, attention, compute_dtype=self.compute_dtype, fp32_lm_head=self.fp32_lm_head,
                    entropy_grad=entropy_grad, scored=scored, groups=groups, one_row=one_row,
                    on_packed=None if routes is None else lambda packed: self._route_packed(packed, routes),
                    logit_filter=constrain)
                return packed_logprobs, packed_entropy, None
        width = int(attention.sum(dim=1).max()) if ids.shape[0] else 0
        full_width = ids.shape[1]
        width = max(width, 1)
        if routes is not None:
            self._set_routes(routes[:, :width], lambda flat: torch.nn.functional.pad(
                flat.view(ids.shape[0], width), (0, full_width - width), value=-1.0))
        if scored is not None:
            scored = scored[:, :width] & (attention[:, :width] > 0)
        positions = micro.get("position_ids")  # packed rows (SFT): attention stays within each sequence
        vision = None
        if with_images:  # the record's images, as the engine saw them (.vision_inputs)
            assert self.vision_inputs is not None and images is not None
            vision = self.vision_inputs.kwargs(ids[:, :width], attention[:, :width], images)
        logits = next_token_logits(self.model, ids[:, :width], attention[:, :width],
                                   compute_dtype=self.compute_dtype, fp32_lm_head=self.fp32_lm_head,
                                   position_ids=None if positions is None else positions[:, :width], scored=scored,
                                   vision=vision)
        if constrain is not None:  # constrained turns: the engine's allowed sets, replayed
            rows, cols = padded_positions(scored, (ids.shape[0], width))
            logits = constrain(logits.reshape(-1, logits.shape[-1]), rows, cols).view(logits.shape)
        logprobs, entropy = logprobs_and_entropy(logits, ids[:, :width], entropy_grad=entropy_grad, scored=scored)
        assert entropy is not None
        real = attention[:, :width] > 0
        logprobs = torch.where(real, logprobs, torch.zeros_like(logprobs))
        entropy = torch.where(real, entropy, torch.zeros_like(entropy))
        if width < full_width:
            pad = (0, full_width - width)
            logprobs = torch.nn.functional.pad(logprobs, pad)
            entropy = torch.nn.functional.pad(entropy, pad)
            if keep_logits:
                logits = torch.nn.functional.pad(logits, (0, 0, 0, full_width - width))
        return logprobs, entropy, logits if keep_logits else None

    def _route_packed(self, packed: PackedRows, routes: torch.Tensor) -> None:
        """Hand the routers the recorded experts of a packed forward's tokens."""
        self._set_routes(packed.pack(routes, -1), lambda flat: packed.unpack(flat.view(packed.input_ids.shape), -1.0))

    def _set_routes(self, routes: torch.Tensor, layout: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The recorded experts ``[..., width]`` of the next forward's tokens (laid out as its
        ``input_ids``), in the current :meth:`_routing` mode; ``layout`` maps the forward's flat
        tokens back to the micro-batch's rows."""
        assert self.router_replay is not None
        replay, measure = self._route_mode
        self.router_replay.set_routes(routes, replay=replay, measure=measure)
        self._route_layout = layout

    @contextlib.contextmanager
    def _routing(self, *, replay: bool, measure: bool) -> Iterator[None]:
        """Forwards inside replay the recorded experts (or, ``replay=False``, route on their own)
        and measure the router agreement when asked; the routes are dropped on the way out."""
        self._route_mode = (replay, measure)
        try:
            yield
        finally:
            self._route_mode = (True, False)
            self._clear_routes()

    def _clear_routes(self) -> None:
        if self.router_replay is not None:
            self.router_replay.clear()
        self._route_layout = None

    def _router_agreement(self, like: torch.Tensor) -> torch.Tensor:
        """The last measured forward's per-token router agreement ``[b, T]`` (-1: not measured)."""
        agreement = self.router_replay.agreement() if self.router_replay is not None else None
        if agreement is None or self._route_layout is None:  # the micro-batch had no routes
            return torch.full_like(like, -1.0)
        return self._route_layout(agreement).to(like.dtype)

    def _model_config(self) -> Any:
        """The transformers config of the model this worker runs (``None`` when it has none)."""
        return getattr(self.model, "config", None)

    def _count_prompt_tokens(self, attention: torch.Tensor, groups: list[list[tuple[int, int]]] | None) -> None:
        """Add a micro-batch's tokens to :attr:`prompt_tokens`: (not run, shared; given)."""
        shared = sum(s for group in groups or () for _, s in group)
        self.prompt_tokens = (self.prompt_tokens[0] + shared, self.prompt_tokens[1] + int((attention > 0).sum()))

    def _prompt_groups(self, ids: torch.Tensor, attention: torch.Tensor, scored: torch.Tensor | None, *,
                       one_row: bool, routes: torch.Tensor | None = None) -> list[list[tuple[int, int]]] | None:
        """The micro-batch's rows grouped by shared prompt (:func:`.packing.prompt_groups`), or
        ``None`` when no row shares one: ``[train] backend_args.share_prompts`` off, nothing scored
        (every token is wanted, the prompt's too), or a ``flash_attention_2`` model, whose varlen
        kernel takes no mask to share a prompt through."""
        if not self.share_prompts or scored is None:
            return None
        config = self._model_config()
        if "flash" in str(getattr(config, "_attn_implementation", None) or ""):
            return None
        groups = prompt_groups(ids, (attention > 0).sum(dim=1).tolist(), scored & (attention > 0),
                               None if one_row else getattr(config, "hidden_size", None), routes=routes)
        return groups if any(shared for group in groups for _, shared in group) else None

    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` ``[B, T]`` (float32, on the CPU, no gradient) of
        the tokens in the batch's ``loss_mask`` (0 elsewhere; every token without one).

        With Router Replay and ``[algorithm] router_replay_compare`` (a batch with
        ``routed_experts``) also ``router_agreement`` (per token, the share of its
        mixture-of-experts layers whose experts in the forward are the engine's: 1 with replay
        wherever there is a record; -1 where not measured) and, from a second pass routing on its
        own, ``logprobs_no_replay`` and ``router_agreement_no_replay`` (the trainer's own routing
        against the engine's)."""
        return self._scores(batch, compare=self.router_replay_compare and "routed_experts" in batch)

    def _scores(self, batch: Batch, *, compare: bool) -> dict[str, torch.Tensor]:
        def outputs(micro: Batch) -> dict[str, torch.Tensor]:
            with self._routing(replay=True, measure=compare):
                lp, ent, _ = self._token_outputs(micro, entropy_grad=False)
                out = {"logprobs": lp, "entropy": ent}
                if compare:
                    out["router_agreement"] = self._router_agreement(lp)
            if compare:
                with self._routing(replay=False, measure=True):
                    out["logprobs_no_replay"], _, _ = self._token_outputs(micro, entropy_grad=False)
                    out["router_agreement_no_replay"] = self._router_agreement(lp)
            return out

        keys = ("logprobs", "entropy") + (
            ("router_agreement", "logprobs_no_replay", "router_agreement_no_replay") if compare else ())
        return self._forward_chunks(batch, keys, outputs)

    @property
    def serves_reference(self) -> bool:
        """Whether this worker scores the KL reference itself (:meth:`reference_forward`): a LoRA
        policy's reference is its base model, the adapter disabled, so no reference worker is built."""
        return self.peft_model is not None

    @torch.no_grad()
    def reference_forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """:meth:`forward` of the base model, the LoRA adapter disabled (the KL reference of a
        LoRA run; the same weights, no second copy)."""
        if self.peft_model is None:
            raise RuntimeError("TorchTrainWorker.reference_forward: the policy has no LoRA adapter to disable; "
                               "the reference is a worker of its own (role 'reference')")
        with self.peft_model.disable_adapter():
            return self._scores(batch, compare=False)

    def _forward_chunks(self, batch: Batch, keys: tuple[str, ...],
                        outputs: Callable[[Batch], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run ``outputs`` over ``batch`` in forward micro-batches, in eval mode, and concatenate
        its ``[b, T]`` tensors on the CPU (``[0, T]`` zeros for an empty batch)."""
        name = type(self).__name__
        if "input_ids" not in batch:
            raise KeyError(f"{name}.forward: the batch has no 'input_ids' tensor")
        if self._offloaded:
            raise RuntimeError(f"{name}.forward: the worker is offloaded; call onload() first")
        was_training = self.model.training
        self.model.eval()
        plan = self._micro_batch_rows(batch, self.forward_micro_batch_size)
        try:
            parts = [outputs(self._to_device(batch.select(rows))) for rows in plan]
        finally:
            self.model.train(was_training)
        if not parts:
            return {k: torch.zeros(0, batch["input_ids"].shape[1]) for k in keys}
        out = {k: torch.cat([p[k].cpu() for p in parts]) for k in keys}
        order = [r for rows in plan for r in rows]
        if order != list(range(len(order))):  # packed micro-batches: back to the batch's row order
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.as_tensor(order)] = torch.arange(len(order))
            out = {k: v.index_select(0, inverse) for k, v in out.items()}
        return out

    def _micro_batch_rows(self, batch: Batch, rows_per_micro: int) -> list[list[int]]:
        """Row indices of each micro-batch: packed by ``[train] max_tokens_per_micro_batch`` when
        it is set (:mod:`.packing`), else at most ``rows_per_micro`` rows each.

        When some rows share a prompt the rows are taken in :func:`.packing.canonical_order`
        (ties broken by the batch's ``trajectory_id`` and ``segment``): a prompt's rows side by
        side, a micro-batch holding whole groups where they fit, and the plan of a set of rows the
        same whatever order they come in, so the old-log-prob pass over the step's rows and the
        training pass over the same rows, shuffled into a mini-batch, compute bit-identical
        log-probs."""
        n = len(batch)
        order, groups = list(range(n)), None
        if self.share_prompts and "loss_mask" in batch and "attention_mask" in batch:
            meta = batch.meta or {}
            names = (list(zip(meta["trajectory_id"], meta.get("segment", [0] * n))) if "trajectory_id" in meta
                     else meta.get("sample_id"))
            names = names if names is not None and len(names) == n else None
            canonical = canonical_order(batch["input_ids"], batch["attention_mask"].sum(dim=1).tolist(), names)
            groups = self._prompt_groups(batch["input_ids"][canonical], batch["attention_mask"][canonical],
                                         batch["loss_mask"][canonical] > 0, one_row=True)
            if groups is not None:  # some rows share a prompt: take them side by side
                order = canonical
        if self.max_tokens_per_micro_batch and "attention_mask" in batch:
            lengths = batch["attention_mask"][order].sum(dim=1).tolist()
            plan = plan_micro_batches(lengths, self.max_tokens_per_micro_batch, groups)
        elif groups is not None:  # whole groups into micro-batches of at most rows_per_micro rows
            plan = plan_micro_batches([1] * n, rows_per_micro, [[(r, 0) for r, _ in group] for group in groups])
        else:
            return [order[s:s + rows_per_micro] for s in range(0, n, rows_per_micro)]
        return [[order[i] for i in rows] for rows in plan]
