"""Mixed precision in the megatron train backend on CPU: ``[model] dtype = "bfloat16"`` / ``"float16"``
(16-bit parameters and compute, float32 master weights in Megatron-Core's optimizer, float32
gradient buffers) and ``[model] fp32_lm_head``, against the float32 worker on the same tiny Qwen3.

Tolerances against the float32 worker (measured on the tiny Qwen3 of ``conftest.py``, one GRPO
step of 4 rows, bfloat16 / float16):

* loss: relative 1e-3 (measured 5e-5 / 7e-5);
* gradient norm: relative 5e-3 (measured 5e-4 / 2e-4);
* the update: the master weights' step agrees with the float32 step's, mean absolute difference
  below 5 % of the float32 step's mean absolute size (measured 0.6 % / 0.1 %);
* log-probs: largest difference below 1e-2 (measured 2.6e-3 / 2.6e-4; mean 8.2e-4 / 9.3e-5);
  bfloat16 with ``fp32_lm_head``: mean 7.5e-4, largest 2.3e-3.

bfloat16 under TP = 2, PP = 2, DP = 2 and (the tiny Qwen3-MoE) EP = 2, two spawned ranks, is held
to the same gradient-norm and log-prob tolerances (and, where a rank holds the whole batch, the
loss), against the one-rank step, its trained log-probs against the one-rank bfloat16 worker's.
"""

from __future__ import annotations

import attrs
import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

import megatron_test_support as support
from loongsage_plugin_megatron import plugin
from loongsage_plugin_megatron.checkpoint import STATE_FILE
from loongsage_plugin_megatron.model import MODEL_DTYPES, model_dtype
from loongsage_plugin_megatron.schedule import megatron_optimizers

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import JobConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Batch, TrainWorkerContext

LOSS_RTOL = 1e-3
GRAD_NORM_RTOL = 5e-3
UPDATE_SHARE = 0.05
LOGPROB_ATOL = 1e-2


def make_job(path: str, dtype: str = "float32", fp32_lm_head: bool = False) -> JobConfig:
    """``megatron_test_support.make_job`` (no ``backend_args``) in ``[model] dtype``, with ``fp32_lm_head``."""
    job = support.make_job(path)
    return attrs.evolve(job, model=attrs.evolve(job.model, dtype=dtype, fp32_lm_head=fp32_lm_head))


def make_train_batch(logprobs: torch.Tensor, seed: int) -> Batch:
    """A GRPO batch whose ``old_logprobs`` are ``logprobs`` (of ``make_batch(seed=seed)``) plus a little noise."""
    return support.with_old_logprobs(support.make_batch(seed=seed), logprobs, seed)


def build(hf_dir: str, host: PluginHost, dtype: str = "float32", fp32_lm_head: bool = False):
    spec = {s.name: s for s in plugin.loongsage_train_backends()}["megatron"]
    return spec.factory(TrainWorkerContext(job=make_job(hf_dir, dtype, fp32_lm_head), components=host))


def mixed_precision_optimizer(worker):
    """The ``Float16OptimizerWithFloat16Params`` inside the worker's (chained) Megatron optimizer."""
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params

    subs = megatron_optimizers(worker.optimizer)
    assert len(subs) == 1 and isinstance(subs[0], Float16OptimizerWithFloat16Params)
    return subs[0]


def model(worker):
    """The worker's ``GPTModel`` (inside Megatron-Core's ``Float16Module`` under 16-bit dtypes)."""
    return getattr(worker.modules[0], "module", worker.modules[0])


def masters(worker) -> dict[str, torch.Tensor]:
    """Model parameter name -> its float32 master weight (a copy)."""
    opt = mixed_precision_optimizer(worker)
    by_id = {id(p): n for n, p in model(worker).named_parameters()}
    return {by_id[id(p)]: m.detach().clone() for model_group, main_group in
            zip(opt.float16_groups, opt.fp32_from_float16_groups) for p, m in zip(model_group, main_group)}


def params(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model(worker).named_parameters()}


@pytest.fixture(scope="module")
def fp32_step(hf_dir, host):
    """The float32 worker's log-probs on ``make_batch(seed=1)``, the GRPO batch built from them,
    its step's metrics and its parameters before and after the step."""
    worker = build(hf_dir, host)
    try:
        logprobs = worker.forward(support.make_batch(seed=1))["logprobs"]
        batch = make_train_batch(logprobs, seed=1)
        before = params(worker)
        metrics = worker.train_mini_batch(batch, compute_norm(batch))
        return {"logprobs": logprobs, "batch": batch, "metrics": metrics, "before": before,
                "after": params(worker), "export": dict(worker.named_weights())}
    finally:
        worker.close()


