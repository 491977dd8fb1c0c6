"""Attention in query blocks over the keys each block sees (trainer.banded_attention): the same
outputs and gradients as one masked attention over the whole sequence, for full and windowed
layers, rows that start at an offset, padding and grouped-query heads; and the trainer's forward
through it (padded rows and packed ones) equal to its forward through transformers' masks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_plugin_torch.trainer import banded_attention, logits, packing, prompt_tree

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")
SLIDING = {**TINY_QWEN3, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}
ALL_SLIDING = {**SLIDING, "max_window_layers": 0}


def reference(q, k, v, offset, q_valid, k_valid, window):
    """One SDPA over all keys under the whole mask, built here from the definition."""
    q_pos = offset[:, None] + torch.arange(q.shape[2])[None]
    k_pos = torch.arange(k.shape[2])
    visible = (k_pos[None, None] <= q_pos[:, :, None]) & k_valid[:, None, :]
    if window is not None:
        visible &= k_pos[None, None] > q_pos[:, :, None] - window
    visible[:, :, 0] |= ~visible.any(dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=True)


@pytest.mark.parametrize("window", [None, 5, 16])
def test_blocks_give_the_whole_masked_attention(window, monkeypatch):
    monkeypatch.setattr(banded_attention, "BLOCK", 8)
    g = torch.Generator().manual_seed(0)
    S, H, KV, Q, K, D = 3, 4, 2, 37, 45, 8
    offset = torch.tensor([8, 0, 3])
    q_valid = torch.arange(Q)[None] < torch.tensor([37, 30, 12])[:, None]
    k_valid = torch.arange(K)[None] < (offset + q_valid.sum(dim=1))[:, None]
    tensors = [torch.randn(S, n, L, D, generator=g, requires_grad=True) for n, L in ((H, Q), (KV, K), (KV, K))]
    layout = banded_attention.BandedLayout(q_offset=offset, q_valid=q_valid, k_valid=k_valid)
    got = banded_attention.banded_sdpa(*tensors, layout, window=window)
    want = reference(*tensors, offset, q_valid, k_valid, window)
    real = q_valid[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    weights = torch.randn(got.shape, generator=g) * real
    grads = [torch.autograd.grad((out * weights).sum(), tensors) for out in (got, want)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # a windowed block reads its band only: the last block of 5 queries, window 5, keys 28..44
    if window == 5:
        assert layout.band(32, 37, K, 5) == (32 - 4, 45)  # from the earliest-starting row's window


def make_worker(model: dict, max_tokens: int | None):
    from loongsage_plugin_torch.trainer import create_train_worker

    from loongsage_core.config import AlgorithmConfig, JobConfig, ModelConfig, TrainConfig
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import TrainWorkerContext

    job = JobConfig(model=ModelConfig(config=dict(model), tokenizer=TOKENIZER),
                    train=TrainConfig(lr=1e-3, grad_clip=0.0, micro_batch_size=4,
                                      max_tokens_per_micro_batch=max_tokens),
                    algorithm=AlgorithmConfig(policy_loss="ppo_clip", loss_agg="token_mean"))
    return create_train_worker(TrainWorkerContext(job=job, components=PluginHost.create(enable=["torch", "rl"])))


@pytest.mark.parametrize("max_tokens", [None, 200], ids=["padded", "packed"])
@pytest.mark.parametrize("model", [TINY_QWEN3, SLIDING, ALL_SLIDING], ids=["full", "mixed", "sliding"])
def test_the_trainers_forward_in_blocks_equals_its_masked_forward(model, max_tokens, monkeypatch):
    """Rows of up to 40 tokens, blocks of 8: log-probs, entropies and gradients of the block path
    equal those of the masked path (blocks larger than any row), padded rows and packed ones."""
    worker = make_worker(model, max_tokens)
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([40, 23, 31, 9])
    attention = (torch.arange(40)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 512, (4, 40), generator=g) * attention
    scored = (torch.arange(40)[None] >= 3) & (attention > 0)
    calls: list[int | None] = []
    real = banded_attention.banded_sdpa

    def spy(*args, window, **kwargs):
        calls.append(window)
        return real(*args, window=window, **kwargs)

    monkeypatch.setattr(banded_attention, "banded_sdpa", spy)
    monkeypatch.setattr(prompt_tree, "banded_sdpa", spy)
    outputs = {}
    for block in (8, 4096):
        monkeypatch.setattr(banded_attention, "BLOCK", block)
        worker.model.zero_grad(set_to_none=True)
        if max_tokens is None:
            out = logits.next_token_logits(worker.model, ids, attention, compute_dtype=torch.float32,
                                           fp32_lm_head=False, scored=scored)
            lp = torch.log_softmax(out, dim=-1).gather(-1, ids[:, 1:][scored[:, 1:]][:, None])
            ent = out.logsumexp(-1)
        else:
            lp, ent = packing.packed_token_outputs(worker.model, ids, attention, compute_dtype=torch.float32,
                                                   fp32_lm_head=False, entropy_grad=True, scored=scored,
                                                   one_row=True)
        (lp.sum() + ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in worker.model.named_parameters() if p.grad is not None}
        outputs[block] = (lp.detach(), ent.detach(), grads)
        assert worker.model.config._attn_implementation == "sdpa"  # switched back after the forward
        if block == 8:
            layers = worker.model.config.num_hidden_layers
            assert len(calls) == layers  # every layer went through the blocks
            assert (None in calls) == (model is not ALL_SLIDING) and (6 in calls) == (model is not TINY_QWEN3)
    torch.testing.assert_close(outputs[8][0], outputs[4096][0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(outputs[8][1], outputs[4096][1], rtol=1e-5, atol=2e-5)
    assert outputs[8][2].keys() == outputs[4096][2].keys()
    for name, grad in outputs[4096][2].items():
        torch.testing.assert_close(outputs[8][2][name], grad, rtol=1e-4, atol=1e-5, msg=name)
