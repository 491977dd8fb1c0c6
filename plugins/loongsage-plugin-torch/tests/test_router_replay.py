"""Router Replay in the torch trainer: a tiny Qwen3-MoE routes each token to the recorded experts.

The reference is written here, apart from the backend: the transformers model with each router's
``forward`` replaced by one that returns the given experts (gating weights from the softmax of
the current logits, renormalised), one row at a time, unpadded. The worker's replayed log-probs
(padded, packed, with shared prompts), its gradients into the router weights (against that
reference in float64), its agreement metrics and its unreplayed pass are checked against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_plugin_torch.trainer import create_train_worker
from torch_test_support import prompt_group_tensors

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, JobConfig, ModelConfig, TrainConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import AggregationSpec, Batch, PolicyLossOutput, PolicyLossSpec, TrainWorkerContext

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")
MOE = {**TINY_QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 24, "norm_topk_prob": True, "mlp_only_layers": [0], "num_hidden_layers": 3}
LAYERS, TOP_K, EXPERTS = MOE["num_hidden_layers"], 2, 4
MOE_LAYERS = [i for i in range(LAYERS) if i not in MOE["mlp_only_layers"]]


def ratio_pg(x):
    return PolicyLossOutput(loss=-x.advantages * torch.exp(x.logprobs - x.old_logprobs), metrics={})


def token_mean(loss, mask, norm):
    return (loss * mask).sum() / norm.num_tokens


def make_worker(*, replay: bool = True, compare: bool = True, max_tokens: int | None = None, config: dict = MOE,
                **backend_args):
    host = PluginHost.create(enable=["torch"])
    host.register_specs(PolicyLossSpec(name="ratio_pg", fn=ratio_pg), AggregationSpec(name="token_mean", fn=token_mean))
    job = JobConfig(model=ModelConfig(config=dict(config), tokenizer=TOKENIZER, seed=5),
                    train=TrainConfig(lr=1e-3, grad_clip=0.0, micro_batch_size=7, max_tokens_per_micro_batch=max_tokens,
                                      backend_args=backend_args),
                    algorithm=AlgorithmConfig(policy_loss="ratio_pg", loss_agg="token_mean", router_replay=replay,
                                              router_replay_compare=compare))
    return create_train_worker(TrainWorkerContext(job=job, components=host))


def group_batch(seed: int = 0) -> Batch:
    """Two prompts (7 and 10 tokens) with three completions each, and a row of its own, every row
    right-padded."""
    tensors = prompt_group_tensors(seed, shortest=3, padding=2)
    rows = len(tensors["input_ids"])
    return Batch(tensors=tensors, meta={"trajectory_id": [f"t{i}" for i in range(rows)], "segment": [0] * rows})


def own_choices(model: Any, batch: Batch, moe_layers: list[int] = MOE_LAYERS) -> torch.Tensor:
    """``[B, T, layers, E]`` the expert ranking (best first) each router of ``model`` gives each
    token, one unpadded row at a time; -1 on padding and in dense layers."""
    B, T = batch["input_ids"].shape
    out = torch.full((B, T, LAYERS, EXPERTS), -1, dtype=torch.long)
    for r in range(B):
        n = int(batch["attention_mask"][r].sum())
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"][r:r + 1, :n], output_router_logits=True).router_logits
        for layer, lg in zip(moe_layers, logits):
            out[r, :n, layer] = torch.softmax(lg.float(), dim=-1).argsort(dim=-1, descending=True)
    return out


def routes_of(choices: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """int16 ``[B, T, layers * top_k]``: for each token and MoE layer, the experts at ``ranks``
    (``[B, T, layers, top_k]`` positions into the ranking)."""
    picked = choices.gather(-1, ranks.clamp(min=0))
    picked[choices[..., :TOP_K] < 0] = -1
    return picked.flatten(2).to(torch.int16)


def differing_ranks(batch: Batch, seed: int = 1) -> torch.Tensor:
    """Ranks that replace the model's top-2 by its 2nd and 3rd choices on about half of the
    token-layers, the same for tokens that share a prompt (same token at the same position)."""
    B, T = batch["input_ids"].shape
    g = torch.Generator().manual_seed(seed)
    by_token = torch.rand(512, T, LAYERS, generator=g) < 0.5
    swap = by_token[batch["input_ids"], torch.arange(T)[None, :].expand(B, T)]  # [B, T, layers]
    ranks = torch.tensor([0, 1]).expand(B, T, LAYERS, TOP_K).clone()
    ranks[swap] = torch.tensor([1, 2])
    return ranks


def forced_routing_log_probs(model: Any, batch: Batch, routes: torch.Tensor,
                             moe_layers: list[int] = MOE_LAYERS) -> torch.Tensor:
    """The reference: each row alone, every router forced to ``routes`` by replacing its forward."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    for r in range(len(batch)):
        n = int(batch["attention_mask"][r].sum())
        row_routes = routes[r, :n].long().view(n, LAYERS, TOP_K)
        originals = {}
        for layer in moe_layers:
            gate = model.model.layers[layer].mlp.gate
            originals[layer] = gate.forward

            def forced(hidden, gate=gate, ids=row_routes[:, layer]):
                logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
                weights = torch.softmax(logits, dim=-1, dtype=torch.float64).gather(-1, ids)
                weights = weights / weights.sum(dim=-1, keepdim=True)
                return logits, weights.to(logits.dtype), ids

            gate.forward = forced
        try:
            logits = model(input_ids=batch["input_ids"][r:r + 1, :n]).logits[0]
        finally:
            for layer, fn in originals.items():
                model.model.layers[layer].mlp.gate.forward = fn
        lp = torch.log_softmax(logits.double(), dim=-1)[:-1].gather(-1, batch["input_ids"][r, 1:n, None])[:, 0]
        out[r, 1:n] = lp
    return out * batch["loss_mask"]