def assert_step_close_to_fp32(worker, fp32_step, dtype: torch.dtype) -> dict[str, float]:
    """One step of the 16-bit ``worker`` on the float32 step's batch: float32 master weights beside
    16-bit parameters, loss / grad norm / update within the module's tolerances."""
    assert {p.dtype for p in worker.modules[0].parameters()} == {dtype}
    start = masters(worker)
    assert set(start) == {n for n, p in model(worker).named_parameters() if p.requires_grad}
    current = params(worker)
    for name, master in start.items():
        assert master.dtype == torch.float32 and torch.equal(master.to(dtype), current[name]), name
    batch = fp32_step["batch"]
    metrics = worker.train_mini_batch(batch, compute_norm(batch))
    want = fp32_step["metrics"]
    assert metrics["train/skipped_step"] == 0.0
    assert metrics["train/loss"] == pytest.approx(want["train/loss"], rel=LOSS_RTOL)
    assert metrics["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=GRAD_NORM_RTOL)
    end, after = masters(worker), params(worker)
    for name, master in end.items():  # the 16-bit parameters are the rounded master weights
        assert torch.equal(master.to(dtype), after[name]), name
    assert any(not torch.equal(after[n], current[n]) for n in current)  # the weights moved
    moved = torch.cat([(end[n] - start[n]).flatten() for n in start])
    want_moved = torch.cat([(fp32_step["after"][n] - fp32_step["before"][n]).flatten() for n in start])
    assert (moved - want_moved).abs().mean() < UPDATE_SHARE * want_moved.abs().mean()
    return metrics


def test_bfloat16_step_keeps_fp32_master_weights_and_matches_fp32(hf_dir, host, fp32_step, tmp_path):
    from megatron.core.transformer.module import Float16Module
    from safetensors.torch import load_file

    worker = build(hf_dir, host, "bfloat16")
    try:
        assert isinstance(worker.modules[0], Float16Module)
        assert all(b.grad_data.dtype == torch.float32 for b in worker.model.buffers)  # grad_reduce_in_fp32
        assert mixed_precision_optimizer(worker).grad_scaler is None  # bf16: no loss scaling
        assert_step_close_to_fp32(worker, fp32_step, torch.bfloat16)
        exported = dict(worker.named_weights())  # Hugging Face names, in the model's dtype
        assert set(exported) == set(fp32_step["export"])
        for name, tensor in exported.items():
            assert tensor.dtype == torch.bfloat16, name
            torch.testing.assert_close(tensor.float(), fp32_step["export"][name], rtol=2 ** -7, atol=2e-3)
        worker.save_hf(str(tmp_path / "hf"))  # the same tensors on disk
        saved = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
        assert set(saved) <= set(exported) and "model.embed_tokens.weight" in saved
        for name, tensor in saved.items():
            assert torch.equal(tensor.to(exported[name].dtype), exported[name]), name
    finally:
        worker.close()


def test_bfloat16_checkpoint_resumes_bit_exactly(hf_dir, host, fp32_step, tmp_path):
    b1 = fp32_step["batch"]
    first = build(hf_dir, host, "bfloat16")
    try:
        first.train_mini_batch(b1, compute_norm(b1))
        first.save_checkpoint(str(tmp_path / "ckpt"))
        b2 = make_train_batch(first.forward(support.make_batch(seed=2))["logprobs"], seed=2)
        first.train_mini_batch(b2, compute_norm(b2))
        want_params, want_masters = params(first), masters(first)
        want_state = mixed_precision_optimizer(first).optimizer.state_dict()["state"]
    finally:
        first.close()
    saved = torch.load(tmp_path / "ckpt" / STATE_FILE.format(rank=0), weights_only=False)
    saved_masters = [t for group in saved["optimizer"]["fp32_from_fp16_params"] for t in group]
    assert saved_masters and all(t.dtype == torch.float32 for t in saved_masters)
    resumed = build(hf_dir, host, "bfloat16")
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        resumed.train_mini_batch(b2, compute_norm(b2))
        got_params, got_masters = params(resumed), masters(resumed)
        got_state = mixed_precision_optimizer(resumed).optimizer.state_dict()["state"]
    finally:
        resumed.close()
    for got, want in ((got_params, want_params), (got_masters, want_masters)):
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert set(got_state) == set(want_state) and want_state
    for index, state in want_state.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(got_state[index][key]), torch.as_tensor(value)), (index, key)


