"""Virtual pipeline stages, expert tensor parallelism, activation recomputation and the refused
context parallelism of the megatron train backend (``[train] backend_args``: ``vpp``, ``etp``,
``recompute_*``, ``cp``), on CPU.

Two spawned ranks run, each phase with its own process group: PP = 2 with vpp = 2 on a tiny
4-layer Qwen3 (each rank two model chunks of one layer; forward with fewer micro-batches than
stages, one and three micro-batches, a training step, a checkpoint and its resumption, LoRA),
the tiny Qwen3-MoE of ``megatron_test_support`` under TP = 2 with etp = 1 and ep = 2, and a
4-layer Qwen3-MoE under PP = 2 x vpp = 2 with Router Replay and full recomputation; rank 0 alone
then builds the one-rank references. Recomputation itself is checked on one rank.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import attrs
import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

import megatron_test_support as support
from loongsage_plugin_megatron import layout, plugin
from loongsage_plugin_megatron.forward_backward import microbatch_group_size
from loongsage_plugin_megatron.layout import BackendOptions

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import LoraConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Batch, TrainWorkerContext

MOE_LAYERS, TOP_K, EXPERTS = 4, 2, 4


def six_rows(seed: int) -> Batch:
    """A batch of six rows (three micro-batches of two), 12 tokens wide."""
    a, b = support.make_batch(seed=seed), support.make_batch(rows=2, seed=seed + 1)
    return Batch(tensors={key: torch.cat([a[key], b[key]]) for key in a.tensors},
                 meta={"sample_id": a.meta["sample_id"] + ["t0", "t1"]})


def random_records(batch: Batch, seed: int) -> torch.Tensor:
    """int16 ``[B, T, layers * top_k]`` records of two distinct experts per token and layer, -1 on
    padding and on layer 1 of every fourth token (the router then routes on its own)."""
    g = torch.Generator().manual_seed(seed)
    B, T = batch["input_ids"].shape
    routes = torch.rand(B, T, MOE_LAYERS, EXPERTS, generator=g).argsort(dim=-1)[..., :TOP_K]
    routes[batch["attention_mask"] == 0] = -1
    routes[:, ::4, 1] = -1
    return routes.flatten(2).to(torch.int16)


def replay_job(path: str, **backend_args):
    job = support.make_job(path, **backend_args)
    return attrs.evolve(job, algorithm=attrs.evolve(job.algorithm, router_replay=True))


def lora_job(path: str, **backend_args):
    job = support.make_job(path, **backend_args)
    return attrs.evolve(job, train=attrs.evolve(job.train, lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0)))


def fill_adapters(worker) -> None:
    """Give every LoRA tensor a value drawn from its global layer number and name, so that workers
    of any pipeline layout hold the same adapter (and ``B`` is not zero: the adapter matters)."""
    with torch.no_grad():
        for module in worker.modules:
            for layer in module.decoder.layers:
                for name, param in layer.named_parameters():
                    if ".adapter" in name:
                        g = torch.Generator().manual_seed(zlib.crc32(f"{layer.layer_number}.{name}".encode()))
                        param.copy_(0.05 * torch.randn(param.shape, generator=g))


def _dense_phase(w, result: dict, name: str, data: dict, ckpt: str | None) -> None:
    """Forward (4, 1 and 6 rows), export, two training steps (with ``ckpt``: a checkpoint between
    them, a Hugging Face directory after them), forward."""
    result[f"{name}_forward"] = w.forward(support.make_batch())
    result[f"{name}_forward_1"] = w.forward(support.make_batch(rows=1, seed=3))  # fewer micro-batches than pp
    result[f"{name}_forward_6"] = w.forward(six_rows(seed=4))  # three micro-batches
    result[f"{name}_initial"] = support.weights_of(w)
    first, second = data["first"], data["second"]
    result[f"{name}_metrics"] = w.train_mini_batch(first, compute_norm(first))
    result[f"{name}_weights"] = support.weights_of(w)
    if ckpt:
        w.save_checkpoint(ckpt)
    result[f"{name}_metrics_2"] = w.train_mini_batch(second, compute_norm(second))
    result[f"{name}_weights_2"] = support.weights_of(w)
    if ckpt:
        from safetensors.torch import load_file

        w.save_hf(ckpt + "_hf")
        result[f"{name}_saved_hf"] = load_file(str(Path(ckpt + "_hf") / "model.safetensors"))
    result[f"{name}_forward_after"] = w.forward(support.make_batch())


def _lora_phase(w, result: dict, name: str, batch: Batch) -> None:
    fill_adapters(w)
    result[f"{name}_adapter"] = support.weights_of(w)
    result[f"{name}_forward"] = w.forward(support.make_batch())
    result[f"{name}_reference"] = w.reference_forward(support.make_batch())
    result[f"{name}_metrics"] = w.train_mini_batch(batch, compute_norm(batch))
    result[f"{name}_adapter_after"] = support.weights_of(w)


def _moe_phase(w, result: dict, name: str, batch: Batch) -> None:
    result[f"{name}_forward"] = w.forward(support.make_batch())
    result[f"{name}_initial"] = support.weights_of(w)
    result[f"{name}_metrics"] = w.train_mini_batch(batch, compute_norm(batch))
    result[f"{name}_weights"] = support.weights_of(w)
    result[f"{name}_forward_after"] = w.forward(support.make_batch())


def _replay_phase(w, result: dict, name: str, batch: Batch) -> None:
    result[f"{name}_forward"] = w.forward(batch)
    result[f"{name}_metrics"] = w.train_mini_batch(batch, compute_norm(batch))
    result[f"{name}_weights"] = support.weights_of(w)


def _two_rank_job(rank: int, out: str, paths: dict, data: dict) -> dict:
    """The phases of one of two ranks (see the module docstring); the references on rank 0.
    Returns the rank's results."""
    ports, _listening = support.rendezvous_ports(rank, out, 5)
    host = PluginHost.create([])
    result: dict = {}

    def worker(port: int, job, world: int = 2):
        return plugin.create_train_worker(TrainWorkerContext(job=job, components=host, rank=rank, world_size=world,
                                                             master_port=port))

    dense, moe, moe4 = paths["dense"], paths["moe"], paths["moe4"]
    ckpt = str(Path(out) / "vpp_ckpt")
    w = worker(ports[0], support.make_job(dense, pp=2, vpp=2))
    result["vpp_layers"] = [[layer.layer_number for layer in m.decoder.layers] for m in w.modules]
    _dense_phase(w, result, "vpp", data, ckpt)
    w.close()
    w = worker(ports[1], support.make_job(dense, pp=2, vpp=2))
    w.load_checkpoint(ckpt)
    result["resumed_metrics_2"] = w.train_mini_batch(data["second"], compute_norm(data["second"]))
    result["resumed_weights_2"] = support.weights_of(w)
    w.close()
    w = worker(ports[2], lora_job(dense, pp=2, vpp=2))
    _lora_phase(w, result, "vpp_lora", data["first"])
    w.close()
    w = worker(ports[3], support.make_job(moe, tp=2, etp=1, ep=2))
    params = dict(w.modules[0].named_parameters())
    result["etp_shapes"] = {n: tuple(p.shape) for n, p in params.items() if n.startswith("decoder.layers.0.")}
    _moe_phase(w, result, "etp", data["moe"])
    w.close()
    w = worker(ports[4], replay_job(moe4, pp=2, vpp=2, recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=1))
    _replay_phase(w, result, "vpp_replay", data["replay"])
    w.close()
    if rank == 0:
        for name, job, phase, arg in (
                ("pp1", support.make_job(dense), _dense_phase, None),
                ("pp1_lora", lora_job(dense), _lora_phase, data["first"]),
                ("tp1", support.make_job(moe), _moe_phase, data["moe"]),
                ("pp1_replay", replay_job(moe4), _replay_phase, data["replay"])):
            w = worker(0, job, world=1)
            if phase is _dense_phase:
                phase(w, result, name, data, None)
            else:
                phase(w, result, name, arg)
            w.close()
    return result


