"""Router Replay (``[algorithm] router_replay``) in the megatron train backend on the tiny Qwen3-MoE
of ``megatron_test_support`` (CPU).

The reference is the torch backend's: the transformers model with the same weights and
``loongsage_plugin_torch.trainer.router_replay.RouterReplay`` replaying the same records (for the
gradients, the torch train worker). The records replace the model's own top-2 by its 2nd and 3rd
choices on about two thirds of the token-layers and leave some token-layers without a record (the
model then routes on its own), so a backend that ignored them, misaligned them with the tokens or
handed a router another layer's ids would fail. EP = 2 (rows split unevenly, one rank running an
all-padding micro-batch) and PP = 2 (each stage one layer) run in two spawned ranks.
"""

from __future__ import annotations

import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

from loongsage_plugin_megatron import plugin
from loongsage_plugin_torch.trainer import create_train_worker as create_torch_worker
from megatron_test_support import (
    TINY_MOE_LAYERS,
    TINY_MOE_TOP_K,
    grpo_batch,
    hf_token_outputs,
    make_batch,
    own_ranking,
    records,
    rendezvous_ports,
    replay_job,
    replayed_reference,
    run_ranks,
    save_tiny_moe,
    with_routes,
)

from loongsage_core.algorithms import compute_norm
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Batch, TrainWorkerContext

LAYERS, TOP_K = TINY_MOE_LAYERS, TINY_MOE_TOP_K
COMPARE_KEYS = {"logprobs", "entropy", "router_agreement", "logprobs_no_replay", "router_agreement_no_replay"}


def expected_agreement(ranking: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: per token, the share of its layers with a record where the model's own top-2 (as a
    set) is the record; -1 for a token without any record."""
    own = ranking[..., :TOP_K].sort(dim=-1).values
    recorded = routes.long().view(*routes.shape[:2], LAYERS, TOP_K).sort(dim=-1).values
    has = (recorded >= 0).all(dim=-1)
    share = ((own == recorded).all(dim=-1) & has).sum(-1) / has.sum(-1).clamp(min=1)
    return torch.where(has.any(dim=-1), share.float(), -1.0)


def without_routes(batch: Batch) -> Batch:
    return Batch(tensors={k: v for k, v in batch.tensors.items() if k != "routed_experts"}, meta=batch.meta)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(Hugging Face directory, transformers model with its weights)."""
    out = str(tmp_path_factory.mktemp("tiny_qwen3_moe_replay"))
    return out, save_tiny_moe(out)


@pytest.fixture(scope="module")
def scored(moe, host):
    """The EP = 1 actor's ``forward()`` of a batch with differing records, and what the test needs
    to check it."""
    path, hf = moe
    worker = plugin.create_train_worker(TrainWorkerContext(job=replay_job(path), components=host))
    try:
        batch = make_batch()
        ranking = own_ranking(hf, batch)
        batch = with_routes(batch, records(ranking, batch, differ=True))
        yield worker, batch, ranking, worker.forward(batch)
    finally:
        worker.close()


def test_replayed_logprobs_equal_the_torch_backends_replay(scored, moe):
    _, batch, _, got = scored
    hf = moe[1]
    want, unreplayed = replayed_reference(hf, batch), hf_token_outputs(hf, batch)
    assert set(got) == COMPARE_KEYS
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5)
    # the records matter: a backend routing on its own would be far off
    assert float((want["logprobs"] - unreplayed["logprobs"]).abs().max()) > 1e-2
    # ... which is what the comparison pass without replay returns
    torch.testing.assert_close(got["logprobs_no_replay"], unreplayed["logprobs"], rtol=0, atol=1e-5)