def test_fp32_lm_head_computes_the_logits_in_float32(hf_dir, host, fp32_step):
    batch = support.make_batch(seed=1)
    real = batch["loss_mask"] > 0
    errors, dtypes = {}, {}
    for head in (False, True):
        worker = build(hf_dir, host, "bfloat16", fp32_lm_head=head)
        try:
            seen = []
            layer = model(worker).output_layer
            handle = layer.register_forward_hook(
                lambda mod, args, out, seen=seen: seen.append((args[0].dtype, out[0].dtype)))
            logprobs = worker.forward(batch)["logprobs"]
            handle.remove()
            dtypes[head] = set(seen)
            diff = (logprobs - fp32_step["logprobs"])[real].abs()
            assert float(diff.max()) < LOGPROB_ATOL
            errors[head] = float(diff.mean())
            if head:  # the upcast head trains: its gradient reaches the 16-bit weight
                metrics = worker.train_mini_batch(fp32_step["batch"], compute_norm(fp32_step["batch"]))
                assert metrics["train/skipped_step"] == 0.0
                assert metrics["train/grad_norm"] == pytest.approx(fp32_step["metrics"]["train/grad_norm"],
                                                                   rel=GRAD_NORM_RTOL)
        finally:
            worker.close()
    # the hook sees the layer's bfloat16 input; its output is the logits
    assert dtypes == {False: {(torch.bfloat16, torch.bfloat16)}, True: {(torch.bfloat16, torch.float32)}}
    assert errors[True] < errors[False]


def test_float16_trains_with_dynamic_loss_scaling(hf_dir, host, fp32_step):
    from loongsage_plugin_megatron.optimizer import INITIAL_LOSS_SCALE
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.utils import get_model_config

    worker = build(hf_dir, host, "float16")
    try:
        scaler = mixed_precision_optimizer(worker).grad_scaler
        assert isinstance(scaler, DynamicGradScaler) and float(scaler.scale) == INITIAL_LOSS_SCALE
        assert get_model_config(worker.modules[0]).grad_scale_func == worker.optimizer.scale_loss
        assert_step_close_to_fp32(worker, fp32_step, torch.float16)
        # A scale the float16 gradients cannot hold: the backward pass overflows (the loss is
        # scaled), the step is skipped, and the second overflow in a row halves the scale
        # (hysteresis 2), as Megatron-Core's DynamicGradScaler does.
        scaler._scale = torch.tensor([2.0 ** 40])
        before = params(worker)
        for halved in (2.0 ** 40, 2.0 ** 39):
            batch = fp32_step["batch"]
            metrics = worker.train_mini_batch(batch, compute_norm(batch))
            assert metrics["train/skipped_step"] == 1.0
            assert float(scaler.scale) == halved
        after = params(worker)
        assert all(torch.equal(after[n], before[n]) for n in before)
    finally:
        worker.close()


def test_spec_declares_the_dtypes_the_worker_trains_in():
    spec = {s.name: s for s in plugin.loongsage_train_backends()}["megatron"]
    assert spec.model_dtypes == tuple(MODEL_DTYPES) == ("float32", "bfloat16", "float16")
    assert model_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match=r"\[model\] dtype = 'float64' is not supported"):
        model_dtype("float64")



def _bf16_worker(path: str, host: PluginHost, rank: int = 0, world: int = 1, port: int = 0, **backend_args):
    """A bfloat16 worker on ``path`` with ``backend_args``, rank ``rank`` of ``world``."""
    job = make_job(path, "bfloat16")
    job = attrs.evolve(job, train=attrs.evolve(job.train, backend_args=backend_args))
    return plugin.create_train_worker(TrainWorkerContext(job=job, components=host, rank=rank, world_size=world,
                                                         master_port=port))


def _bf16_two_rank_job(rank: int, out: str, path: str, moe_path: str, batch: Batch, moe_batch: Batch) -> dict:
    """bfloat16 under TP = 2, PP = 2, DP = 2 (rows 0-1 and 2-3) and, for the tiny Qwen3-MoE,
    EP = 2 (DP = 2 with the experts split): each rank's parameter and master dtypes, log-probs of
    the whole batch before and after one step, and the step's metrics."""
    ports, _listening = support.rendezvous_ports(rank, out, 4)
    host = PluginHost.create([])
    result: dict = {}
    layouts = (("tp", path, batch, {"tp": 2}), ("pp", path, batch, {"pp": 2}), ("dp", path, batch, {}),
               ("ep", moe_path, moe_batch, {"ep": 2}))
    for port, (layout, model_path, rows, backend_args) in zip(ports, layouts):
        worker = _bf16_worker(model_path, host, rank, 2, port, **backend_args)
        try:
            # under EP the optimizer chains one 16-bit optimizer for the dense and one for the expert parameters
            subs = megatron_optimizers(worker.optimizer)
            result[f"{layout}_dtypes"] = ({p.dtype for p in model(worker).parameters()},
                                          {m.dtype for opt in subs for group in opt.fp32_from_float16_groups
                                           for m in group})
            index = list(range(len(rows))) if layout in ("tp", "pp") else (
                [0, 1] if worker.data_parallel_rank == 0 else [2, 3])
            mine = rows.select(index)
            result[f"{layout}_before"] = worker.forward(mine)["logprobs"]
            result[f"{layout}_metrics"] = worker.train_mini_batch(mine, compute_norm(rows))
            result[f"{layout}_after"] = worker.forward(mine)["logprobs"]
            result[f"{layout}_index"] = index
        finally:
            worker.close()
    return result


