"""Helpers several of the torch plugin's tests share (importable: ``conftest.py`` puts this
folder on ``sys.path``)."""

from __future__ import annotations

import torch


def prompt_group_tensors(seed: int = 0, *, shortest: int = 2, padding: int = 0) -> dict[str, torch.Tensor]:
    """A GRPO-like batch's tensors: two prompts (7 and 10 tokens) with three completions each
    (``shortest`` to 11 tokens), then a row of its own; the rows of a prompt share its tokens
    exactly, their completions differ in content and length. ``padding`` extra columns of right
    padding on every row."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 512, (7,), generator=g), torch.randint(1, 512, (10,), generator=g)]
    rows = [(prompts[i // 3], int(torch.randint(shortest, 12, (1,), generator=g))) for i in range(6)]
    rows.append((torch.randint(1, 512, (5,), generator=g), 9))
    width = max(len(p) + n for p, n in rows) + padding
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, (prompt, n) in enumerate(rows):
        ids[r, :len(prompt)] = prompt
        ids[r, len(prompt):len(prompt) + n] = torch.randint(1, 512, (n,), generator=g)
        attention[r, :len(prompt) + n] = 1
        loss_mask[r, len(prompt):len(prompt) + n] = 1
    adv = torch.randn(len(rows), 1, generator=g) * loss_mask
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "advantages": adv.float()}