def test_replaying_the_models_own_routing_changes_nothing_bit_for_bit():
    batch = group_batch()
    plain, replayed = make_worker(replay=False), make_worker(compare=False)
    batch.tensors["routed_experts"] = routes_of(own_choices(plain.model, batch), torch.tensor([0, 1]).expand(
        *batch["input_ids"].shape, LAYERS, TOP_K))
    a, b = plain.forward(batch)["logprobs"], replayed.forward(batch)["logprobs"]
    assert float(a.abs().sum()) > 0 and torch.equal(a, b)
    batch.tensors["old_logprobs"] = a.clone()
    norm = compute_norm(batch)
    ma, mb = plain.accumulate_gradients(batch, norm), replayed.accumulate_gradients(batch, norm)
    assert ma["train/loss"] == mb["train/loss"]
    for (name, p), q in zip(plain.model.named_parameters(), replayed.model.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize(("max_tokens", "share"), [(None, False), (None, True), (40, False), (40, True)],
                         ids=["padded", "shared_prompts", "packed", "packed_shared_prompts"])
def test_replayed_log_probs_are_those_of_the_recorded_experts(max_tokens, share):
    batch = group_batch(seed=2)
    worker = make_worker(compare=False, max_tokens=max_tokens, share_prompts=share)
    choices = own_choices(worker.model, batch)
    batch.tensors["routed_experts"] = routes_of(choices, differing_ranks(batch))
    want = forced_routing_log_probs(worker.model, batch, batch["routed_experts"])
    got = worker.forward(batch)["logprobs"]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)
    # the replay mattered: routing on its own gives other log-probs
    unreplayed = make_worker(replay=False, max_tokens=max_tokens, share_prompts=share).forward(batch)["logprobs"]
    assert float((unreplayed - got).abs().max()) > 1e-3


def test_gradients_reach_the_router_weights_as_in_a_float64_reference():
    batch = group_batch(seed=3)
    worker = make_worker(compare=False)
    batch.tensors["routed_experts"] = routes_of(own_choices(worker.model, batch), differing_ranks(batch, seed=4))
    old = worker.forward(batch)["logprobs"]
    batch.tensors["old_logprobs"] = old.clone()
    worker.accumulate_gradients(batch, compute_norm(batch))

    reference = make_worker(replay=False).model.double()  # the same initial weights (same seed), float64
    reference.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    lp = forced_routing_log_probs(reference, batch, batch["routed_experts"])
    mask = batch["loss_mask"].double()
    loss = (-batch["advantages"].double() * torch.exp(lp - lp.detach()) * mask).sum() / mask.sum()
    loss.backward()
    for layer in MOE_LAYERS:
        got = worker.model.model.layers[layer].mlp.gate.weight.grad
        want = reference.model.layers[layer].mlp.gate.weight.grad
        assert float(want.abs().max()) > 1e-4, "the reference's router learns nothing"
        torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=1e-6)


