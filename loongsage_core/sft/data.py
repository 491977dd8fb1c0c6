"""SFT data: ``[[data]]`` rows to rendered examples, the held-back split, steps and packed rows.

Every row of every source is used once per epoch (source ``weight``s are for RL mixing and do
not apply). The held-back rows are chosen once from ``[run] seed``; the training rows are
shuffled per epoch by ``(seed, epoch)``, so a resumed run draws exactly the steps an
uninterrupted run would. A step holds ``[train] mini_batch_size`` examples; packing only changes
how a step's examples are laid into rows, never which examples a step trains.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any, Sequence

import attrs

from ..config import ConfigError, JobConfig, SftConfig
from ..data_sources import read_source
from .render import ConversationError, Example, render_conversation

if TYPE_CHECKING:  # pragma: no cover
    from loongsage_hookspecs import Batch

    from ..agentflow.tito import ChatRenderer


@attrs.define
class SftData:
    """The rendered training and held-back examples of a job."""

    train: list[Example]
    eval: list[Example]

    def steps_per_epoch(self, mini_batch_size: int) -> int:
        return math.ceil(len(self.train) / mini_batch_size)


def load_examples(job: JobConfig, renderer: "ChatRenderer", components: Any) -> list[Example]:
    """Every conversation of every ``[[data]]`` source, rendered (cut to ``max_seq_len`` tokens).

    A row without the messages column, or whose conversation cannot be trained on, is a
    :class:`ConfigError` naming the source and the row.
    """
    cfg = job.sft or SftConfig()
    examples: list[Example] = []
    for index in range(len(job.data)):
        where = job.data_where(index)
        count = 0
        for loc, row in read_source(job, index, components):
            count += 1
            if cfg.messages_key not in row:
                raise ConfigError(f"{where}: {loc}: no '{cfg.messages_key}' column (sft.messages_key); "
                                  f"the row has: {', '.join(sorted(row)) or 'nothing'}")
            tools = row.get(cfg.tools_key) if cfg.tools_key else None
            try:
                rendered = render_conversation(renderer, row[cfg.messages_key], tools, loss_on=cfg.loss_on)
            except ConversationError as exc:
                raise ConfigError(f"{where}: {loc}: {cfg.messages_key}: {exc}") from None
            for ex in rendered:
                cut = Example(tokens=ex.tokens[:cfg.max_seq_len], loss_mask=ex.loss_mask[:cfg.max_seq_len])
                if cut.num_loss_tokens:
                    examples.append(cut)
        if count == 0:
            raise ConfigError(f"{where}: the data source is empty")
    if not examples:
        raise ConfigError(f"{job.source_path or '<job>'}: no example has a loss token within sft.max_seq_len = "
                          f"{cfg.max_seq_len}")
    return examples


def split_eval(examples: Sequence[Example], cfg: SftConfig, seed: int, where: str) -> SftData:
    """Hold back ``eval_rows`` (or ``eval_fraction`` of the) examples, chosen by ``seed``."""
    n_eval = cfg.eval_rows or int(round(cfg.eval_fraction * len(examples)))
    if n_eval >= len(examples):
        raise ConfigError(f"{where}: sft: {n_eval} held-back rows leave nothing to train on "
                          f"({len(examples)} examples); lower sft.eval_rows or sft.eval_fraction")
    order = list(range(len(examples)))
    random.Random(f"sft-eval-{seed}").shuffle(order)
    held = set(order[:n_eval])
    return SftData(train=[e for i, e in enumerate(examples) if i not in held],
                   eval=[examples[i] for i in sorted(held)])


def step_examples(data: SftData, step: int, mini_batch_size: int, *, seed: int, shuffle: bool) -> list[Example]:
    """The training examples of optimizer step ``step`` (0-based, counted over every epoch)."""
    per_epoch = data.steps_per_epoch(mini_batch_size)
    epoch, index = divmod(step, per_epoch)
    order = list(range(len(data.train)))
    if shuffle:
        random.Random(f"sft-{seed}-{epoch}").shuffle(order)
    chosen = order[index * mini_batch_size:(index + 1) * mini_batch_size]
    return [data.train[i] for i in chosen]


def pack(examples: Sequence[Example], max_seq_len: int) -> list[list[Example]]:
    """Examples laid into rows of at most ``max_seq_len`` tokens (first fit, in order)."""
    rows: list[list[Example]] = []
    lengths: list[int] = []
    for ex in examples:
        n = len(ex.tokens)
        for i, used in enumerate(lengths):
            if used + n <= max_seq_len:
                rows[i].append(ex)
                lengths[i] += n
                break
        else:
            rows.append([ex])
            lengths.append(n)
    return rows


def make_batch(rows: Sequence[Sequence[Example]], pad_id: int, *, packed: bool) -> "Batch":
    """A right-padded :class:`~loongsage_hookspecs.Batch` of ``rows`` (each a list of examples).

    Tensors: ``input_ids``, ``attention_mask``, ``loss_mask`` and the zeros the loss pipeline
    requires (``advantages``, ``old_logprobs``). Packed rows also get ``position_ids`` restarting at
    0 for each example (and for the padding), which confines attention to each example.
    """
    import torch

    from loongsage_hookspecs import Batch

    width = max(sum(len(e.tokens) for e in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for ex in row:
            n = len(ex.tokens)
            ids[r, at:at + n] = torch.tensor(ex.tokens)
            mask[r, at:at + n] = torch.tensor(ex.loss_mask, dtype=torch.float32)
            positions[r, at:at + n] = torch.arange(n)
            at += n
        attention[r, :at] = 1
        positions[r, at:] = torch.arange(width - at)
    tensors = {"input_ids": ids, "attention_mask": attention, "loss_mask": mask,
               "advantages": torch.zeros_like(mask), "old_logprobs": torch.zeros_like(mask)}
    if packed:
        tensors["position_ids"] = positions
    return Batch(tensors=tensors)


def step_batch(examples: Sequence[Example], cfg: SftConfig, pad_id: int) -> "Batch":
    """The batch of one step's examples: packed rows, or one row per example."""
    rows = pack(examples, cfg.max_seq_len) if cfg.packing else [[e] for e in examples]
    return make_batch(rows, pad_id, packed=cfg.packing)
