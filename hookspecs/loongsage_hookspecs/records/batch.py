"""The training batch: named tensors with a common leading dimension plus per-row metadata.

:data:`BATCH_FIELDS` documents the tensor names; the layout conventions are those of
:mod:`loongsage_hookspecs.records`. This module never imports torch at import time (only under
``TYPE_CHECKING`` or inside methods), so plugin packages that do no tensor work stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import attrs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


BATCH_FIELDS: Mapping[str, str] = {
    "input_ids": "[B, T] long token ids, right-padded",
    "attention_mask": "[B, T] 1 on real tokens, 0 on padding",
    "position_ids": "[B, T] long, optional: packed rows, positions restart at 0 for each sequence in a row "
                    "(attention stays within each sequence)",
    "loss_mask": "[B, T] 1 on trained (policy-generated) tokens",
    "rollout_logprobs": "[B, T] engine log-probs of the sampled tokens",
    "old_logprobs": "[B, T] trainer log-probs before the update (recomputed or = rollout)",
    "ref_logprobs": "[B, T] frozen reference model log-probs",
    "advantages": "[B, T] per-token advantages",
    "returns": "[B, T] value targets (critic)",
    "values": "[B, T] critic values at rollout time",
    "rewards": "[B] sequence scores",
    "group_index": "[B] long, rows with the same index were sampled for the same prompt",
    "sample_index": "[B] long, rows with the same index are segments of the same trajectory",
    "correction_weights": "[B, T] product of the pre-advantage corrections' IS weights",
    "correction_mask": "[B, T] product of the pre-advantage corrections' masks",
    "weight_versions": "[B, T] long, policy version that produced each token (-1: not generated)",
    "routed_experts": "[B, T, layers * top_k] int16, optional: the experts a mixture-of-experts engine routed "
                      "each token to, layer by layer (-1: no record); the trainer replays them with "
                      "[algorithm] router_replay",
}
"""Documented tensor names of :class:`Batch`; components may add their own keys. Per-row values
that are not tensors live in ``Batch.meta`` (``trajectory_id``, ``source``, ...; ``images``: for
rows of a vision-language policy's conversations, the base64 bytes of the row's images in token
order, ``None`` on rows without)."""


@attrs.define
class Batch:
    """A training batch: named tensors with a common leading dimension plus per-row metadata.

    ``tensors`` uses the names of :data:`BATCH_FIELDS`; ``meta`` holds per-row Python values
    (``sample_id``, ``source``, ...), each a list of length ``len(batch)``. ``meta["constraints"]``
    (present when a row has any) lists each row's spans sampled under a grammar as ``(start, end,
    grammar, stop_token_ids)`` (a :class:`~loongsage_hookspecs.GrammarSpan`; ``None`` or empty:
    none): a trainer scores those tokens under the same grammar (``loongsage_core.backend_api.grammar``).
    """

    tensors: dict[str, "torch.Tensor"] = attrs.field(factory=dict)
    meta: dict[str, list[Any]] = attrs.field(factory=dict)

    def __len__(self) -> int:
        for t in self.tensors.values():
            return int(t.shape[0])
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> "torch.Tensor":
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def get(self, key: str) -> "torch.Tensor | None":
        return self.tensors.get(key)

    def select(self, index: Sequence[int]) -> "Batch":
        """Rows ``index`` of every tensor and meta list, in that order."""
        import torch

        idx = torch.as_tensor(list(index), dtype=torch.long)
        return Batch(
            tensors={k: v.index_select(0, idx.to(v.device)) for k, v in self.tensors.items()},
            meta={k: [v[i] for i in index] for k, v in self.meta.items()},
        )

    def chunks(self, size: int) -> Iterator["Batch"]:
        """Consecutive row chunks of at most ``size`` rows (the last may be smaller)."""
        n = len(self)
        for start in range(0, n, size):
            yield self.select(range(start, min(start + size, n)))

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of ``batches`` one after another; tensors are right-padded to a common length."""
        import torch

        if not batches:
            return Batch()
        keys = batches[0].tensors.keys()
        tensors: dict[str, torch.Tensor] = {}
        for k in keys:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() >= 2:
                width = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
            tensors[k] = torch.cat(parts, 0)
        # a key some batches lack (e.g. ``images``: only rows with images have it) is None on their rows
        meta_keys = dict.fromkeys(k for b in batches for k in b.meta)
        meta = {k: [x for b in batches for x in b.meta.get(k, [None] * len(b))] for k in meta_keys}
        return Batch(tensors=tensors, meta=meta)