def test_forward_reports_the_router_agreement_with_and_without_replay(scored):
    from megatron.core.transformer.moe.router_replay import RouterReplay as CoreRouterReplay

    worker, batch, ranking, got = scored
    # each router replays through its own Megatron-Core RouterReplay, outside the process-wide list
    assert [layer for layer, _, _ in worker.router_replay.routers] == list(range(LAYERS))
    for _, router, replay in worker.router_replay.routers:
        assert router.router_replay is replay and isinstance(replay, CoreRouterReplay)
        assert replay not in CoreRouterReplay.global_router_replay_instances
    recorded = (batch["routed_experts"].view(*batch["input_ids"].shape, LAYERS, TOP_K) >= 0).all(-1).any(-1)
    assert bool((got["router_agreement"][recorded] == 1.0).all())
    assert bool((got["router_agreement"][~recorded] == -1.0).all())
    want = expected_agreement(ranking, batch["routed_experts"])
    assert 0.2 < float(want[recorded].mean()) < 0.8  # the records differ from the model's choice, not everywhere
    assert torch.equal(got["router_agreement_no_replay"], want)


def test_replaying_the_models_own_routing_changes_nothing(scored, moe):
    worker, batch, ranking, _ = scored
    own = with_routes(batch, records(ranking, batch, differ=False))
    got = worker.forward(own)
    assert bool((got["router_agreement_no_replay"][got["router_agreement"] >= 0] == 1.0).all())
    torch.testing.assert_close(got["logprobs"], got["logprobs_no_replay"], rtol=0, atol=1e-6)
    torch.testing.assert_close(got["logprobs"], hf_token_outputs(moe[1], batch)["logprobs"], rtol=0, atol=1e-5)
    # a batch without records routes on its own and reports no comparison
    plain = worker.forward(without_routes(batch))
    assert set(plain) == {"logprobs", "entropy"}
    torch.testing.assert_close(plain["logprobs"], got["logprobs_no_replay"], rtol=0, atol=0)


def _router_grads(worker) -> dict[int, torch.Tensor]:
    params = dict(worker.modules[0].named_parameters())
    return {layer: params[f"decoder.layers.{layer}.mlp.router.weight"].main_grad.detach().clone()
            for layer in range(LAYERS) if f"decoder.layers.{layer}.mlp.router.weight" in params}


def torch_router_grads(path: str, host: PluginHost, batch: Batch) -> dict[int, torch.Tensor]:
    """The torch backend's router-weight gradients of one mini-batch (Router Replay on)."""
    ref = create_torch_worker(TrainWorkerContext(job=replay_job(path), components=host))
    ref.accumulate_gradients(batch, compute_norm(batch))
    return {layer: ref.model.model.layers[layer].mlp.gate.weight.grad.detach().clone() for layer in range(LAYERS)}


def test_gradients_reach_the_router_weights_as_in_the_torch_backend(moe, host):
    path, hf = moe
    batch = grpo_batch(hf)
    worker = plugin.create_train_worker(TrainWorkerContext(job=replay_job(path), components=host))
    try:
        metrics = worker.train_mini_batch(batch, compute_norm(batch))
        got = _router_grads(worker)
    finally:
        worker.close()
    want = torch_router_grads(path, host, batch)
    unreplayed = torch_router_grads(path, host, without_routes(batch))
    assert metrics["train/grad_norm"] > 0
    for layer in range(LAYERS):
        assert float(got[layer].abs().max()) > 1e-4, "the router learns nothing"
        torch.testing.assert_close(got[layer], want[layer], rtol=1e-4, atol=1e-6)
        assert float((want[layer] - unreplayed[layer]).abs().max()) > 1e-3  # the replay shows in them


def test_a_dense_model_refuses_router_replay(hf_dir, host):
    import torch.distributed as dist

    had_group = dist.is_initialized()
    with pytest.raises(ValueError, match=r"\[algorithm\] router_replay = true, but the model has no "
                                         r"mixture-of-experts layers"):
        plugin.create_train_worker(TrainWorkerContext(job=replay_job(hf_dir), components=host))
    assert dist.is_initialized() == had_group


# -- expert and pipeline parallelism, two spawned ranks --------------------------------------------

