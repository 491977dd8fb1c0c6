"""Per-token log-probs and entropies of a causal LM, aligned with the input tokens.

The model's decoder runs once; the output projection is applied only to the positions that
predict a next token (``[:, :-1]``), optionally in float32 whatever the compute dtype.
``logprobs[:, t]`` is ``log p(input_ids[:, t] | input_ids[:, :t])`` and position 0 holds 0, as
the batch layout of ``loongsage_hookspecs.records`` requires.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch


def decoder_of(model: Any) -> Any:
    """The base transformer of a ``*ForCausalLM`` model (what produces the last hidden states)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None:
        raise TypeError(f"{type(model).__name__} has no base model attribute "
                        f"{getattr(model, 'base_model_prefix', 'model')!r}")
    return base


def next_token_logits(model: Any, input_ids: "torch.Tensor",
                      attention_mask: "torch.Tensor | dict[str, torch.Tensor] | None", *,
                      compute_dtype: "torch.dtype", fp32_lm_head: bool,
                      position_ids: "torch.Tensor | None" = None,
                      scored: "torch.Tensor | None" = None) -> "torch.Tensor":
    """Float32 logits ``[B, T-1, V]``: position ``t`` scores token ``t + 1``.

    ``scored`` (bool ``[B, T]``) names the tokens whose log-probs are wanted (a batch's
    ``loss_mask``: the responses); the output projection then runs on the positions that predict
    them alone and the logits are ``[K, V]``, those positions in row-major order. The projection
    and the vocabulary-wide log-softmax are a large share of a step for a big vocabulary, and a
    prompt's positions need neither.

    ``position_ids`` marks packed rows (several sequences per row, positions restarting at 0 for
    each): the decoder then gets no padding mask and transformers derives a block-diagonal causal
    mask from the restarts, so every sequence attends only to itself. With a 4-D
    ``attention_mask`` (the block-diagonal mask of :mod:`.packing`) both are passed as given.

    When the parameters are stored in a wider dtype than ``compute_dtype`` (float32 master weights
    with bfloat16 compute), the decoder runs under autocast. The output projection runs in
    float32 when ``fp32_lm_head`` is set, else in ``compute_dtype``.
    """
    import torch
    import torch.nn.functional as F

    head = model.get_output_embeddings()
    param_dtype = head.weight.dtype
    device_type = input_ids.device.type
    autocast = (torch.autocast(device_type=device_type, dtype=compute_dtype)
                if compute_dtype != param_dtype else contextlib.nullcontext())
    with autocast:
        if position_ids is None:
            out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        elif isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() == 4):
            # explicit block-diagonal mask(s), one per layer type for a model with sliding windows
            out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False)
        else:
            out = decoder_of(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state[:, :-1]
        if scored is not None:
            hidden = hidden[scored[:, 1:]]
    bias = getattr(head, "bias", None)
    with torch.autocast(device_type=device_type, enabled=False):
        if fp32_lm_head:
            logits = F.linear(hidden.float(), head.weight.float(), None if bias is None else bias.float())
        else:
            logits = F.linear(hidden.to(compute_dtype), head.weight.to(compute_dtype),
                              None if bias is None else bias.to(compute_dtype))
    return logits.float()


def logprobs_and_entropy(logits: "torch.Tensor", input_ids: "torch.Tensor", *, with_entropy: bool = True,
                         entropy_grad: bool = True, scored: "torch.Tensor | None" = None,
                         ) -> "tuple[torch.Tensor, torch.Tensor | None]":
    """Token log-probs and entropies ``[B, T]`` from next-token ``logits`` ``[B, T-1, V]`` (or
    ``[K, V]`` of the ``scored`` tokens, see :func:`next_token_logits`: 0 at every other token).

    Uses ``logsumexp`` and a gather rather than a full ``log_softmax``; the entropy is
    ``lse - sum(softmax * logits)``. ``entropy_grad=False`` computes it without autograd history
    (when no loss term uses it).
    """
    import torch
    import torch.nn.functional as F

    targets = input_ids[:, 1:] if scored is None else input_ids[:, 1:][scored[:, 1:]]
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse

    def per_token(values: "torch.Tensor") -> "torch.Tensor":
        if scored is not None:  # back to [B, T-1], 0 at the tokens not scored
            values = values.new_zeros(input_ids[:, 1:].shape).masked_scatter(scored[:, 1:], values)
        return F.pad(values, (1, 0))

    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            src = logits if entropy_grad else logits.detach()
            lse_e = lse if entropy_grad else lse.detach()
            ent = lse_e - (torch.softmax(src, dim=-1) * src).sum(-1)
        entropy = per_token(ent)
    return per_token(picked), entropy