@pytest.fixture(scope="module")
def two_ranks(slow_fixture, tiny_qwen3_writer, tmp_path_factory):
    """Run :func:`_two_rank_job` on two spawned ranks; returns both ranks' results."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("parallelism")
    dense = tiny_qwen3_writer(str(root / "dense4"), num_hidden_layers=4)
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    moe_hf = support.save_tiny_moe(str(root / "moe"))
    moe4_hf = support.save_tiny_moe(str(root / "moe4"), num_hidden_layers=MOE_LAYERS)
    replay = support.make_batch(seed=9)
    replay.tensors["routed_experts"] = random_records(replay, seed=9)
    data = {"first": support.with_hf_old_logprobs(hf, support.make_batch(seed=6), seed=6),
            "second": support.with_hf_old_logprobs(hf, six_rows(seed=7), seed=7),
            "moe": support.with_hf_old_logprobs(moe_hf, support.make_batch(seed=6), seed=6),
            "replay": support.with_hf_old_logprobs(moe4_hf, replay, seed=9)}
    paths = {"dense": dense, "moe": str(root / "moe"), "moe4": str(root / "moe4")}
    out = root / "ranks"
    out.mkdir()
    return support.run_ranks(_two_rank_job, 2, out, paths, data)


def _assert_same_step(got: dict, want: dict) -> None:
    assert want["train/grad_norm"] > 0
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-6)
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key


def test_virtual_pipeline_2_by_pipeline_parallel_2_equals_pp_1(two_ranks):
    rank0, rank1 = two_ranks
    # Chunk v of stage p holds layer v * pp + p (Megatron's layer numbers count from 1).
    assert rank0["vpp_layers"] == [[1], [3]] and rank1["vpp_layers"] == [[2], [4]]
    for rank in (rank0, rank1):
        for key in ("forward", "forward_1", "forward_6", "forward_after"):
            for out in ("logprobs", "entropy"):
                got, want = rank[f"vpp_{key}"][out], rank0[f"pp1_{key}"][out]
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{key} {out}")
        support.assert_weights_equal(rank["vpp_initial"], rank0["pp1_initial"], atol=0)  # export of every chunk
        # two steps through the interleaved schedule: two micro-batches, then three
        _assert_same_step(rank["vpp_metrics"], rank0["pp1_metrics"])
        _assert_same_step(rank["vpp_metrics_2"], rank0["pp1_metrics_2"])
        support.assert_weights_equal(rank["vpp_weights"], rank0["pp1_weights"], atol=1e-5)
        support.assert_weights_equal(rank["vpp_weights_2"], rank0["pp1_weights_2"], atol=1e-5)
    moved = torch.cat([(rank0["vpp_weights"][n] - t).abs().flatten() for n, t in rank0["vpp_initial"].items()])
    assert moved.max() > 1e-4
    # save_hf writes every chunk's trained weights (the tied output layer once, as the source)
    support.assert_weights_equal(rank0["vpp_saved_hf"], rank0["vpp_weights_2"], atol=0)


def test_virtual_pipeline_checkpoint_resumes_exactly(two_ranks):
    for rank in two_ranks:  # every chunk's weights and the optimizer state come back
        assert rank["resumed_metrics_2"] == rank["vpp_metrics_2"]
        support.assert_weights_equal(rank["resumed_weights_2"], rank["vpp_weights_2"], atol=0)


def test_virtual_pipeline_lora_equals_pp_1(two_ranks):
    rank0, rank1 = two_ranks
    for rank in (rank0, rank1):
        # PEFT names, all layers
        support.assert_weights_equal(rank["vpp_lora_adapter"], rank0["pp1_lora_adapter"], atol=0)
        for key in ("forward", "reference"):
            torch.testing.assert_close(rank[f"vpp_lora_{key}"]["logprobs"], rank0[f"pp1_lora_{key}"]["logprobs"],
                                       rtol=0, atol=1e-5)
        _assert_same_step(rank["vpp_lora_metrics"], rank0["pp1_lora_metrics"])
        support.assert_weights_equal(rank["vpp_lora_adapter_after"], rank0["pp1_lora_adapter_after"], atol=1e-5)
    assert (rank0["pp1_lora_forward"]["logprobs"] - rank0["pp1_lora_reference"]["logprobs"]).abs().max() > 1e-3


def test_expert_tensor_parallel_1_under_tp_2_equals_tp_1(two_ranks):
    """``{tp = 2, etp = 1, ep = 2}`` on two ranks against TP = 1 on the tiny Qwen3-MoE."""
    rank0, rank1 = two_ranks
    # attention split over the two ranks; each rank holds two of the four experts, whole
    shapes = rank0["etp_shapes"]
    assert shapes["decoder.layers.0.self_attention.linear_proj.weight"] == (32, 16)
    assert shapes["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == (32, 32)
    assert shapes["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"] == (32, 16)
    assert sum(".local_experts." in n and n.endswith("linear_fc2.weight") for n in shapes) == 2
    for rank in (rank0, rank1):
        for key in ("forward", "forward_after"):
            for out in ("logprobs", "entropy"):
                torch.testing.assert_close(rank[f"etp_{key}"][out], rank0[f"tp1_{key}"][out], rtol=0, atol=1e-5)
        support.assert_weights_equal(rank["etp_initial"], rank0["tp1_initial"], atol=0)
        got, want = rank["etp_metrics"], rank0["tp1_metrics"]
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
        for key in ("train/loss", "train/pg_loss", "train/entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        # AdamW divides each element's step by the root of its own squared gradient, so an element
        # with a near-zero gradient turns the split matmuls' different summation order into up to
        # ~1e-5 of its step (seen: 1 of 512 elements of an expert); a wrong update moves by ~lr (5e-4 in the first step)
        support.assert_weights_equal(rank["etp_weights"], rank0["tp1_weights"], atol=5e-5)


def test_router_replay_under_virtual_pipeline_and_recomputation_equals_pp_1(two_ranks):
    rank0, rank1 = two_ranks
    want = rank0["pp1_replay_forward"]
    assert set(want) == {"logprobs", "entropy", "router_agreement", "logprobs_no_replay",
                         "router_agreement_no_replay"}
    assert (want["logprobs"] - want["logprobs_no_replay"]).abs().max() > 1e-2  # the records matter
    for rank in (rank0, rank1):
        got = rank["vpp_replay_forward"]
        for key in ("logprobs", "entropy", "logprobs_no_replay"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5, msg=key)
        # each micro-batch's agreement adds up the counts of both chunks of both stages
        for key in ("router_agreement", "router_agreement_no_replay"):
            assert torch.equal(got[key], want[key]), key
        _assert_same_step(rank["vpp_replay_metrics"], rank0["pp1_replay_metrics"])
        support.assert_weights_equal(rank["vpp_replay_weights"], rank0["pp1_replay_weights"], atol=1e-5)


def test_microbatch_group_size_fits_the_interleaved_schedule():
    assert [microbatch_group_size(m, 2) for m in (2, 3, 4, 5, 6, 7)] == [2, 3, 2, 3, 2, 4]
    assert [microbatch_group_size(m, 4) for m in (4, 5, 6, 8, 9)] == [4, 5, 6, 4, 5]
    with pytest.raises(ValueError, match="fewer than pp"):
        microbatch_group_size(1, 2)


# -- activation recomputation, one rank ------------------------------------------------------------

RECOMPUTE = {"full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
             "selective": dict(recompute_granularity="selective")}


def _counting_step(worker, batch: Batch) -> tuple[dict, dict[str, int]]:
    """One training step of ``worker``, and how often each decoder layer and core attention ran."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    counts: dict[str, int] = {}
    hooks = []
    for module in worker.modules:
        for name, sub in module.named_modules():
            if isinstance(sub, TransformerLayer) or name.endswith("self_attention.core_attention"):
                key = f"layer{sub.layer_number}" if isinstance(sub, TransformerLayer) else f"attn{name.split('.')[2]}"

                def hook(*_, _key=key) -> None:
                    counts[_key] = counts.get(_key, 0) + 1

                hooks.append(sub.register_forward_hook(hook))
    try:
        return worker.train_mini_batch(batch, compute_norm(batch)), counts
    finally:
        for handle in hooks:
            handle.remove()


