"""Router Replay (R3) on Megatron-Core: a mixture-of-experts policy routes each token to the experts
the rollout engine chose.

With ``[algorithm] router_replay = true`` the engine records, per token, the top-k experts of every
decoder layer (the batch's ``routed_experts``, int ``[B, T, num_hidden_layers * top_k]``, -1 where
there is no record: padding, the last generated token, dense layers), and every forward of the
policy (the scoring pass of :meth:`~.worker.MegatronTrainWorker.forward`, the training forwards of
:meth:`~.worker.MegatronTrainWorker.train_mini_batch`; a reference worker built with the same
job replays as well, as the torch backend's does) uses them. The worker checks that the model has
MoE layers before it builds anything and keeps the routers on Megatron-Core's unfused top-k
(``moe_router_fusion = False``: Transformer Engine's fused kernel never asks the replay object).

How it maps onto Megatron-Core 0.16.1: its ``TopKRouter`` asks its ``router_replay`` object
(``megatron.core.transformer.moe.router_replay.RouterReplay``, created there when
``moe_enable_routing_replay`` is set) for the top-k of the scores it routes on, through
``RouterReplay.get_replay_topk`` inside ``topk_routing_with_score_function``. Upstream, with the
action ``REPLAY_FORWARD`` it returns the target indices set by ``set_target_indices`` and their
scores gathered from the current router output, from which Megatron computes the gating weights as
usual: under ``moe_router_pre_softmax = False`` (Hugging Face's ``norm_topk_prob = true``) the
softmax of the gathered logits, which is the softmax over all experts at those ids renormalised
over the top-k; under ``moe_router_pre_softmax = True`` the plain softmax probabilities at those
ids. Either way the weights stay a differentiable function of the router's logits (the router
keeps learning), and the load-balancing loss, which Megatron computes from the logits with its
own top-k, is unchanged. This module keeps that mechanism and its actions and adds what it cannot
express, in :class:`LayerReplay`, a subclass installed as each router's ``router_replay``:

* per-token fallback: upstream replays every token; a token without a record in a layer (any of
  its k ids < 0) keeps the router's own top-k there;
* agreement: the share of a token's MoE layers whose experts used in the forward equal the
  record (as a set), measured under ``REPLAY_FORWARD`` and under ``RECORD`` (the router's own
  routing, the comparison pass without replay);
* per-worker instances: upstream registers every instance in one process-wide list
  (``RouterReplay.global_router_replay_instances``) that its static setters walk in creation
  order; a reference model or a teacher in the same process must not take the policy's routes,
  so each worker addresses its own routers (:class:`MegatronRouterReplay`) and its instances
  leave that list.

Token order: the worker's micro-batches are padded ``[rows, width]`` (``forward_backward.StageInputs``:
right padding, a causal mask, no packing), and Megatron-Core runs them sequence-first, so a
router sees ``width * rows`` tokens in ``[s, b]`` order. :meth:`MegatronRouterReplay.begin` lays
each micro-batch's records out that way (padding positions and rows get -1) and hands each router
the ids of its own Hugging Face layer: ``TopKRouter.layer_number - 1``, which is global under
pipeline parallelism (each stage holds its own layers). Under expert parallelism a router routes
its rank's own tokens before they are dispatched and sees global expert ids, so nothing changes.
Under sequence parallelism (``tp > 1`` for a MoE model) each tensor-parallel rank's routers see
its share of the sequence, positions ``[r * width / tp, (r + 1) * width / tp)`` of every row
(Megatron-Core scatters ``[s, b, h]`` along ``s``; the backend pads widths to a multiple of
``tp``): :class:`MegatronRouterReplay` hands them those positions' records and counts agreement
there, and the worker sums the counts over the tensor-parallel group. The backend runs no context
parallelism and no packed (THD) sequences; a router that sees another number of tokens than the
records is a clear error, never a silent misalignment.

Activation recomputation (``backend_args.recompute_granularity = "full"``, or a selective
recomputation of the MoE layers) runs a layer's router again in the backward pass. Upstream's
action for that is ``REPLAY_BACKWARD``: each ``set_target_indices`` queues the ids, and a router
whose action is set to it pops them in order. Megatron-Core never sets that action itself (a
training loop must switch every router to it around the backward passes), and the per-token
fallback means the ids a forward used are not the records alone. :class:`LayerReplay` therefore
queues, in every training forward (its router in train mode, inside :meth:`MegatronRouterReplay.routing`),
the ids the forward used, and a router run inside the autograd engine's backward pass (the
recomputation) pops the oldest and gathers its gating scores from them, as ``REPLAY_BACKWARD``
does. Megatron-Core's schedules run the backward passes of a layer's micro-batches in the order
of their forwards (no pipelining, 1F1B, interleaved 1F1B alike), so the queue hands each
recomputation the experts of its own forward, replayed or routed on its own.

Virtual pipeline stages (``backend_args.vpp``): each model chunk's forward of a micro-batch is
one :meth:`~MegatronRouterReplay.begin` / :meth:`~MegatronRouterReplay.end` pair; the agreement
counts of a micro-batch's chunks are added up.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

if TYPE_CHECKING:  # pragma: no cover
    from .forward_backward import StageInputs


class LayerReplay(RouterReplay):
    """Megatron-Core's ``RouterReplay`` of one router, with per-token fallback and agreement.

    ``REPLAY_FORWARD``: the target ids (``set_target_indices``, ``[tokens, top_k]``) where a token
    has a record, the router's own top-k where it has none; ``RECORD``: the router's own top-k
    (recorded, as upstream does). In both, ``on_routed(ids, recorded, has)`` (when set) sees the
    ids used, the record and which tokens have one. No action: the router's own top-k, untouched.

    With ``keep_for_backward`` (activation recomputation reruns this router), every forward of
    the ``router`` in train mode queues the ids it used, and a run inside the backward pass (the
    recomputation) pops the oldest and routes on them (upstream's ``REPLAY_BACKWARD``, see the
    module docstring).
    """

    def __init__(self, layer: int, router: Any = None) -> None:
        super().__init__()
        # not in upstream's process-wide list: this instance belongs to one worker's model
        _unregister(self)
        self.layer = layer
        self.router = router
        self.on_routed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self.keep_for_backward = False
        self.forward_ids: list[torch.Tensor] = []  # the ids of training forwards not yet recomputed

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.forward_ids and in_backward_pass():  # REPLAY_BACKWARD: the recomputed forward's experts
            ids = self.forward_ids.pop(0).to(scores.device)
            return scores.gather(1, ids), ids
        probs, ids = self._forward_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if self.keep_for_backward and self.router is not None and self.router.training:
            self.forward_ids.append(ids.detach())
        return probs, ids

    def _forward_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None,
                      default_compute_topk: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k of a forward pass under the current action (see the class docstring)."""
        action = self.router_replay_action
        recorded = self.target_topk_idx
        if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.RECORD) or recorded is None:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recorded = recorded.to(scores.device)
        if recorded.shape != own.shape:
            raise RuntimeError(f"router_replay: {tuple(recorded.shape)} recorded expert ids for a router that "
                               f"routes {tuple(own.shape)} (layer {self.layer}; tokens laid out otherwise than "
                               "the records)")
        has = (recorded >= 0).all(dim=-1)
        if action == RouterReplayAction.RECORD:
            self.record_indices(own)
            ids, probs = own, own_probs
        else:
            ids = torch.where(has[:, None], recorded, own)
            probs = scores.gather(1, ids)  # upstream's REPLAY_FORWARD, from the current scores
        if self.on_routed is not None:
            self.on_routed(ids, recorded, has)
        return probs, ids


