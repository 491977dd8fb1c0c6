"""Model FLOPs and MFU (loongsage_core/flops.py) against hand computations on a tiny model, and
the per-phase ``perf/mfu_*`` metrics of a real controller step."""

from __future__ import annotations

import pytest
import torch

from loongsage_core.flops import ModelShape, generation_flops, mfu, probe_matmul_flops, scoring_flops, table_peak_flops
from loongsage_hookspecs import Batch

TINY = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 512, "tie_word_embeddings": True}


def test_matmul_params_by_hand_and_by_the_model():
    shape = ModelShape.from_config(TINY)
    # q 32x32 + k, v 32x16 each + o 32x32 + gate, up, down 3 x 32x64 = 9216 per layer; head 512x32
    assert shape.matmul_params == 9216 + 16384 and shape.num_layers == 1 and shape.attention_width == 32
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == shape.matmul_params  # every matmul weight, the tied head included, once


def test_forward_training_and_generation_flops_by_hand():
    shape = ModelShape(matmul_params=1000, num_layers=2, attention_width=8)
    # 2 N S + 4 L d (1 + 2 + 3): S = 3
    assert shape.forward_flops(3) == 2 * 1000 * 3 + 4 * 2 * 8 * 6
    assert shape.training_flops(3) == 3 * shape.forward_flops(3)
    # two rows of one group (prompt 2 tokens, 3 and 1 generated) and one row of another (prompt 1, 2 generated)
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0]])
    batch = Batch(tensors={"attention_mask": attention, "loss_mask": loss_mask,
                           "group_index": torch.tensor([0, 0, 1])})
    f = shape.forward_flops
    assert scoring_flops(shape, batch) == f(5) + f(3) + f(3)
    # a trainer that runs a group's prompt once spends what generating the rows did
    assert scoring_flops(shape, batch, shared_prompts=True) == generation_flops(shape, batch)
    assert generation_flops(shape, batch) == pytest.approx((f(5) - f(2)) + (f(3) - f(2)) + f(2) + (f(3) - f(1)) + f(1))
    assert mfu(6e9, 2.0, 1e9, devices=3) == pytest.approx(1.0)
    assert mfu(1.0, 0.0, 1e9) == 0.0


def test_peak_from_the_table_and_the_probe():
    assert table_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert table_peak_flops("NVIDIA A100-SXM4-40GB", "float32") == 19.5e12
    assert table_peak_flops("Some Unknown GPU", "bfloat16") is None
    rate = probe_matmul_flops(size=128, repeats=2)
    assert 1e6 < rate < 1e15


def test_the_step_reports_mfu_per_phase_from_its_flops(controller_factory):
    # a fixed peak of 1 GFLOP/s: the metric must be the hand formula over the step's own timings
    c = controller_factory({"train": {"peak_tflops": 0.001}, "algorithm": {"force_old_logprob_pass": True}})
    m = c.run_step(0)
    shape = ModelShape.from_config(TINY)
    batch = c.run.learner.last_batch
    lengths = batch["attention_mask"].sum(1).tolist()
    prompts = (batch["loss_mask"] > 0).float().argmax(dim=1).tolist()

    def f(n):
        return 2 * shape.matmul_params * n + 2 * shape.num_layers * shape.attention_width * n * (n + 1)

    # the torch trainer runs each group's prompt once (SharesPrompts): the prompt counts once a group
    groups = {}
    for n, p, g in zip(lengths, prompts, batch["group_index"].tolist()):
        groups.setdefault(g, []).append((n, p))
    scored = sum(f(rows[0][1]) + sum(f(n) - f(p) for n, p in rows) for rows in groups.values())
    assert scored < sum(f(n) for n in lengths)
    assert 0 < m["perf/prompt_tokens_shared"] < 1  # and it did: a share of the step's tokens was not run
    assert m["perf/peak_tflops"] == pytest.approx(0.001)
    assert m["perf/mfu_train"] == pytest.approx(3 * scored / (m["timing/policy_train"] * 1e9), rel=1e-9)
    assert m["perf/mfu_logprob"] == pytest.approx(scored / (m["timing/old_logprobs"] * 1e9), rel=1e-9)
    assert m["perf/mfu_rollout"] > 0
    # without the pass there is no scoring phase to report; the peak is probed on a CPU
    skipped = controller_factory().run_step(0)
    assert "perf/mfu_logprob" not in skipped and 0 < skipped["perf/mfu_train"] < 2.0
    assert skipped["perf/peak_tflops"] > 0