def _two_rank_job(rank: int, out: str, path: str, batch: Batch) -> dict:
    """EP = 2 (rows 0-2 on rank 0, row 3 on rank 1: two micro-batches against one and an
    all-padding one): forward and one training step; then PP = 2 (layer 0 on rank 0, layer 1 on
    rank 1): forward; then TP = 2 with sequence parallelism (each rank's routers see half of every
    row's positions): forward and one training step. Returns the rank's results."""
    ports, _listening = rendezvous_ports(rank, out, 3)
    host = PluginHost.create([])

    def worker(port: int, **backend_args):
        return plugin.create_train_worker(TrainWorkerContext(job=replay_job(path, **backend_args), components=host,
                                                             rank=rank, world_size=2, master_port=port))

    result: dict = {}
    w = worker(ports[0], ep=2)
    mine = batch.select([0, 1, 2] if w.data_parallel_rank == 0 else [3])
    result["ep_forward"] = w.forward(mine)
    w.train_mini_batch(mine, compute_norm(batch))
    result["ep_router_grads"] = _router_grads(w)
    w.close()
    w = worker(ports[1], pp=2)
    result["pp_layers"] = sorted(layer for layer, _, _ in w.router_replay.routers)
    result["pp_forward"] = w.forward(batch)
    w.close()
    w = worker(ports[2], tp=2)
    result["sp"] = w.sequence_parallel
    result["sp_forward"] = w.forward(batch)
    w.train_mini_batch(batch, compute_norm(batch))
    result["sp_router_grads"] = _router_grads(w)
    w.close()
    return result


@pytest.fixture(scope="module")
def two_ranks(slow_fixture, moe, tmp_path_factory):
    path, hf = moe
    batch = grpo_batch(hf)
    out = tmp_path_factory.mktemp("router_replay_ranks")
    return batch, run_ranks(_two_rank_job, 2, out, path, batch)


def test_expert_pipeline_and_sequence_parallel_replay_equal_the_torch_backends(two_ranks, moe, host):
    batch, (rank0, rank1) = two_ranks
    path, hf = moe
    want = replayed_reference(hf, batch)
    unreplayed = hf_token_outputs(hf, batch)
    agreement = expected_agreement(own_ranking(hf, batch), batch["routed_experts"])
    recorded = agreement >= 0
    # EP = 2: each rank's rows
    expected = (want, unreplayed["logprobs"], torch.where(recorded, 1.0, -1.0), agreement)
    for rank, rows in ((rank0, [0, 1, 2]), (rank1, [3])):
        assert set(rank["ep_forward"]) == COMPARE_KEYS
        assert_replayed_rows(rank["ep_forward"], *expected, rows=rows)
    # the router gradients, summed over the two data-parallel ranks, are the whole batch's
    grads = torch_router_grads(path, host, batch)
    # PP = 2: each stage replays its own layer, every stage returns the whole result;
    # TP = 2 + SP: each rank replays its share of the sequence, agreement summed over the two
    assert (rank0["pp_layers"], rank1["pp_layers"]) == ([0], [1])
    for rank in (rank0, rank1):
        assert rank["sp"] is True
        assert_replayed_rows(rank["pp_forward"], *expected)
        assert_replayed_rows(rank["sp_forward"], *expected)
        for key in ("ep_router_grads", "sp_router_grads"):  # every rank's tokens reach the router weights
            for layer in range(LAYERS):
                torch.testing.assert_close(rank[key][layer], grads[layer], rtol=1e-4, atol=1e-6)


def assert_replayed_rows(got: dict, want: dict, unreplayed: torch.Tensor, replayed_agreement: torch.Tensor,
                         agreement: torch.Tensor, rows: list[int] | None = None) -> None:
    """A worker's ``forward`` outputs for ``rows`` (all by default) against the torch backend's
    replay, transformers' own routing and the agreement computed apart, with and without replay."""
    pick = slice(None) if rows is None else rows
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(got[key], want[key][pick], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["logprobs_no_replay"], unreplayed[pick], rtol=0, atol=1e-5)
    assert torch.equal(got["router_agreement"], replayed_agreement[pick])
    assert torch.equal(got["router_agreement_no_replay"], agreement[pick])