def in_backward_pass() -> bool:
    """Whether this thread runs inside the autograd engine's backward pass (where Megatron-Core's
    ``CheckpointFunction.backward`` recomputes a checkpointed forward)."""
    return torch._C._current_graph_task_id() != -1


def recomputes_routers(config: Any) -> bool:
    """Whether Megatron-Core's activation recomputation under ``config`` runs the MoE routers again
    in the backward pass: full recomputation (whole layers), or a selective one of the MoE layers."""
    granularity = getattr(config, "recompute_granularity", None)
    modules = getattr(config, "recompute_modules", None) or []
    return granularity == "full" or (granularity == "selective" and "moe" in modules)


def _unregister(replay: RouterReplay) -> None:
    """Take ``replay`` out of Megatron-Core's process-wide list of router replays."""
    instances = RouterReplay.global_router_replay_instances
    if any(other is replay for other in instances):
        instances[:] = [other for other in instances if other is not replay]


def moe_routers(modules: list[Any]) -> list[tuple[int, Any]]:
    """``(Hugging Face layer index, TopKRouter)`` of every MoE layer in this rank's model chunks."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for module in modules:
        for _, sub in module.named_modules():
            if isinstance(sub, TopKRouter):
                out.append((int(sub.layer_number) - 1, sub))
    return out


class MegatronRouterReplay:
    """The routers of one worker's model, fed each micro-batch's recorded experts.

    :meth:`routing` sets the mode of the forwards inside it (replay or the routers' own routing,
    agreement measured or not); :func:`.forward_backward.run_schedule` calls :meth:`begin` and
    :meth:`end` around every micro-batch's forward through a model chunk of this stage; :meth:`agreement` gives the
    measured forward's per-token agreement. Outside :meth:`routing`, and for a micro-batch without
    ``routed_experts``, the routers route on their own. ``sequence_shard`` = ``(rank, tp)`` under
    sequence parallelism: the routers get the records of this tensor-parallel rank's positions.
    """

    def __init__(self, modules: list[Any], config: Any, *, sequence_shard: tuple[int, int] | None = None) -> None:
        self.recompute = recomputes_routers(config)
        # under sequence parallelism (tensor-parallel rank, tp): the routers see one share of the sequence
        self.sequence_shard = sequence_shard
        self._tokens = slice(None)  # this rank's tokens of the running micro-batch, in [s * b] order
        if getattr(config, "moe_router_fusion", False):  # the fused kernel never asks the replay object
            raise ValueError("[algorithm] router_replay = true needs moe_router_fusion = false")
        self.num_layers = int(config.num_layers)
        self.top_k = int(config.moe_router_topk)
        self.width = self.num_layers * self.top_k
        self.routers: list[tuple[int, Any, LayerReplay]] = []
        for layer, router in moe_routers(modules):
            if getattr(router, "routing_type", None) == "sinkhorn":
                raise ValueError("[algorithm] router_replay = true: sinkhorn routing cannot be replayed")
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"router_replay: a router of layer number {layer + 1} outside the model's "
                                 f"{self.num_layers} decoder layers")
            if router.router_replay is not None:  # moe_enable_routing_replay: upstream's own instance
                _unregister(router.router_replay)
            replay = LayerReplay(layer, router)
            replay.on_routed = self._count
            router.router_replay = replay
            self.routers.append((layer, router, replay))
        self._mode: tuple[bool, bool] | None = None  # (replay, measure) inside routing()
        self._agree: torch.Tensor | None = None  # [tokens] of the running micro-batch, [s * b] order
        self._measured: torch.Tensor | None = None
        # per measured micro-batch (by identity, in the order of their first forward): [2, rows, width]
        self._counts: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def routing(self, *, replay: bool, measure: bool) -> Iterator[None]:
        """Forwards inside replay the records (``replay``) or route on their own, and count the
        agreement when ``measure``; everything is dropped on the way out. Under a recomputation of
        the MoE layers, the training forwards inside keep their experts for the backward pass
        (:class:`LayerReplay`)."""
        self._mode = (replay, measure)
        self._counts = {}
        self._keep_for_backward(self.recompute)
        try:
            yield
        finally:
            self._mode = None
            self._clear()
            self._counts = {}
            self._keep_for_backward(False)

    def _keep_for_backward(self, keep: bool) -> None:
        for _, _, layer_replay in self.routers:
            layer_replay.keep_for_backward = keep
            layer_replay.forward_ids = []

    def begin(self, item: "StageInputs") -> None:
        """Before ``item``'s forward on this stage: each router gets its layer's recorded ids."""
        routes = item.micro.get("routed_experts") if self._mode is not None else None
        self._clear()
        if self._mode is None or routes is None:
            return
        replay, measure = self._mode
        if routes.shape[-1] != self.width:
            raise ValueError(f"router_replay: the batch's routed_experts have {routes.shape[-1]} ids per token, "
                             f"the model routes {self.num_layers} layers x top-{self.top_k} = {self.width} "
                             "(were they recorded from another model?)")
        rows, width = item.input_ids.shape
        routes = stage_routes(routes, rows, width)
        # Megatron-Core runs [s, b, h]: a router's tokens are position-major
        tokens = routes.transpose(0, 1).reshape(width * rows, self.num_layers, self.top_k)
        self._tokens = self._shard(width, rows)
        tokens = tokens[self._tokens]
        action = RouterReplayAction.REPLAY_FORWARD if replay else RouterReplayAction.RECORD
        for layer, _, layer_replay in self.routers:
            layer_replay.set_target_indices(tokens[:, layer].contiguous())
            layer_replay.set_router_replay_action(action)
        if measure:
            self._agree = torch.zeros(width * rows, device=routes.device)
            self._measured = torch.zeros(width * rows, device=routes.device)

    def _shard(self, width: int, rows: int) -> slice:
        """This rank's tokens among a micro-batch's ``width * rows`` (position-major): all of them,
        or under sequence parallelism its ``width / tp`` positions of every row."""
        if self.sequence_shard is None:
            return slice(0, width * rows)
        rank, tp = self.sequence_shard
        if width % tp:
            raise RuntimeError(f"router_replay: a micro-batch {width} tokens wide does not split over tp = {tp} "
                               "sequence-parallel ranks")
        share = width // tp * rows
        return slice(rank * share, (rank + 1) * share)

    def end(self, item: "StageInputs") -> None:
        """After ``item``'s forward through a model chunk of this stage: add its counts to the
        micro-batch's (the chunks of virtual pipeline stages count their own layers), drop its records."""
        if self._agree is not None and self._measured is not None:
            rows, width = item.input_ids.shape
            counts = torch.stack([self._agree, self._measured]).view(2, width, rows).transpose(1, 2)[:, :item.rows]
            earlier = self._counts.get(id(item))
            self._counts[id(item)] = counts if earlier is None else earlier + counts
        self._clear()

    def agreement(self, width: int, device: torch.device,
                  sum_stages: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Per token ``[rows, width]`` (the micro-batches' real rows in order) of the measured
        forward: the share of its MoE layers whose experts equal the record, -1 where no layer
        has a record. ``sum_stages`` sums the counts over the pipeline stages (in place), each
        stage having counted its own layers; every stage must call it."""
        parts = [torch.nn.functional.pad(c[..., :width], (0, max(0, width - c.shape[-1])))
                 for c in self._counts.values()]
        counts = torch.cat(parts, dim=1) if parts else torch.zeros(2, 0, width, device=device)
        if sum_stages is not None:
            sum_stages(counts)
        agree, measured = counts[0], counts[1]
        share = agree / measured.clamp(min=1)
        return torch.where(measured > 0, share, torch.full_like(share, -1.0))

    def _count(self, ids: torch.Tensor, recorded: torch.Tensor, has: torch.Tensor) -> None:
        if self._agree is None or self._measured is None:
            return
        with torch.no_grad():  # the experts this forward uses against the engine's
            same = (ids.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
            self._agree[self._tokens] += (same & has).float()
            self._measured[self._tokens] += has.float()

    def _clear(self) -> None:
        for _, _, layer_replay in self.routers:
            layer_replay.clear_indices()
            layer_replay.clear_router_replay_action()
        self._agree = self._measured = None


def stage_routes(routes: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """A micro-batch's records ``[r, T, ids]`` as its model input lays out tokens: cut or padded
    (-1) to ``width`` columns and padded (-1) to ``rows`` rows; long."""
    routes = routes[:, :width].long()
    pad_columns, pad_rows = width - routes.shape[1], rows - routes.shape[0]
    if pad_columns > 0 or pad_rows > 0:
        routes = torch.nn.functional.pad(routes, (0, 0, 0, max(pad_columns, 0), 0, max(pad_rows, 0)), value=-1)
    return routes
