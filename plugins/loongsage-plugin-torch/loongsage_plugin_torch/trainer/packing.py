"""Padding-free micro-batches: rows packed by a token budget into one sequence each.

With ``[train] max_tokens_per_micro_batch`` set, the torch trainer cuts a mini-batch (and the
rows of a scoring pass) into micro-batches by tokens instead of rows (:func:`plan_micro_batches`,
like verl's dynamic batch size), and runs each as **one** sequence: the rows' real tokens
concatenated, position ids restarting at 0 for every row, and attention kept within each row.
On the SDPA / eager attention paths that is a block-diagonal causal mask (and, for a model with
sliding-window layers, a second one limited to the window); with
``flash_attention_2`` (``[model] attn_implementation``) the restarting position ids are what the
varlen kernel reads its ``cu_seqlens`` from. No FLOP is spent on padding, and the per-token
outputs are scattered back into the batch's ``[b, T]`` layout, so the loss pipeline sees exactly
what the padded path gives it (equal within float32 tolerance, tested).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch, each micro-batch at most ``max_tokens`` real tokens (a longer
    row goes alone). Longest rows first, each into the first micro-batch it fits (first-fit
    decreasing), so few micro-batches are nearly full; rows keep ascending order inside one."""
    if max_tokens < 1:
        raise ValueError(f"[train] max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r)):
        n = int(lengths[i])
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return [sorted(b) for b in bins]


class PackedRows:
    """The real tokens of right-padded rows ``[b, T]`` as one sequence ``[1, total]``."""

    def __init__(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> None:
        import torch

        self.shape = tuple(input_ids.shape)
        self.real = attention_mask > 0
        self.lengths = self.real.sum(dim=1)
        self.input_ids = input_ids[self.real].unsqueeze(0)
        device = input_ids.device
        self.position_ids = torch.cat([torch.arange(int(n), device=device) for n in self.lengths]).unsqueeze(0)
        self.row_of_token = torch.repeat_interleave(torch.arange(self.shape[0], device=device), self.lengths)
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        self.starts = starts[self.lengths > 0]  # first token of each row: it predicts nothing
        self.cu_seqlens = torch.cat([starts, starts[-1:] + self.lengths[-1:]]).to(torch.int32)

    @property
    def total(self) -> int:
        return int(self.input_ids.shape[1])

    def attention_mask(self, config: Any) -> "torch.Tensor | dict[str, torch.Tensor] | None":
        """The attention mask of the packed sequence for a model with ``config``.

        ``None`` for ``flash_attention_2`` (varlen from the position ids; the kernel applies any
        sliding window itself). Else the 4-D block-diagonal causal mask ``[1, 1, total, total]``
        (True: attend); for a model with sliding-window layers, a mask per layer type as
        transformers takes them, the ``sliding_attention`` one also limited to the window
        (positions ``q - window < k <= q`` of the same row). A plain 4-D mask would be used as
        given by every layer, sliding ones included."""
        import torch

        attn_implementation = getattr(config, "_attn_implementation", None)
        if attn_implementation and "flash" in attn_implementation:
            return None
        row = self.row_of_token
        same = row[:, None] == row[None, :]
        causal = torch.ones(self.total, self.total, dtype=torch.bool, device=row.device).tril()
        mask = same & causal
        if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
            return mask[None, None]
        pos = self.position_ids[0]
        window = mask & (pos[None, :] > pos[:, None] - int(config.sliding_window))
        return {"full_attention": mask[None, None], "sliding_attention": window[None, None]}

    def unpack(self, flat: "torch.Tensor") -> "torch.Tensor":
        """``[1, total]`` per-token values back to the rows' ``[b, T]`` layout (0 on padding and
        on each row's first token, whose value across the row boundary means nothing)."""
        import torch

        flat = flat.reshape(-1)
        keep = torch.ones(self.total, dtype=torch.bool, device=flat.device)
        keep[self.starts] = False
        flat = torch.where(keep, flat, torch.zeros_like(flat))
        out = flat.new_zeros(self.shape)
        return out.masked_scatter(self.real, flat)


def packed_token_outputs(model: Any, input_ids: "torch.Tensor", attention_mask: "torch.Tensor", *,
                         compute_dtype: "torch.dtype", fp32_lm_head: bool, entropy_grad: bool,
                         scored: "torch.Tensor | None" = None) -> "tuple[torch.Tensor, torch.Tensor]":
    """Log-probs and entropies ``[b, T]`` of right-padded rows from one packed forward (the
    padded path's ``logprobs[:, t] = log p(ids[t] | ids[:t])``, 0 at position 0 and on padding;
    with ``scored`` (bool ``[b, T]``) only at those tokens, see :func:`.logits.next_token_logits`)."""
    from .logits import logprobs_and_entropy, next_token_logits

    packed = PackedRows(input_ids, attention_mask)
    flat_scored = None
    if scored is not None:  # a row's first token predicts nothing across the boundary: never scored
        flat_scored = scored[packed.real].unsqueeze(0).clone()
        flat_scored[0, packed.starts] = False
    logits = next_token_logits(model, packed.input_ids, packed.attention_mask(getattr(model, "config", None)),
                               compute_dtype=compute_dtype, fp32_lm_head=fp32_lm_head,
                               position_ids=packed.position_ids, scored=flat_scored)
    logprobs, entropy = logprobs_and_entropy(logits, packed.input_ids, entropy_grad=entropy_grad, scored=flat_scored)
    assert entropy is not None
    return packed.unpack(logprobs), packed.unpack(entropy)


__all__ = ["PackedRows", "packed_token_outputs", "plan_micro_batches"]