@pytest.fixture(scope="module")
def no_recompute(hf_dir):
    """The step, its counts and the log-probs after it without recomputation (the reference)."""
    host = PluginHost.create([])
    w = plugin.create_train_worker(TrainWorkerContext(job=support.make_job(hf_dir), components=host))
    try:
        batch = support.make_batch(seed=1)
        batch.tensors["old_logprobs"] = (w.forward(batch)["logprobs"] + 0.05) * batch["loss_mask"]
        metrics, counts = _counting_step(w, batch)
        return batch, metrics, counts, w.forward(support.make_batch(seed=2))
    finally:
        w.close()


@pytest.mark.parametrize("setting", list(RECOMPUTE))
def test_recomputation_gives_the_same_step(no_recompute, hf_dir, setting):
    from megatron.core.utils import get_model_config

    batch, want, base_counts, want_after = no_recompute
    host = PluginHost.create([])
    w = plugin.create_train_worker(TrainWorkerContext(job=support.make_job(hf_dir, **RECOMPUTE[setting]),
                                                      components=host))
    try:
        config = get_model_config(w.modules[0])
        assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
            RECOMPUTE[setting]["recompute_granularity"], RECOMPUTE[setting].get("recompute_method"),
            RECOMPUTE[setting].get("recompute_num_layers"))
        got, counts = _counting_step(w, batch)
        after = w.forward(support.make_batch(seed=2))
    finally:
        w.close()
    # two micro-batches: each layer and attention ran twice without recomputation
    assert base_counts == {"layer1": 2, "layer2": 2, "attn0": 2, "attn1": 2}
    recomputed = {"full_uniform": {"layer1": 4, "layer2": 4, "attn0": 4, "attn1": 4},
                  "full_block": {"layer1": 4, "layer2": 2, "attn0": 4, "attn1": 2},  # the first layer only
                  "selective": {"layer1": 2, "layer2": 2, "attn0": 4, "attn1": 4}}[setting]
    assert counts == recomputed
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-6)
    for key in ("train/loss", "train/pg_loss", "train/entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    torch.testing.assert_close(after["logprobs"], want_after["logprobs"], rtol=0, atol=1e-6)


def test_router_replay_replays_the_forwards_experts_in_recomputed_layers(monkeypatch, tmp_path):
    """Full recomputation under Router Replay: the recomputed routers take the experts of their
    forward (replayed or their own), so the gradients equal those without recomputation; routing
    on their own in the backward pass instead would change them."""
    from loongsage_plugin_megatron import router_replay

    root = tmp_path / "moe"
    hf = support.save_tiny_moe(str(root))
    batch = support.grpo_batch(hf)
    host = PluginHost.create([])
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

    def step(**backend_args) -> tuple[dict, torch.Tensor]:
        w = plugin.create_train_worker(TrainWorkerContext(job=support.replay_job(str(root), **backend_args),
                                                          components=host))
        try:
            metrics = w.train_mini_batch(batch, compute_norm(batch))
            return metrics, torch.cat([p.main_grad.flatten() for p in w.modules[0].parameters()])
        finally:
            w.close()

    want, want_grads = step()
    got, grads = step(**full)
    assert want["train/grad_norm"] > 0
    torch.testing.assert_close(grads, want_grads, rtol=0, atol=1e-7)
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-6)
    monkeypatch.setattr(router_replay, "in_backward_pass", lambda: False)  # recompute with the routers' own top-k
    _, wrong = step(**full)
    assert float((wrong - want_grads).abs().max()) > 1e-4


