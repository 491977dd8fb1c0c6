"""Micro-batches through Megatron-Core's forward-backward schedule (any pipeline-parallel size).

Every rank of a pipeline group holds the same rows. :func:`stage_inputs` turns them into the
model's inputs, one :class:`StageInputs` per micro-batch; :func:`run_schedule` hands these to
``megatron.core.pipeline_parallel.get_forward_backward_func()`` (no pipelining under PP = 1, the
1F1B schedule ``forward_backward_pipelining_without_interleaving`` under PP > 1, the interleaved
1F1B schedule over the model chunks of ``backend_args.vpp``), whose last
pipeline stage calls back with each micro-batch's logits. :func:`token_outputs` turns those into
per-token log-probs and entropies, :func:`token_outputs_and_logits` adds the next-token logits
over the Hugging Face vocabulary that a vocabulary-level KL or distillation term of the host's
loss reads (under TP > 1 the vocabulary shards are gathered differentiably), and
:func:`teacher_outputs` makes a teacher's log-probs, top-k and full logits; what the caller's
``on_logits`` does with them (the host's loss, or collecting them) is up to it. Under Router
Replay (``[algorithm] router_replay``) :func:`run_schedule` hands each micro-batch's recorded
experts to the routers around its forward (:mod:`.router_replay`).

Pipeline stages exchange activations of one fixed shape ``[width, rows, hidden]``, so under
PP > 1 every micro-batch is padded to the widest real length of the call and to
``micro_batch_size`` rows (extra rows are zeros, dropped before the loss). Under expert
parallelism the MoE layers exchange tokens with the other ranks of the expert-parallel group,
which hold other rows: they agree on one width and one number of micro-batches (the caller
passes them), a rank short of rows running all-padding micro-batches. Otherwise each
micro-batch keeps its own width and row count. Under sequence parallelism Megatron-Core splits
the sequence evenly over the tensor-parallel ranks, so every width is rounded up to a multiple
of ``tp`` (``width_multiple``; the extra columns are right padding, never scored).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from loongsage_hookspecs import Batch

from .logits import logprobs_and_entropy, sampled_logprobs_and_topk


@attrs.define(frozen=True)
class StageInputs:
    """One micro-batch as every pipeline stage feeds it to the model.

    ``micro`` holds the real rows (tensors on the model's device); ``input_ids`` and
    ``position_ids`` are ``[rows_padded, width]``; ``attention_mask`` is Megatron's causal mask
    ``[1, 1, width, width]`` (True hides a position).
    """

    micro: "Batch"
    input_ids: "torch.Tensor"
    position_ids: "torch.Tensor"
    attention_mask: "torch.Tensor"
    #: the policy's Hugging Face tokenizer, when ``micro`` holds turns decoded under a grammar
    #: (``meta["constraints"]``): their logits are masked as the engine's were (:func:`constrained`)
    grammar_tokenizer: Any = None

    @property
    def rows(self) -> int:
        """The number of real rows (``input_ids`` may carry padding rows after them)."""
        return len(self.micro)

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])


def real_lengths(batch: "Batch") -> "torch.Tensor":
    """Per-row token counts ``[B]``; raises ValueError unless ``attention_mask`` is right-padded."""
    import torch

    ids = batch["input_ids"]
    attention = batch.get("attention_mask")
    attention = torch.ones_like(ids) if attention is None else attention
    lengths = attention.sum(1)
    positions = torch.arange(ids.shape[1], device=ids.device)
    if not torch.equal(attention.bool(), positions[None, :] < lengths[:, None]):
        raise ValueError("megatron train backend: attention_mask must be right-padded (ones then zeros)")
    return lengths


def stage_inputs(batch: "Batch", micro_batch_size: int, device: "torch.device", *,
                 fixed_shape: bool, width: int | None = None, micro_batches: int | None = None,
                 width_multiple: int = 1) -> list[StageInputs]:
    """The micro-batches of ``batch`` as model inputs on ``device``.

    ``fixed_shape`` (pipeline or expert parallelism): every micro-batch gets ``width`` columns
    (default: the batch's widest real length) and ``micro_batch_size`` rows; otherwise each is cut
    to its own widest real length. ``micro_batches`` (expert parallelism, where the ranks of an
    expert-parallel group must run as many micro-batches as each other): the count to return,
    extra ones being all padding (no real rows). ``width_multiple`` (``tp`` under sequence
    parallelism): every width is rounded up to a multiple of it (right padding).
    """

    from loongsage_hookspecs import Batch

    if width is not None and len(batch) and width < int(real_lengths(batch).max()):
        raise ValueError(f"stage_inputs: width {width} is shorter than the batch's longest row")
    if not len(batch) and not micro_batches:
        return []
    def fit(w: int) -> int:
        return -(-w // width_multiple) * width_multiple

    batch_width = fit(max(int(real_lengths(batch).max()) if len(batch) else 1, width or 1))
    out = []
    for micro in batch.chunks(micro_batch_size) if len(batch) else []:
        micro = Batch(tensors={k: v.to(device) for k, v in micro.tensors.items()}, meta=micro.meta)
        micro_width = batch_width if fixed_shape else fit(max(int(real_lengths(micro).max()), 1))
        out.append(_stage_input(micro, micro_width, micro_batch_size if fixed_shape else 0, device))
    if micro_batches is not None:
        if micro_batches < len(out):
            raise ValueError(f"stage_inputs: {len(batch)} rows need {len(out)} micro-batches, more than "
                             f"micro_batches = {micro_batches}")
        empty = Batch(tensors={k: v[:0].to(device) for k, v in batch.tensors.items()},
                      meta={k: [] for k in batch.meta})
        out += [_stage_input(empty, batch_width, micro_batch_size, device) for _ in range(micro_batches - len(out))]
    return out


def _stage_input(micro: "Batch", width: int, rows: int, device: "torch.device") -> StageInputs:
    """``micro``'s model inputs cut to ``width`` columns and padded to ``rows`` rows (zeros)."""
    import torch

    ids = micro["input_ids"][:, :width]
    if ids.shape[1] < width:  # a row set narrower than the agreed width (expert parallelism)
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]))
    if ids.shape[0] < rows:
        ids = torch.nn.functional.pad(ids, (0, 0, 0, rows - ids.shape[0]))
    positions = torch.arange(width, device=device).unsqueeze(0).expand_as(ids)
    # Right padding never influences the real tokens before it: the causal mask is the whole mask.
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1)
    return StageInputs(micro=micro, input_ids=ids, position_ids=positions, attention_mask=causal[None, None])