def test_the_scoring_pass_reports_agreement_and_the_unreplayed_log_probs():
    batch = group_batch(seed=5)
    worker, plain = make_worker(share_prompts=False), make_worker(replay=False, share_prompts=False)
    choices = own_choices(worker.model, batch)
    B, T = batch["input_ids"].shape
    ranks = torch.tensor([0, 1]).expand(B, T, LAYERS, TOP_K).clone()
    changed = torch.zeros(B, T, dtype=torch.bool)
    changed[:, 2::3] = True
    ranks[:, :, MOE_LAYERS[0]][changed] = torch.tensor([2, 3])  # one of the two MoE layers, every third token
    batch.tensors["routed_experts"] = routes_of(choices, ranks)
    real = batch["attention_mask"] > 0
    batch.tensors["routed_experts"][:, -1] = -1  # a column without a record: not measured
    measured = real.clone()
    measured[:, -1] = False

    out = worker.forward(batch)
    assert set(out) == {"logprobs", "entropy", "router_agreement", "logprobs_no_replay", "router_agreement_no_replay"}
    assert bool((out["router_agreement"][measured] == 1.0).all())
    assert bool((out["router_agreement"][~measured] == -1.0).all())
    assert bool((out["router_agreement_no_replay"][~measured] == -1.0).all())
    want = torch.where(changed, 0.5, 1.0)  # a changed token disagrees in one of its two MoE layers
    assert torch.equal(out["router_agreement_no_replay"][measured], want[measured])
    assert torch.equal(out["logprobs_no_replay"], plain.forward(batch)["logprobs"])
    assert float((out["logprobs"] - out["logprobs_no_replay"]).abs().max()) > 1e-3
    # with shared prompts a group's prompt runs once: its other copies are not measured, the rest alike
    shared = make_worker().forward(batch)
    run = shared["router_agreement"] >= 0
    assert bool((run <= measured).all()) and bool(run[batch["loss_mask"] > 0].all()) and int((measured & ~run).sum())
    for key in ("router_agreement", "router_agreement_no_replay"):
        assert torch.equal(shared[key][run], out[key][run]) and bool((shared[key][~run] == -1).all())


def test_a_mixtral_router_is_replayed_too():
    # Mixtral: every layer sparse, top-k weights always renormalised (its router has no norm_topk_prob)
    mixtral = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
               "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "max_position_embeddings": 512}
    batch = group_batch(seed=6)
    plain, replayed = make_worker(replay=False, config=mixtral), make_worker(compare=False, config=mixtral)
    choices = own_choices(plain.model, batch, moe_layers=list(range(LAYERS)))
    batch.tensors["routed_experts"] = routes_of(choices, torch.tensor([0, 1]).expand(
        *batch["input_ids"].shape, LAYERS, TOP_K))
    assert torch.equal(replayed.forward(batch)["logprobs"], plain.forward(batch)["logprobs"])
    batch.tensors["routed_experts"] = routes_of(choices, differing_ranks(batch))
    want = forced_routing_log_probs(replayed.model, batch, batch["routed_experts"], moe_layers=list(range(LAYERS)))
    got = replayed.forward(batch)["logprobs"]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)
    assert float((got - plain.forward(batch)["logprobs"]).abs().max()) > 1e-3  # the replay mattered


def test_a_model_without_experts_refuses_router_replay():
    host = PluginHost.create(enable=["torch"])
    job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER),
                    algorithm=AlgorithmConfig(router_replay=True))
    with pytest.raises(ValueError, match="router_replay = true, but the model has no mixture-of-experts layers"):
        create_train_worker(TrainWorkerContext(job=job, components=host))
