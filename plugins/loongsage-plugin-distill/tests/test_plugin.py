"""The plugin's registration: names, input levels, import cost, and use through the host."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from loongsage_plugin_distill import plugin, terms

from loongsage_hookspecs import AggregationNorm, Batch

KL_NAMES = {
    "opd_pg": "logprobs", "opd_k2": "logprobs", "opd_k3": "logprobs", "opd_topk_kl": "topk",
    "opd_full_kl": "logits", "opd_jsd": "logits", "opd_mix": "logprobs", "opd_mix_topk": "topk",
    "opd_mix_logits": "logits",
}


def test_registered_components_and_their_input_levels():
    kls = {s.name: s for s in plugin.loongsage_kls()}
    assert {n: s.requires for n, s in kls.items()} == KL_NAMES
    assert all(s.description for s in kls.values())
    assert [s.name for s in plugin.loongsage_teachers()] == ["torch"]
    for name, spec in kls.items():
        if name.startswith("opd_mix"):
            assert isinstance(spec.fn, terms.MixTerm) and spec.fn.requires == spec.requires


def test_plugin_module_imports_without_torch():
    probe = ("import json, sys, loongsage_plugin_distill.plugin as p\n"
             "names = [s.name for s in p.loongsage_kls()] + [s.name for s in p.loongsage_teachers()]\n"
             "print(json.dumps([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')]))\n")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_host_selects_components_by_name_and_the_loss_pipeline_runs_them():
    from loongsage_core.algorithms import LossPipeline
    from loongsage_core.config import AlgorithmConfig, JobConfig
    from loongsage_core.plugins import PluginHost

    host = PluginHost.create(enable=["rl", "distill"])
    assert set(KL_NAMES) <= set(host.components("kl"))
    assert host.get("teacher", "torch").factory is not None

    g = torch.Generator().manual_seed(0)
    rows, width, vocab = 2, 5, 7
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    student = torch.randn(rows, width - 1, vocab, generator=g).requires_grad_(True)  # next-token layout
    teacher = torch.randn(rows, width, vocab, generator=g)  # aligned layout
    log_s = torch.nn.functional.pad(torch.log_softmax(student, -1), (0, 0, 1, 0))
    logprobs = log_s.gather(-1, ids[..., None])[..., 0]
    ref = torch.log_softmax(teacher, -1).gather(-1, ids[..., None])[..., 0]
    micro = Batch(tensors={"input_ids": ids, "loss_mask": mask, "advantages": torch.zeros(rows, width),
                           "rollout_logprobs": logprobs.detach(), "ref_logprobs": ref, "ref_logits": teacher})
    job = JobConfig(algorithm=AlgorithmConfig(policy_loss="ppo_clip", loss_agg="token_mean", kl="opd_full_kl",
                                              kl_args={"direction": "reverse"}, kl_coef=1.0))
    pipeline = LossPipeline.from_job(job, host)
    assert pipeline.needs_logits
    norm = AggregationNorm(num_tokens=float(mask.sum()), num_sequences=2.0, max_response_length=3.0)
    loss, _ = pipeline.loss(micro, logprobs, None, norm, logits=student)
    # zero advantages: the loss is the token mean of the exact reverse KL
    log_q = torch.log_softmax(teacher, -1)
    kl = (log_s.exp() * (log_s - log_q)).sum(-1)
    torch.testing.assert_close(loss, (kl * mask).sum() / mask.sum())