def token_outputs(logits: "torch.Tensor", inputs: StageInputs, *, tp: int,
                  entropy_grad: bool) -> "tuple[torch.Tensor, torch.Tensor]":
    """Log-probs and entropies ``[rows, T]`` of a micro-batch's real rows from the last stage's
    logits ``[rows_padded, width, vocab / tp]`` at the tokens of its ``loss_mask`` (0 elsewhere,
    at padding and at position 0; every real token without a loss mask)."""
    # differentiable gather under TP > 1
    return _scored_token_outputs(constrained(_full_vocabulary(logits, tp), inputs), inputs, entropy_grad=entropy_grad)


def token_outputs_and_logits(logits: "torch.Tensor", inputs: StageInputs, *, tp: int, vocab: int,
                             entropy_grad: bool) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """:func:`token_outputs` plus the next-token logits ``[rows, T - 1, vocab]`` (float32, with
    gradient) that a vocabulary-level KL or distillation term of the host's loss reads.

    The logits follow the torch backend's layout: entry ``t`` scores token ``t + 1`` (the
    ``[B, T - 1, V]`` next-token layout the KL terms accept), columns past the micro-batch's
    width are zeros, ``T`` is the width of the caller's batch. Under TP > 1 the vocabulary shards
    are gathered once, for both outputs, by Megatron-Core's autograd-aware gather (its backward
    hands each rank the gradient of its own shard); only the first ``vocab`` entries (the Hugging
    Face vocabulary) are kept, Megatron's padding of its output layer dropped.
    """
    full = constrained(_full_vocabulary(logits, tp), inputs)
    logprobs, entropy = _scored_token_outputs(full, inputs, entropy_grad=entropy_grad)
    next_logits = full[:inputs.rows, :-1, :vocab].float()
    return logprobs, entropy, _fit_width(next_logits, inputs.micro["input_ids"].shape[1] - 1)