# -- refusals --------------------------------------------------------------------------------------

DENSE = {"num_hidden_layers": 4}
MOE = {"num_hidden_layers": 2, "num_experts": 4, "moe_intermediate_size": 16}


def _layout(hf_config: dict, world: int = 2, cuda: bool = False, **args) -> None:
    """What a worker and ``loongsage validate`` check: :func:`layout.parallel_sizes` and
    :func:`layout.check_layout` of ``args`` on ``world`` ranks."""
    options = BackendOptions.from_args(args)
    experts = layout.hf_num_experts(hf_config)
    tp, pp, _, _ = layout.parallel_sizes(options, world, experts)
    layout.check_layout(options, "actor", tp, pp, hf_config, experts, cuda=cuda)


@pytest.mark.parametrize("args, world, config, cuda, message", [
    # virtual pipeline stages
    (dict(vpp=2), 2, DENSE, False, r"backend_args.vpp = 2 needs pp > 1 .* but pp = 1"),
    (dict(pp=2, vpp=3), 2, DENSE, False, r"backend_args.vpp = 3: the model's 4 layers do not split evenly over "
                                         r"pp \* vpp = 2\*3 = 6 model chunks"),
    (dict(pp=2, vpp=0), 2, DENSE, False, r"backend_args: 'vpp' must be an integer >= 1, got 0"),
    # recomputation
    (dict(recompute_granularity="some"), 1, DENSE, False,
     r"backend_args: 'recompute_granularity' must be one of 'full', 'selective' or left out, got 'some'"),
    (dict(recompute_granularity="full", recompute_method="all", recompute_num_layers=1), 1, DENSE, False,
     r"backend_args: 'recompute_method' must be one of 'uniform', 'block' or left out, got 'all'"),
    (dict(recompute_granularity="full", recompute_num_layers=1), 1, DENSE, False,
     r"backend_args.recompute_granularity = 'full' needs recompute_method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), 1, DENSE, False,
     r"backend_args.recompute_granularity = 'full' needs recompute_num_layers \(between 1 and 4"),
    (dict(pp=2, recompute_granularity="full", recompute_method="block", recompute_num_layers=3), 2, DENSE, False,
     r"backend_args.recompute_num_layers = 3 must be between 1 and 2, the layers of one pipeline stage"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0), 1, DENSE, False,
     r"backend_args: 'recompute_num_layers' must be an integer >= 1, got 0"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), 1, DENSE, False,
     r"backend_args.recompute_num_layers = 1: recompute_granularity = 'selective' .* takes no recompute_method"),
    (dict(recompute_granularity="selective", recompute_method="uniform"), 1, DENSE, False,
     r"backend_args.recompute_method = 'uniform': recompute_granularity = 'selective'"),
    (dict(recompute_method="block"), 1, DENSE, False,
     r"backend_args.recompute_method = 'block' needs recompute_granularity = 'full'"),
    (dict(recompute_num_layers=2), 1, DENSE, False,
     r"backend_args.recompute_num_layers = 2 needs recompute_granularity = 'full'"),
    # expert tensor parallelism
    (dict(tp=2, etp=1), 2, DENSE, False, r"backend_args.etp = 1: expert tensor parallelism needs a "
                                         r"Mixture-of-Experts model"),
    (dict(etp=2, dp=2), 2, MOE, False, r"backend_args.etp = 2 must divide tp = 1"),
    (dict(tp=4, etp=3), 4, MOE, False, r"backend_args.etp = 3 must divide tp = 4"),
    (dict(tp=2, etp=1, ep=4), 2, MOE, False, r"backend_args.ep = 4 must divide \(tp / etp\) \* dp = \(2/1\)\*1 = 2"),
    (dict(tp=2, etp=1), 2, MOE, False, r"backend_args.etp = 1 below tp = 2 needs ep > 1"),
    (dict(tp=2, etp=2, ep=2), 2, MOE, False, r"backend_args.ep = 2 must divide the data-parallel size dp = 1"),
    (dict(tp=2, etp=2), 2, {**MOE, "moe_intermediate_size": 15}, False,
     r"backend_args.etp = 2 must divide the experts' hidden size moe_intermediate_size = 15"),
    # context parallelism
    (dict(cp=2), 2, DENSE, False, r"backend_args.cp = 2 cannot run: Megatron-Core computes context-parallel "
                                  r"attention only in Transformer Engine's TEDotProductAttention"),
    (dict(cp=2), 2, DENSE, True, r"backend_args.cp = 2 cannot run: the megatron backend does not split its "
                                 r"micro-batches along the sequence"),
    (dict(cp=2), 3, DENSE, True, r"3 ranks are not divisible by tp \* pp \* cp = 2"),
    (dict(cp=0), 1, DENSE, False, r"backend_args: 'cp' must be an integer >= 1, got 0"),
])
def test_parallelism_options_are_refused_naming_the_key(args, world, config, cuda, message):
    with pytest.raises(ValueError, match=message):
        _layout(config, world, cuda, **args)


