"""Per-token log-probs and entropies of a causal LM, aligned with the input tokens.

The model's decoder runs once; the output projection is applied only to the positions that
predict a next token (``[:, :-1]``), optionally in float32 whatever the compute dtype.
``logprobs[:, t]`` is ``log p(input_ids[:, t] | input_ids[:, :t])`` and position 0 holds 0, as
the batch layout of ``loongsage_hookspecs.records`` requires.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from .banded_attention import BandedLayout, banded_attention_for, uses_banded

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
                      scored: "torch.Tensor | None" = None,
                      vision: "dict[str, torch.Tensor] | None" = None) -> "torch.Tensor":
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

    ``vision`` (a vision-language model, padded rows): the image inputs of the rows
    (:mod:`.vision_inputs`), passed to the decoder.
    """
    hidden = decoder_hidden(model, input_ids, attention_mask, compute_dtype=compute_dtype,
                            position_ids=position_ids, vision=vision)[:, :-1]
    if scored is not None:
        hidden = hidden[scored[:, 1:]]
    return output_logits(model, hidden, compute_dtype=compute_dtype, fp32_lm_head=fp32_lm_head)


def decoder_hidden(model: Any, input_ids: "torch.Tensor",
                   attention_mask: "torch.Tensor | dict[str, torch.Tensor] | None", *,
                   compute_dtype: "torch.dtype", position_ids: "torch.Tensor | None" = None,
                   vision: "dict[str, torch.Tensor] | None" = None, **attention_kwargs: Any) -> "torch.Tensor":
    """The decoder's last hidden states ``[B, T, H]`` (see :func:`next_token_logits` for the
    masks and positions it takes, and the autocast it runs under); ``attention_kwargs`` reach the
    attention function of every layer (the ``prompt_tree`` layout of :mod:`.prompt_tree`)."""
    import torch

    param_dtype = model.get_output_embeddings().weight.dtype
    autocast = (torch.autocast(device_type=input_ids.device.type, dtype=compute_dtype)
                if compute_dtype != param_dtype else contextlib.nullcontext())
    config = getattr(model, "config", None)
    if position_ids is None and vision is None and isinstance(attention_mask, torch.Tensor) \
            and attention_mask.dim() == 2 and uses_banded(config, input_ids.shape[1]):
        # long padded rows: attention block by block over the keys each block sees, no L x L mask
        with autocast, banded_attention_for(config):
            return decoder_of(model)(input_ids=input_ids, use_cache=False,
                                     banded=BandedLayout.padded(attention_mask)).last_hidden_state
    with autocast:
        if position_ids is None:
            out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                    **(vision or {}))
        elif isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() == 4):
            # explicit packed mask(s), one per layer type for a model with sliding windows
            out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False, **attention_kwargs)
        else:
            out = decoder_of(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                    **attention_kwargs)
    return out.last_hidden_state


def output_logits(model: Any, hidden: "torch.Tensor", *, compute_dtype: "torch.dtype",
                  fp32_lm_head: bool) -> "torch.Tensor":
    """Float32 logits of ``hidden`` states (any leading shape) through the model's output
    projection, in float32 when ``fp32_lm_head`` is set, else in ``compute_dtype``."""
    import torch
    import torch.nn.functional as F

    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
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

    Both come from one blocked pass over the logits (:mod:`.token_scores`). ``entropy_grad=False``
    computes the entropy without autograd history (when no loss term uses it).
    """
    import torch.nn.functional as F

    from .token_scores import token_scores

    targets = input_ids[:, 1:] if scored is None else input_ids[:, 1:][scored[:, 1:]]
    picked, ent = token_scores(logits, targets, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def per_token(values: "torch.Tensor") -> "torch.Tensor":
        if scored is not None:  # back to [B, T-1], 0 at the tokens not scored
            values = values.new_zeros(input_ids[:, 1:].shape).masked_scatter(scored[:, 1:], values)
        return F.pad(values, (1, 0))

    return per_token(picked), None if ent is None else per_token(ent)