def _scored_token_outputs(logits: "torch.Tensor", inputs: StageInputs, *,
                          entropy_grad: bool) -> "tuple[torch.Tensor, torch.Tensor]":
    """:func:`token_outputs` from logits over the whole vocabulary ``[rows_padded, width, vocab]``."""
    import torch

    ids = inputs.input_ids[:inputs.rows]
    logprobs, entropy = logprobs_and_entropy(logits[:inputs.rows, :-1].float(), ids, entropy_grad=entropy_grad)
    real = _real_positions(inputs)
    loss_mask = inputs.micro.get("loss_mask")
    if loss_mask is not None:  # the scored tokens, as every train backend reports them (TrainWorker.forward)
        real = real & (_fit_width(loss_mask, inputs.width) > 0)
    logprobs = torch.where(real, logprobs, torch.zeros_like(logprobs))
    entropy = torch.where(real, entropy, torch.zeros_like(entropy))
    out_width = inputs.micro["input_ids"].shape[1]
    return _fit_width(logprobs, out_width), _fit_width(entropy, out_width)


def teacher_outputs(logits: "torch.Tensor", inputs: StageInputs, *, tp: int, vocab: int, topk: int,
                    return_logits: bool, logits_dtype: "torch.dtype",
                    device: "torch.device") -> "dict[str, torch.Tensor]":
    """A micro-batch's real rows in the layout of ``loongsage_hookspecs.TeacherOutputs``, on ``device``.

    From the last stage's logits ``[rows_padded, width, vocab_padded / tp]``: ``logprobs``
    ``[rows, T]``; with ``topk`` > 0 ``topk_ids`` / ``topk_logprobs`` ``[rows, T, topk]``
    (largest first); with ``return_logits`` the raw ``logits`` ``[rows, T, vocab]`` in
    ``logits_dtype``. Entry ``t`` describes the distribution that produced token ``t``; position 0
    and padding hold 0; ``T`` is the width of the caller's batch. Only the first ``vocab``
    entries (the Hugging Face vocabulary) count: Megatron may pad its output layer beyond it.
    """
    import torch
    import torch.nn.functional as F

    rows = inputs.rows
    raw = _full_vocabulary(logits, tp)[:rows, :-1, :vocab].float()  # entry t predicts token t + 1
    logprobs, topk_logprobs, topk_ids = sampled_logprobs_and_topk(raw, inputs.input_ids[:rows], topk)
    real = _real_positions(inputs)
    out = {"logprobs": torch.where(real, logprobs, 0.0)}
    keep = real.unsqueeze(-1)
    if topk_ids is not None and topk_logprobs is not None:
        out["topk_logprobs"] = torch.where(keep, topk_logprobs, 0.0)
        out["topk_ids"] = torch.where(keep, topk_ids, 0)
    if return_logits:
        out["logits"] = torch.where(keep, F.pad(raw, (0, 0, 1, 0)), 0.0).to(logits_dtype)
    out_width = inputs.micro["input_ids"].shape[1]
    return {key: _fit_width(value, out_width).to(device) for key, value in out.items()}


