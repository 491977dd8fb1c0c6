"""LoRA adapter updates of the embedded engine: merged into its weights, or applied per request.

With ``[train] lora`` the trainer sends only the adapter (tensors named as PEFT saves them,
``...<module>.lora_A.weight`` / ``...lora_B.weight``), over whichever weight transport the job
uses. The engine's fused decode path (:mod:`.runner`) has no LoRA branch, so the adapter is
*merged*: the first time a weight is adapted, the engine copies its base value aside; every
update then writes ``base + alpha / rank * B @ A`` (:func:`loongsage_plugin_torch.lora.merge_weight`,
the formula the trainer's merged export uses) into the live weight. Re-merging from the kept base
copy, rather than subtracting the previous update, keeps versions from drifting. The cost is one
extra copy of the adapted weights (all linear layers with ``"all-linear"``); the decode step
costs exactly what it costs without LoRA.

A full-weight tensor that arrives for an adapted weight replaces its base copy and is merged
with the current adapter.

With ``[rollout] engine_args.lora_mode = "unmerged"`` the weights stay the base model's and the
adapter's factors go to the runner (:meth:`~.runner.ModelRunner.set_unmerged_adapter`), which adds
``scaling * (x @ A) @ B`` to the projections of the requests whose ``lora_path`` names the adapter;
the others are served by the base model, so one engine serves the policy and its base side by side
(no extra copy of any weight). A full-weight tensor then simply replaces its base weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

from loongsage_hookspecs import LORA_ADAPTER_NAME

from ..lora import adapter_target, is_adapter_tensor, merge_weight
from .weights import WeightUpdateError, copy_named_tensors

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .runner import ModelRunner

ADAPTER_NAME = LORA_ADAPTER_NAME
"""The name the engine knows the trained adapter by: the one ``lora_path`` value it accepts."""


class AdapterUpdater:
    """Applies LoRA adapter updates to the engine's model (see the module docstring)."""

    def __init__(self, scaling: float | None, unmerged_runner: "ModelRunner | None" = None) -> None:
        """``scaling`` is ``alpha / rank`` of ``[train] lora``; ``None``: the job trains no adapter,
        and an adapter tensor in an update is an error. ``unmerged_runner``: apply the adapter
        unmerged, per request, through this runner instead of merging it into the weights."""
        self.scaling = scaling
        self.unmerged_runner = unmerged_runner
        self.base: dict[str, "torch.Tensor"] = {}
        self.factors: dict[str, tuple["torch.Tensor", "torch.Tensor"]] = {}

    @property
    def has_adapter(self) -> bool:
        """Whether an adapter has been received (merged into the weights, or held for requests)."""
        return bool(self.factors)

    def load(self, targets: Mapping[str, "torch.Tensor"], named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> int:
        """Copy full tensors into ``targets`` and merge adapter tensors into the weights they adapt
        (or hand them to the unmerged runner); returns the number of tensors received. A partial
        adapter (a factor without its pair), a factor whose shape does not fit its weight, or an
        adapter tensor on an engine whose job has no ``[train] lora`` is an error naming the tensor."""
        import torch

        pending: dict[str, dict[str, torch.Tensor]] = {}
        changed: set[str] = set()
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                count += 1
                if not is_adapter_tensor(name):
                    copy_named_tensors(targets, [(name, tensor)])
                    if name in self.base:
                        self.base[name].copy_(tensor)
                        changed.add(name)
                    continue
                if self.scaling is None:
                    raise WeightUpdateError(f"weight update: '{name}' is a LoRA adapter tensor, but this engine's job "
                                            "has no [train] lora")
                target, factor = adapter_target(name)
                if target not in targets:
                    raise WeightUpdateError(f"weight update: adapter tensor '{name}' adapts '{target}', "
                                            "which the model does not have")
                if self.unmerged_runner is not None and target not in self.unmerged_runner.adaptable_weights:
                    raise WeightUpdateError(f"weight update: adapter tensor '{name}' adapts '{target}'; the "
                                            "unmerged adapter applies to attention and MLP projections only "
                                            "(set [rollout] engine_args.lora_mode = \"merged\")")
                # transports may reuse their buffers between pairs: keep a copy (adapters are small)
                pending.setdefault(target, {})[factor] = tensor.detach().to(targets[target].device, copy=True)
            for target, pair in pending.items():
                self._check_pair(target, pair, targets[target])
            if self.unmerged_runner is not None:
                if pending:
                    assert self.scaling is not None  # adapter tensors without [train] lora raised above
                    self.factors.update((target, (pair["A"], pair["B"])) for target, pair in pending.items())
                    self.unmerged_runner.set_unmerged_adapter(self.factors, self.scaling)
                return count
            for target, pair in pending.items():
                self.factors[target] = (pair["A"], pair["B"])
                if target not in self.base:
                    self.base[target] = targets[target].detach().clone()
                changed.add(target)
            for target in changed:
                if target in self.factors:
                    a, b = self.factors[target]
                    assert self.scaling is not None
                    targets[target].copy_(merge_weight(self.base[target], a, b, self.scaling))
        return count

    @staticmethod
    def _check_pair(target: str, pair: Mapping[str, "torch.Tensor"], weight: "torch.Tensor") -> None:
        missing = [f"lora_{f}" for f in ("A", "B") if f not in pair]
        if missing:
            raise WeightUpdateError(f"weight update: the adapter of '{target}' came without {missing[0]}")
        a, b = pair["A"], pair["B"]
        out_features, in_features = weight.shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
                or a.shape[0] != b.shape[1]:
            raise WeightUpdateError(f"weight update: the adapter of '{target}' has lora_A {tuple(a.shape)} and "
                                    f"lora_B {tuple(b.shape)}, which do not fit its weight {tuple(weight.shape)}")
