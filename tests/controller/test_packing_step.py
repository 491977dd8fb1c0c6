"""A real step with padding-free micro-batches (``[train] max_tokens_per_micro_batch``) makes
the same update as the padded micro-batches, with and without the separate old-log-prob pass."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("forced", [False, True])
def test_a_packed_step_makes_the_padded_update(controller_factory, forced):
    alg = {"algorithm": {"force_old_logprob_pass": forced}}
    padded = controller_factory(alg)
    packed = controller_factory({**alg, "train": {"max_tokens_per_micro_batch": 64}})
    groups, _, _ = padded.collect(0)
    a, _ = padded.run.learner.learn(groups, 0)
    b, _ = packed.run.learner.learn(groups, 0)
    assert a["perf/old_logprob_pass_skipped"] == b["perf/old_logprob_pass_skipped"] == float(not forced)
    for key in ("train/loss", "train/grad_norm", "train/is_approx_k3_kl", "train/entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    # the old log-probs come back in the batch's row order whichever micro-batch scored them
    torch.testing.assert_close(packed.run.learner.last_batch["old_logprobs"],
                               padded.run.learner.last_batch["old_logprobs"], rtol=1e-5, atol=2e-5)
    # AdamW moves every element by about lr (1e-3) whatever its gradient's size, so float32 noise on
    # a near-zero gradient shows as a few percent of one step; the gradients themselves are compared
    # tightly in plugins/loongsage-plugin-torch/tests/test_packing.py
    wa = padded.trainer.worker.model.state_dict()
    for k, v in packed.trainer.worker.model.state_dict().items():
        torch.testing.assert_close(v, wa[k], rtol=0.0, atol=5e-5)