def constrained(logits: "torch.Tensor", inputs: StageInputs) -> "torch.Tensor":
    """``logits`` ``[rows_padded, width, vocab]`` with the positions that predict a constrained
    token (``inputs.micro.meta["constraints"]``) masked to the tokens the engine's grammar allowed
    there (replayed with the engine's code, ``loongsage_core.backend_api.grammar``), so the
    trainer scores the distribution the engine sampled; unchanged when the rows hold none."""
    import torch

    spans = inputs.micro.meta.get("constraints")
    if not spans or not any(spans):
        return logits
    if inputs.grammar_tokenizer is None:
        raise ValueError("megatron train backend: a micro-batch holds constrained turns but no tokenizer to "
                         "replay their grammars with")
    from loongsage_core.backend_api.grammar import allowed_sets, mask_logits

    rows, width, vocab = inputs.rows, logits.shape[1], logits.shape[-1]
    index_rows = torch.arange(rows).repeat_interleave(width - 1)
    index_cols = torch.arange(1, width).repeat(rows)
    allowed = allowed_sets(inputs.grammar_tokenizer, vocab, inputs.input_ids[:rows].detach().cpu(), spans,
                           index_rows, index_cols)
    if allowed is None:
        return logits
    head = mask_logits(logits[:rows, :-1].reshape(-1, vocab), allowed).view(rows, width - 1, vocab)
    return torch.cat([torch.cat([head, logits[:rows, -1:]], 1), logits[rows:]], 0)


def _full_vocabulary(logits: "torch.Tensor", tp: int) -> "torch.Tensor":
    """``logits`` over the whole vocabulary: gathered from the vocabulary-sharded output layer
    under TP > 1 (differentiably), as they are otherwise."""
    if tp == 1:
        return logits
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)


def _real_positions(inputs: StageInputs) -> "torch.Tensor":
    """``[rows, width]`` bool: the real (not padding) tokens of a micro-batch's real rows."""
    import torch

    ids = inputs.input_ids[:inputs.rows]
    attention = inputs.micro.get("attention_mask")
    return torch.ones_like(ids, dtype=torch.bool) if attention is None else _fit_width(attention, inputs.width) > 0


def _fit_width(tensor: "torch.Tensor", width: int) -> "torch.Tensor":
    """``tensor`` ``[rows, T, ...]`` cut or right-padded with zeros to ``width`` columns (axis 1)."""
    import torch

    if tensor.shape[1] >= width:
        return tensor[:, :width]
    return torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, width - tensor.shape[1]))