def _one_rank_bf16(path: str, host: PluginHost, batch: Batch) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The one-rank bfloat16 worker's step metrics and log-probs before and after it."""
    worker = _bf16_worker(path, host)
    try:
        before = worker.forward(batch)["logprobs"]
        metrics = worker.train_mini_batch(batch, compute_norm(batch))
        return metrics, before, worker.forward(batch)["logprobs"]
    finally:
        worker.close()


@pytest.mark.slow
def test_bfloat16_under_tensor_pipeline_data_and_expert_parallel_2_matches_one_rank(hf_dir, host, fp32_step,
                                                                                    tmp_path):
    """16-bit training sharded and replicated: the same float32 masters beside bfloat16 parameters
    on every rank, and a step within the module's tolerances of the one-rank step (the float32 one
    for the loss and gradient norm of the dense model, the bfloat16 one otherwise), its log-probs
    afterwards within bfloat16 rounding of the one-rank bfloat16 worker's."""
    batch = fp32_step["batch"]
    moe_path = str(tmp_path / "moe")
    moe_hf = support.save_tiny_moe(moe_path)
    moe_batch = support.with_hf_old_logprobs(moe_hf, support.make_batch(seed=3), seed=3)
    dense = _one_rank_bf16(hf_dir, host, batch)
    moe = _one_rank_bf16(moe_path, host, moe_batch)
    want = {"tp": fp32_step["metrics"], "pp": fp32_step["metrics"], "dp": fp32_step["metrics"], "ep": moe[0]}
    ranks = support.run_ranks(_bf16_two_rank_job, 2, tmp_path, hf_dir, moe_path, batch, moe_batch)
    for rank in ranks:
        for layout in ("tp", "pp", "dp", "ep"):
            metrics_one, before_one, after_one = moe if layout == "ep" else dense
            index = rank[f"{layout}_index"]
            assert rank[f"{layout}_dtypes"] == ({torch.bfloat16}, {torch.float32}), layout
            assert (rank[f"{layout}_before"] - before_one[index]).abs().max() < LOGPROB_ATOL, layout
            metrics = rank[f"{layout}_metrics"]
            assert metrics["train/skipped_step"] == 0.0
            assert metrics["train/grad_norm"] == pytest.approx(want[layout]["train/grad_norm"], rel=GRAD_NORM_RTOL)
            if layout in ("tp", "pp"):  # every rank holds the whole batch: its loss is the batch's
                assert metrics["train/loss"] == pytest.approx(want[layout]["train/loss"], rel=LOSS_RTOL), layout
            assert (rank[f"{layout}_after"] - after_one[index]).abs().max() < LOGPROB_ATOL, layout
            assert (rank[f"{layout}_after"] - rank[f"{layout}_before"]).abs().max() > 1e-3, layout  # it trained


def test_bfloat16_with_full_recomputation_gives_the_same_step(hf_dir, host, fp32_step):
    """Activation recomputation in 16-bit: the recomputed forward is the same bfloat16 arithmetic,
    so the step (loss, gradient norm, trained log-probs) equals the one without."""
    from megatron.core.utils import get_model_config

    batch = fp32_step["batch"]
    runs = []
    for backend_args in ({}, {"recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1}):
        worker = _bf16_worker(hf_dir, host, **backend_args)
        try:
            config = get_model_config(worker.modules[0])
            assert config.recompute_granularity == backend_args.get("recompute_granularity")
            assert config.bf16 and config.params_dtype == torch.bfloat16
            metrics = worker.train_mini_batch(batch, compute_norm(batch))
            runs.append((metrics, worker.forward(batch)["logprobs"]))
        finally:
            worker.close()
    (plain, plain_after), (recomputed, recomputed_after) = runs
    assert recomputed["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-6)
    assert recomputed["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-5)
    torch.testing.assert_close(recomputed_after, plain_after, rtol=0, atol=1e-5)
