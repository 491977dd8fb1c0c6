"""Attention per row inside packed sequences, over a shared prompt and the row's own tokens.

A packed sequence (:class:`.packing.PackedRows`) holds several rows back to back: every row of a
padding-free micro-batch, or a GRPO group whose rows run their shared prompt once (the prompt,
then every row's kept tokens). A masked attention over that sequence costs its length squared (a
group of 8 rows of 24 new tokens after a 14-token prompt: 206 x 206 query-key pairs; a micro-batch
of 16,384 packed tokens: 16,384 x 16,384), although each token only sees its own row and, when
shared, the prompt (14 + 24 keys at most in the example).

:class:`PromptTreeLayout` lists every row as a *segment*: its packed tokens as queries, the
prompt's packed tokens and its own as keys. The attention function registered here
(:data:`PROMPT_TREE_ATTENTION`, a transformers ``AttentionInterface``) gathers each segment's
queries, keys and values, runs one batched, causally masked SDPA over the segments
(``[segments, heads, 24, 38]`` in the example: about 6x fewer pairs) and scatters the outputs
back, so every token gets the attention output of the masked path (tested). A long segment (a
coding agent's 30K-token prompt) attends block by block over the keys each block can see
(:mod:`.banded_attention`), never through a segment-long mask.

The layout reaches the attention of every layer as the keyword argument ``prompt_tree`` of the
decoder's forward (transformers passes extra keyword arguments down to the attention function);
:func:`prompt_tree_attention` switches the model to this attention for one forward
(:meth:`.packing.PackedRows.attention` does both). A layer with a sliding window
(``sliding_window`` from the model's attention module) also masks keys older than its window, and
a long segment's blocks then read only the keys inside it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import attrs

from .banded_attention import BandedLayout, banded_sdpa

if TYPE_CHECKING:  # pragma: no cover
    import torch

PROMPT_TREE_ATTENTION = "loongsage_prompt_tree"
"""The name the attention function is registered under (``config._attn_implementation``)."""

TREE_BASES = ("sdpa", "eager")
"""The attention implementations whose masked path the tree attention replaces (flash kernels
take no mask, so groups are never formed for them)."""


@attrs.define(frozen=True)
class Segment:
    """One row in a packed sequence: its ``count`` kept tokens start at column ``start`` of packed
    row ``packed_row``; the first ``shared`` tokens of the row are the anchor's, at columns
    ``anchor_start ..`` of the same packed row (0 for a row that keeps all its tokens)."""

    packed_row: int
    start: int
    count: int
    anchor_start: int
    shared: int


@attrs.define(eq=False)
class PromptTreeLayout:
    """Gather indices and masks of the segments of packed sequences ``[R, L]``.

    ``q_index`` ``[S, Q]`` and ``k_index`` ``[S, K]`` index the flattened ``R * L`` packed
    positions (0 where a segment is shorter: masked out); ``q_valid`` ``[S, Q]`` marks real
    queries. ``banded`` places them: a segment's keys are at positions ``0 .. shared - 1`` (the
    prompt), then its own tokens, whose queries start at position ``shared``."""

    q_index: "torch.Tensor"
    q_valid: "torch.Tensor"
    k_index: "torch.Tensor"
    banded: BandedLayout

    @classmethod
    def build(cls, segments: Sequence[Segment], cols: int, device: Any = None) -> "PromptTreeLayout":
        import torch

        count = torch.tensor([s.count for s in segments], dtype=torch.long)
        shared = torch.tensor([s.shared for s in segments], dtype=torch.long)
        base = torch.tensor([s.packed_row * cols for s in segments], dtype=torch.long)
        start = torch.tensor([s.start for s in segments], dtype=torch.long)
        anchor = torch.tensor([s.anchor_start for s in segments], dtype=torch.long)
        q = torch.arange(int(count.max()))[None, :]
        k = torch.arange(int((shared + count).max()))[None, :]
        q_valid = q < count[:, None]
        k_valid = k < (shared + count)[:, None]
        in_prompt = k < shared[:, None]
        own_col = start[:, None] + (k - shared[:, None])
        k_index = torch.where(in_prompt, anchor[:, None] + k, own_col) + base[:, None]
        q_index = base[:, None] + start[:, None] + q
        banded = BandedLayout(q_offset=shared.to(device), q_valid=q_valid.to(device), k_valid=k_valid.to(device))
        return cls(q_index=torch.where(q_valid, q_index, 0).to(device), q_valid=q_valid.to(device),
                   k_index=torch.where(k_valid, k_index, 0).to(device), banded=banded)


def tree_attention(module: Any, query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor",
                   attention_mask: "torch.Tensor | None", dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> "tuple[torch.Tensor, None]":
    """The attention of :data:`PROMPT_TREE_ATTENTION`: ``query`` ``[R, H, L, D]``, ``key`` /
    ``value`` ``[R, KV, L, D]`` of the packed sequences; returns ``[R, L, H, D]`` as
    transformers' SDPA attention does. Without a ``prompt_tree`` keyword (a forward not packed
    by rows) it is transformers' SDPA attention."""
    layout: PromptTreeLayout | None = kwargs.pop("prompt_tree", None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    R, H, L, D = query.shape
    kv_heads = key.shape[1]
    flat_q = query.transpose(1, 2).reshape(R * L, H, D)
    flat_k = key.transpose(1, 2).reshape(R * L, kv_heads, D)
    flat_v = value.transpose(1, 2).reshape(R * L, kv_heads, D)
    # index_select, not x[index]: its backward adds the gradients of the prompt's tokens (gathered
    # once per row that shares it) with index_add_, several times faster than index_put_'s
    q = _gather_rows(flat_q, layout.q_index).transpose(1, 2)  # [S, H, Q, D]
    k = _gather_rows(flat_k, layout.k_index).transpose(1, 2)  # [S, KV, K, D]
    v = _gather_rows(flat_v, layout.k_index).transpose(1, 2)
    out = banded_sdpa(q, k, v, layout.banded, window=kwargs.get("sliding_window"), scaling=scaling, dropout=dropout)
    picked = out.transpose(1, 2)[layout.q_valid]  # [N, H, D] of the real queries
    result = flat_q.new_zeros(R * L, H, D).index_put((layout.q_index[layout.q_valid],), picked)
    return result.view(R, L, H, D), None


def _gather_rows(flat: "torch.Tensor", index: "torch.Tensor") -> "torch.Tensor":
    """``flat[index]`` (``flat`` ``[N, ...]``, ``index`` ``[S, Q]``) as ``[S, Q, ...]``."""
    return flat.index_select(0, index.reshape(-1)).view(*index.shape, *flat.shape[1:])


def register() -> None:
    """Register :func:`tree_attention` with transformers under :data:`PROMPT_TREE_ATTENTION`
    (again is harmless: the same name, the same function)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PROMPT_TREE_ATTENTION, tree_attention)


def uses_tree(config: Any) -> bool:
    """Whether a model with ``config`` can attend per row (:data:`TREE_BASES`)."""
    return str(getattr(config, "_attn_implementation", None) or "eager") in TREE_BASES


@contextlib.contextmanager
def prompt_tree_attention(config: Any) -> Iterator[None]:
    """The attention of the model with ``config`` is :func:`tree_attention` inside the block,
    its own again after."""
    register()
    before = config._attn_implementation
    config._attn_implementation = PROMPT_TREE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


__all__ = ["PROMPT_TREE_ATTENTION", "PromptTreeLayout", "Segment", "prompt_tree_attention", "register",
           "tree_attention", "uses_tree"]