def run_schedule(chunks: list[Any], inputs: list[StageInputs], on_logits: Callable[[StageInputs, Any], Any], *,
                 forward_only: bool, routing: Any = None) -> list[Any]:
    """Run ``inputs`` through Megatron-Core's forward-backward schedule; returns what the last stage
    collected (``[]`` elsewhere).

    ``on_logits(inputs, logits)`` runs on the last pipeline stage once per micro-batch. Training
    (``forward_only`` false): it returns ``(loss, num_tokens, info)``, the loss already divided by
    the mini-batch's global norm; the model config's ``calculate_per_token_loss`` makes Megatron
    back-propagate that loss as it is (its 2-tuple convention would divide it by the number of
    micro-batches) and ``info`` is collected. Forward only: it returns what is collected, passed
    through as Megatron's non-loss data.

    Several model ``chunks`` (``backend_args.vpp``): Megatron-Core's interleaved 1F1B schedule,
    fed one iterator over ``inputs`` per chunk (each chunk runs every micro-batch once). It needs
    at least ``pp`` micro-batches (:func:`interleaved_inputs` adds all-padding ones, whose
    outputs ``on_logits`` never sees: they add no loss and collect nothing; their tokens still
    pass the MoE routers, like the padding positions of real rows) and a
    ``microbatch_group_size_per_vp_stage`` that fits their number (:func:`microbatch_group_size`).

    ``routing`` (Router Replay, :class:`.router_replay.MegatronRouterReplay`): its ``begin(item)``
    and ``end(item)`` run on every stage right before and after each micro-batch's forward through
    a chunk, so the routers of the chunk's layers get that micro-batch's recorded experts (under
    PP > 1 the schedule interleaves micro-batches); a layer recomputed in the backward pass
    replays the experts of its forward (:class:`.router_replay.LayerReplay`).
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    if not inputs:
        return []
    config = get_model_config(chunks[0])
    if not forward_only and not config.calculate_per_token_loss:
        raise RuntimeError("run_schedule: the model config must set calculate_per_token_loss (the host's loss "
                           "is normalised already)")
    real = len(inputs)
    if len(chunks) > 1:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        inputs = interleaved_inputs(inputs, pp)
        config.microbatch_group_size_per_vp_stage = microbatch_group_size(len(inputs), pp)
    padding = {id(item) for item in inputs[real:]}

    def forward_step(data: Iterator[StageInputs], model: Any) -> tuple[Any, Callable[..., Any]]:
        item = next(data)
        if routing is not None:
            routing.begin(item)
        try:
            output = model(input_ids=item.input_ids, position_ids=item.position_ids,
                           attention_mask=item.attention_mask)
        finally:
            if routing is not None:
                routing.end(item)

        def loss_func(logits: Any, non_loss_data: bool = False) -> Any:
            if id(item) in padding:  # added for the interleaved schedule: no loss, nothing collected
                return _PADDING if forward_only else (
                    logits.sum() * 0.0, logits.new_zeros((), dtype=torch.int), {})
            return on_logits(item, logits)

        return output, loss_func

    first = inputs[0]
    data: Any = [iter(inputs) for _ in chunks] if len(chunks) > 1 else iter(inputs)
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=len(inputs),
        seq_length=first.width, micro_batch_size=int(first.input_ids.shape[0]), forward_only=forward_only,
        collect_non_loss_data=forward_only)
    return [value for value in out if value is not _PADDING] if forward_only else out


_PADDING = object()
"""What an all-padding micro-batch of :func:`interleaved_inputs` collects in a forward-only schedule
(dropped before :func:`run_schedule` returns)."""


def interleaved_inputs(inputs: list[StageInputs], pp: int) -> list[StageInputs]:
    """``inputs`` followed by all-padding micro-batches up to ``pp`` of them: Megatron-Core's
    interleaved schedule refuses fewer micro-batches than pipeline stages (its
    ``microbatch_group_size_per_vp_stage`` is at least ``pp`` and at most their number)."""
    return inputs + [padding_like(inputs[0]) for _ in range(pp - len(inputs))]


def padding_like(item: StageInputs) -> StageInputs:
    """A micro-batch of ``item``'s shape without real rows (token 0 everywhere): under PP > 1 the
    stages exchange one fixed shape, so it runs like any other and its logits are dropped."""
    import torch

    from loongsage_hookspecs import Batch

    micro = Batch(tensors={key: value[:0] for key, value in item.micro.tensors.items()},
                  meta={key: [] for key in item.micro.meta})
    return StageInputs(micro=micro, input_ids=torch.zeros_like(item.input_ids), position_ids=item.position_ids,
                       attention_mask=item.attention_mask)


def microbatch_group_size(num_microbatches: int, pp: int) -> int:
    """Megatron-Core's ``microbatch_group_size_per_vp_stage`` for ``num_microbatches`` (>= ``pp``)
    under the interleaved schedule: the micro-batches one model chunk runs in a row before the
    next chunk takes them. The schedule refuses a size below ``pp`` or above the number of
    micro-batches, and a last group of fewer than ``pp``; the smallest size it accepts keeps the
    most micro-batches in flight across chunks (``pp``, Megatron-Core's default, whenever ``pp``
    divides the number)."""
    for size in range(pp, num_microbatches + 1):
        rest = num_microbatches % size
        if rest == 0 or rest >= pp:
            return size
    raise ValueError(f"microbatch_group_size: {num_microbatches} micro-batches are fewer than pp = {pp}")