def test_parallelism_options_that_fit_pass_the_checks():
    _layout(DENSE, 2, pp=2, vpp=2)
    _layout(DENSE, 2, pp=2, vpp=1)  # one chunk per rank: the plain 1F1B schedule
    assert BackendOptions(vpp=1).virtual_stages is None and BackendOptions(pp=2, vpp=2).virtual_stages == 2
    _layout(DENSE, 2, pp=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    _layout(DENSE, 1, recompute_granularity="selective")
    _layout(MOE, 2, tp=2, etp=1, ep=2)
    _layout(MOE, 4, tp=2, etp=1, ep=4, dp=2)
    _layout(MOE, 2, tp=2, etp=2)
    assert BackendOptions(tp=2).expert_tp(2) == 2 and BackendOptions(etp=1).expert_tp(2) == 1
    _layout(DENSE, 1, cuda=True, cp=1)
    assert layout.context_parallel_blocker(1, cuda=False) is None


def test_the_worker_refuses_before_it_builds(hf_dir):
    import torch.distributed as dist

    had_group = dist.is_initialized()
    host = PluginHost.create([])
    with pytest.raises(ValueError, match=r"backend_args.vpp = 2 needs pp > 1"):
        plugin.create_train_worker(TrainWorkerContext(job=support.make_job(hf_dir, vpp=2), components=host))
    with pytest.raises(ValueError, match=r"backend_args.cp = 2 cannot run"):
        plugin.create_train_worker(TrainWorkerContext(job=support.make_job(hf_dir, cp=2), components=host,
                                                      world_size=2))
    with pytest.raises(ValueError, match=r"unknown keys \['recompute'\]"):
        plugin.create_train_worker(TrainWorkerContext(job=support.make_job(hf_dir, recompute="full"),
                                                      components=host))
    assert dist.is_initialized() == had_group
