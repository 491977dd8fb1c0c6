"""Attention over long sequences in query blocks, each over the keys its band can see.

A masked SDPA over a sequence of ``L`` tokens builds an ``L x L`` mask and computes every
query-key pair, although a causal query sees only the keys before it and a sliding-window layer
(Mistral, Gemma, gpt-oss, a Qwen with ``use_sliding_window``) only the last ``window`` of them.
Agentic trajectories are long: a coding-agent CLI sends a prompt of 20-35K tokens, whose mask
alone is over a gigabyte, and whose windowed layers need ``L x window`` pairs, not ``L x L``.

:func:`banded_sdpa` splits the queries into blocks of :data:`BLOCK`; block ``[j0, j1)`` attends
over keys ``[j0 + offset - window + 1, j1 + offset)`` only (from 0 for full attention), under the
block's own mask. Every visible key of a query is in its block's keys, so each query's softmax and
output are those of the whole masked attention (tested); the work is ``L x (BLOCK + window)`` pairs
for a windowed layer and about ``L^2 / 2`` for a full one, with masks of ``BLOCK`` rows.

:class:`BandedLayout` describes the rows (where each one's queries start, which queries and keys
are real). :func:`banded_attention` is the transformers attention function for padded rows
(:data:`BANDED_ATTENTION`, switched on per forward by :func:`banded_attention_for`); the per-row
attention of :mod:`.prompt_tree` calls :func:`banded_sdpa` itself.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch

BLOCK = 1024
"""Queries per block. A sequence of at most this many tokens is one block: one SDPA over all its
keys, as before."""

MASK_CACHE_ELEMENTS = 8 * BLOCK * BLOCK
"""Block masks up to this size are kept for the forward's other layers."""

BANDED_ATTENTION = "loongsage_banded"
"""The name :func:`banded_attention` is registered under (``config._attn_implementation``)."""

BANDED_BASES = ("sdpa", "eager")
"""The attention implementations whose masked path this replaces (flash kernels take no mask and
apply windows themselves)."""


@attrs.define(eq=False)
class BandedLayout:
    """Rows ``[S]`` of queries ``[S, Q]`` over keys ``[S, K]``: query ``j`` of row ``s`` is at
    position ``q_offset[s] + j``, key ``i`` at position ``i``; ``q_valid`` / ``k_valid`` mark the
    real ones. A key is visible to a query at or after it (and, in a window ``w``, fewer than ``w``
    positions before it). Block masks are kept per window for the forward's other layers."""

    q_offset: "torch.Tensor"
    q_valid: "torch.Tensor"
    k_valid: "torch.Tensor"
    right_padded: bool = False
    """Every row's real tokens come first (a padded batch): a full-attention layer then runs
    SDPA's own causal kernel, whose padded queries' outputs are never read."""
    _masks: dict = attrs.field(factory=dict)

    @classmethod
    def padded(cls, attention_mask: "torch.Tensor") -> "BandedLayout":
        """The layout of padded rows ``[B, L]`` (1: a real token), each row from position 0."""
        import torch

        real = attention_mask > 0
        lengths = real.sum(dim=1, keepdim=True)
        right = bool((real == (torch.arange(real.shape[1], device=real.device)[None] < lengths)).all())
        return cls(q_offset=torch.zeros(real.shape[0], dtype=torch.long, device=real.device), q_valid=real,
                   k_valid=real, right_padded=right)

    def band(self, j0: int, j1: int, keys: int, window: int | None) -> tuple[int, int]:
        """The keys ``[k0, k1)`` that the queries ``[j0, j1)`` of any row can see."""
        k1 = min(keys, int(self.q_offset.max()) + j1)
        k0 = 0 if window is None else max(0, int(self.q_offset.min()) + j0 - int(window) + 1)
        return k0, max(k1, k0 + 1)

    def mask(self, j0: int, j1: int, k0: int, k1: int, window: int | None) -> "torch.Tensor":
        """``[S, 1, j1 - j0, k1 - k0]`` (True: attend). A query that sees no key (a padded one)
        sees the band's first key, so that no softmax row is empty; its output is never read."""
        import torch

        cached = self._masks.get((window, j0, k0, k1))
        if cached is not None:
            return cached
        device = self.q_valid.device
        q_pos = self.q_offset[:, None] + torch.arange(j0, j1, device=device)[None]
        k_pos = torch.arange(k0, k1, device=device)
        visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & self.k_valid[:, None, k0:k1]
        if window is not None:
            visible &= k_pos[None, None, :] > q_pos[:, :, None] - int(window)
        visible &= self.q_valid[:, j0:j1, None]
        visible[:, :, 0] |= ~visible.any(dim=-1)
        if visible.numel() <= MASK_CACHE_ELEMENTS:  # a full layer's long bands are cheaper to redo than to keep
            self._masks[(window, j0, k0, k1)] = visible[:, None]
        return visible[:, None]


def banded_sdpa(query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor", layout: BandedLayout, *,
                window: int | None, scaling: float | None = None, dropout: float = 0.0) -> "torch.Tensor":
    """Attention ``[S, H, Q, D]`` of ``query`` ``[S, H, Q, D]`` over ``key`` / ``value``
    ``[S, KV, K, D]`` (grouped-query heads shared), block by block (module docstring)."""
    import torch
    import torch.nn.functional as F

    gqa = key.shape[1] != query.shape[1]
    queries, keys = query.shape[2], key.shape[2]
    if window is None and layout.right_padded and queries == keys and int(layout.q_offset.abs().max()) == 0:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, dropout_p=dropout,
                                              enable_gqa=gqa)
    outs = []
    for j0 in range(0, queries, BLOCK):
        j1 = min(queries, j0 + BLOCK)
        k0, k1 = layout.band(j0, j1, keys, window)
        outs.append(F.scaled_dot_product_attention(
            query[:, :, j0:j1], key[:, :, k0:k1], value[:, :, k0:k1], attn_mask=layout.mask(j0, j1, k0, k1, window),
            scale=scaling, dropout_p=dropout, enable_gqa=gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def banded_attention(module: Any, query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor",
                     attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> "tuple[torch.Tensor, None]":
    """The attention of :data:`BANDED_ATTENTION` over padded rows (``query`` ``[B, H, L, D]``);
    returns ``[B, L, H, D]`` as transformers' SDPA attention does. The rows come as the keyword
    argument ``banded`` (a :class:`BandedLayout`); without it this is transformers' SDPA attention."""
    layout: BandedLayout | None = kwargs.pop("banded", None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = banded_sdpa(query, key, value, layout, window=kwargs.get("sliding_window"), scaling=scaling,
                      dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def uses_banded(config: Any, length: int) -> bool:
    """Whether a forward of ``length`` tokens by a model with ``config`` attends in blocks: a
    sequence longer than one :data:`BLOCK` on the SDPA or eager attention path."""
    return (config is not None and length > BLOCK
            and str(getattr(config, "_attn_implementation", None) or "eager") in BANDED_BASES)


@contextlib.contextmanager
def banded_attention_for(config: Any) -> Iterator[None]:
    """The attention of the model with ``config`` is :func:`banded_attention` inside the block,
    its own again after."""
    from transformers import AttentionInterface

    AttentionInterface.register(BANDED_ATTENTION, banded_attention)
    before = config._attn_implementation
    config._attn_implementation = BANDED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


__all__ = ["BANDED_ATTENTION", "BLOCK", "BandedLayout", "banded_attention", "banded_attention_for", "banded_sdpa",
           "uses_banded"]
