"""Router Replay (R3): a mixture-of-experts policy routes each token to the experts the engine chose.

The rollout engine and the trainer can pick different top-k experts for the same token (a few
ulps of difference flip a choice), and then the trainer's log-probs are those of another network
than the one that sampled. With ``[algorithm] router_replay = true`` the engine records its choices
(``return_routed_experts``; the batch's ``routed_experts``) and :class:`RouterReplay` makes every
forward of the policy use them: a forward hook on each layer's top-k router (transformers'
``*TopKRouter`` modules, which return ``(router_logits, scores, indices)``) swaps in the recorded
expert ids and recomputes their gating weights from the router's *current* softmax, renormalised
as the model does. So the experts are the engine's, the weights stay differentiable (the router
keeps learning), and the router logits, which a load-balancing loss reads, are unchanged. A token
without a record (-1: padding, the last generated token) keeps the trainer's own choice.

Each router also measures, per token, whether the experts the forward uses (the set) are the
engine's: the share of a token's mixture-of-experts layers that agree is the ``router_agreement``
output of a scoring pass. With replay it is 1 wherever the engine left a record (anything less
means the records do not line up with the tokens); without replay it is how often the trainer's
own routing matches the engine's, what replay corrects.
"""

from __future__ import annotations

from typing import Any

import torch

from .logits import decoder_of


def moe_routers(model: Any) -> list[tuple[int, Any]]:
    """``(decoder layer index, router module)`` of every mixture-of-experts layer of ``model``: a
    layer whose MLP has a ``gate`` with a ``top_k`` and a ``weight`` (``[experts, hidden]``)."""
    layers = getattr(decoder_of(model), "layers", None) or ()
    out = []
    for index, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and isinstance(getattr(gate, "weight", None), torch.Tensor):
            out.append((index, gate))
    return out


class RouterReplay:
    """Forward hooks on a model's routers that replay recorded expert ids (see the module docstring).

    The hooks are installed once and idle until :meth:`set_routes` gives the routes of the next
    forward; the routes stay set through that forward's backward pass (activation checkpointing
    runs the routers again there) until :meth:`clear`.
    """

    def __init__(self, model: Any) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("[algorithm] router_replay = true, but the model has no mixture-of-experts layers "
                             "(no decoder layer's MLP has a top-k router 'gate')")
        self.num_layers = len(decoder_of(model).layers)
        self.top_k = int(self.routers[0][1].top_k)
        if any(int(gate.top_k) != self.top_k for _, gate in self.routers):
            raise ValueError("router_replay: the model's mixture-of-experts layers route to different top-k")
        #: ids per token of the engine's record: ``[layers, top_k]`` flattened
        self.width = self.num_layers * self.top_k
        self._routes: torch.Tensor | None = None  # [N, layers, top_k] long, N the forward's flat tokens
        self._replay = True
        self._agree: torch.Tensor | None = None  # [N]: layers whose own top-k equals the record
        self._measured: torch.Tensor | None = None  # [N]: layers with a record
        self._handles = [gate.register_forward_hook(self._hook(index)) for index, gate in self.routers]

    def set_routes(self, routes: torch.Tensor | None, *, replay: bool = True, measure: bool = False) -> None:
        """The recorded experts of the next forward's tokens, ``[..., width]`` (int, -1: none) laid
        out as the forward's ``input_ids`` ``[...]``; ``replay=False`` only measures (the
        trainer routes on its own). ``measure`` counts agreement (:meth:`agreement`)."""
        if routes is None:
            self.clear()
            return
        if routes.shape[-1] != self.width:
            raise ValueError(f"router_replay: the batch's routed_experts have {routes.shape[-1]} ids per token, "
                             f"the model routes {self.num_layers} layers x top-{self.top_k} = {self.width} "
                             "(were they recorded from another model?)")
        self._routes = routes.reshape(-1, self.num_layers, self.top_k).long()
        self._replay = replay
        n = self._routes.shape[0]
        self._agree = torch.zeros(n, device=routes.device) if measure else None
        self._measured = torch.zeros(n, device=routes.device) if measure else None

    def clear(self) -> None:
        self._routes = self._agree = self._measured = None

    def agreement(self) -> torch.Tensor | None:
        """Per flat token of the last measured forward: the share of its mixture-of-experts layers
        whose experts in the forward equal the record (-1 for a token without a record)."""
        if self._agree is None or self._measured is None:
            return None
        share = self._agree / self._measured.clamp(min=1)
        return torch.where(self._measured > 0, share, torch.full_like(share, -1.0))

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int) -> Any:
        def replay(module: Any, _inputs: Any, output: Any) -> Any:
            if self._routes is None:
                return None
            logits, scores, own = output
            if self._routes.shape[0] != logits.shape[0]:
                raise RuntimeError(f"router_replay: {self._routes.shape[0]} recorded tokens for a forward of "
                                   f"{logits.shape[0]}")
            recorded = self._routes[:, layer, :]
            has = (recorded >= 0).all(dim=-1)
            ids = torch.where(has[:, None], recorded, own) if self._replay else own
            if self._agree is not None and self._measured is not None:
                with torch.no_grad():  # the experts this forward uses against the engine's
                    same = (ids.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
                    self._agree += (same & has).float()
                    self._measured += has.float()
            if not self._replay:
                return None
            weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
            if getattr(module, "norm_topk_prob", True):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), ids

        return replay
