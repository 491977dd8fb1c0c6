"""Tests of the embedded PyTorch train backend on a tiny Qwen3 model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from loongsage_plugin_torch.modeling import TINY_QWEN3, ModelLoadError, load_model
from loongsage_plugin_torch.trainer import TorchTrainWorker, create_train_worker
from loongsage_plugin_torch.trainer.logits import decoder_of

from loongsage_core.algorithms import compute_norm
from loongsage_core.backend_api.training import lr_factor
from loongsage_core.config import AlgorithmConfig, JobConfig, ModelConfig, TrainConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import (
    AggregationSpec,
    Batch,
    PolicyLossOutput,
    PolicyLossSpec,
    TrainWorker,
    TrainWorkerContext,
)

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


def ratio_pg(x, eps=0.2):
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    unclipped_loss, clipped_loss = -x.advantages * ratio, -x.advantages * clipped
    return PolicyLossOutput(loss=torch.maximum(unclipped_loss, clipped_loss),
                            metrics={"clip_ratio": (clipped_loss > unclipped_loss).float()})


def token_mean(loss, mask, norm):
    return (loss * mask).sum() / norm.num_tokens


def seq_mean_token_mean(loss, mask, norm):
    return ((loss * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / norm.num_sequences


def Components() -> PluginHost:  # noqa: N802 - reads like the registry a backend receives
    """The real registry (the torch plugin) with this file's reference loss and aggregations."""
    host = PluginHost.create(enable=["torch"])
    host.register_specs(PolicyLossSpec(name="ratio_pg", fn=ratio_pg),
                        AggregationSpec(name="token_mean", fn=token_mean),
                        AggregationSpec(name="seq_mean_token_mean", fn=seq_mean_token_mean))
    return host


def make_job(*, model=None, train=None, **algorithm) -> JobConfig:
    model = {"config": dict(TINY_QWEN3), "tokenizer": TOKENIZER, **(model or {})}
    train = {"lr": 1e-3, "micro_batch_size": 2, "grad_clip": 1.0, **(train or {})}
    algorithm = {"policy_loss": "ratio_pg", "loss_agg": "token_mean", "entropy_coef": 0.01, **algorithm}
    return JobConfig(model=ModelConfig(**model), train=TrainConfig(**train), algorithm=AlgorithmConfig(**algorithm))


def make_worker(job: JobConfig, **ctx) -> TorchTrainWorker:
    return create_train_worker(TrainWorkerContext(job=job, components=Components(), **ctx))


def make_batch(rows: int = 8, width: int = 24, seed: int = 0, vocab: int = 512) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    lengths[0] = width
    prompt = torch.randint(3, 8, (rows,), generator=g)
    t = torch.arange(width)
    attention = (t[None, :] < lengths[:, None]).long()
    loss_mask = ((t[None, :] >= prompt[:, None]) & (t[None, :] < lengths[:, None])).long()
    ids = torch.randint(1, vocab, (rows, width), generator=g) * attention
    adv = (torch.randn(rows, 1, generator=g) * loss_mask).contiguous()
    return Batch(tensors={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
                          "advantages": adv},
                 meta={"sample_id": [f"s{i}" for i in range(rows)]})


def with_old_logprobs(worker: TorchTrainWorker, batch: Batch) -> Batch:
    out = worker.forward(batch)
    old = out["logprobs"] + 0.05 * torch.randn(out["logprobs"].shape, generator=torch.Generator().manual_seed(7))
    batch.tensors["old_logprobs"] = old * batch["loss_mask"]
    batch.tensors["rollout_logprobs"] = batch["old_logprobs"].clone()
    return batch


def grads(worker: TorchTrainWorker) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in worker.model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------


def test_worker_satisfies_protocol_and_forward_matches_float64_reference():
    worker = make_worker(make_job())
    assert isinstance(worker, TrainWorker)
    batch = make_batch()
    out = worker.forward(batch)
    assert out["logprobs"].shape == batch["input_ids"].shape and out["logprobs"].dtype == torch.float32
    assert torch.all(out["logprobs"][:, 0] == 0) and torch.all(out["entropy"][:, 0] == 0)

    ref = copy.deepcopy(worker.model).double().eval()
    with torch.no_grad():
        logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits, -1)
    expected = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    # the response tokens (loss mask) are scored; prompts and padding hold 0
    valid = batch["loss_mask"][:, 1:].bool()
    assert bool((batch["attention_mask"][:, 1:].bool() & ~valid).any())  # some prompt tokens are left out
    torch.testing.assert_close(out["logprobs"][:, 1:][valid].double(), expected[valid], rtol=0, atol=2e-5)
    torch.testing.assert_close(out["entropy"][:, 1:][valid].double(), entropy[valid], rtol=0, atol=2e-5)
    assert torch.all(out["logprobs"][:, 1:][~valid] == 0) and torch.all(out["entropy"][:, 1:][~valid] == 0)
    # without a loss mask every real token is scored
    full = worker.forward(Batch(tensors={k: v for k, v in batch.tensors.items() if k != "loss_mask"}))
    real = batch["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(full["logprobs"][:, 1:][real].double(), expected[real], rtol=0, atol=2e-5)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_gradients_do_not_depend_on_micro_batch_split(agg):
    reference = None
    for micro in (8, 4, 1):  # 1, 2 and 8 micro-batches
        worker = make_worker(make_job(train={"micro_batch_size": micro}, loss_agg=agg))
        batch = with_old_logprobs(worker, make_batch(rows=8))
        metrics = worker.accumulate_gradients(batch, compute_norm(batch))
        result = (grads(worker), metrics)
        if reference is None:
            reference = result
            assert {"train/loss", "train/pg_loss", "train/entropy", "train/clip_ratio"} <= metrics.keys()
            continue
        for name, g in reference[0].items():
            torch.testing.assert_close(result[0][name], g, rtol=1e-4, atol=1e-6, msg=f"{micro=} {name}")
        for key, value in reference[1].items():
            assert result[1][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_train_steps_follow_schedule_clip_and_change_weights():
    job = make_job(train={"lr": 1e-2, "lr_schedule": "cosine", "lr_warmup_steps": 2, "total_steps": 6,
                          "min_lr_ratio": 0.1, "grad_clip": 1e-3})
    worker = make_worker(job)
    before = {n: t.clone() for n, t in worker.named_weights()}
    lrs = []
    for step in range(4):
        batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=step))
        metrics = worker.train_mini_batch(batch, compute_norm(batch))
        lrs.append(metrics["train/lr"])
        assert metrics["train/grad_norm"] > 1e-3  # pre-clip norm is reported
        assert metrics["train/skipped_step"] == 0.0
    expected = [1e-2 * lr_factor(k, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
                for k in range(4)]
    assert lrs == pytest.approx(expected)
    assert lrs[0] == pytest.approx(5e-3) and lrs[1] == pytest.approx(1e-2) and lrs[3] < lrs[2] == lrs[1]
    assert worker.global_step == 4
    after = dict(worker.named_weights())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_grad_clip_scales_the_gradient_the_optimizer_sees():
    seen, norms = {}, {}
    for clip in (0.0, 1e-3):
        worker = make_worker(make_job(train={"grad_clip": clip}))
        batch = with_old_logprobs(worker, make_batch(rows=4))
        worker.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, _clip=clip: seen.__setitem__(
                _clip, [p.grad.clone() for group in opt.param_groups for p in group["params"]]))
        worker.accumulate_gradients(batch, compute_norm(batch))
        norms[clip] = worker.optimizer_step()["train/grad_norm"]
    assert norms[0.0] == pytest.approx(norms[1e-3]) and norms[0.0] > 1e-2
    scale = 1e-3 / norms[0.0]
    for clipped, raw in zip(seen[1e-3], seen[0.0]):
        torch.testing.assert_close(clipped, raw * scale, rtol=1e-4, atol=1e-12)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in seen[1e-3]]))
    assert float(total) == pytest.approx(1e-3, rel=1e-4)


def test_lr_factor_shapes():
    kw = dict(warmup_steps=0, total_steps=10, min_lr_ratio=0.0)
    assert lr_factor(5, schedule="constant", **kw) == 1.0
    assert lr_factor(5, schedule="linear", **kw) == pytest.approx(0.5)
    assert lr_factor(5, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_factor(10, schedule="linear", **kw) == 0.0
    assert lr_factor(0, schedule="linear", warmup_steps=4, total_steps=10, min_lr_ratio=0.0) == 0.25
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_factor(0, schedule="step", **kw)


def test_resume_from_checkpoint_is_bit_identical(tmp_path):
    # attention dropout makes each step consume random numbers, so the RNG state must be restored too
    job = make_job(model={"config": {**TINY_QWEN3, "attention_dropout": 0.1}},
                   train={"lr_schedule": "cosine", "lr_warmup_steps": 1, "total_steps": 3})
    batches = [make_batch(rows=4, width=16, seed=10 + k) for k in range(3)]

    def run(worker, k):
        b = copy.deepcopy(batches[k])
        b.tensors["old_logprobs"] = torch.zeros_like(b["advantages"]) - 3.0 * b["loss_mask"]
        return worker.train_mini_batch(b, compute_norm(b))

    straight = make_worker(job)
    for k in range(3):
        last_straight = run(straight, k)

    first = make_worker(job)
    for k in range(2):
        run(first, k)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = make_worker(job)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.global_step == 2
    last_resumed = run(resumed, 2)

    assert last_resumed == last_straight
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    for a, b in zip(straight.optimizer.state.values(), resumed.optimizer.state.values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])

    # the check above is meaningful: without the saved RNG state the third step differs
    other = make_worker(job)
    other.load_checkpoint(str(tmp_path / "ckpt"))
    torch.manual_seed(12345)
    run(other, 2)
    assert any(not torch.equal(a, b) for a, b in zip(straight.model.state_dict().values(),
                                                   other.model.state_dict().values()))


def test_load_checkpoint_errors_name_the_directory(tmp_path):
    worker = make_worker(make_job())
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        worker.load_checkpoint(str(tmp_path / "nope"))


def test_save_hf_round_trips_through_transformers_and_load_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    worker = make_worker(make_job())
    batch = with_old_logprobs(worker, make_batch())
    worker.train_mini_batch(batch, compute_norm(batch))
    out = tmp_path / "hf"
    worker.save_hf(str(out))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"

    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    worker.model.eval()
    with torch.no_grad():
        want = worker.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(want, got)
    assert AutoTokenizer.from_pretrained(str(out)).encode("hello world")

    from_dir = make_job(model={"path": str(out), "config": {}, "tokenizer": None})
    again = make_worker(from_dir)
    for (name, a), (_, b) in zip(worker.named_weights(), again.named_weights()):
        assert torch.equal(a, b), name
    assert torch.equal(worker.forward(batch)["logprobs"], again.forward(batch)["logprobs"])
    assert again.job.model.tokenizer is None  # tokenizer comes from the directory
    again.save_hf(str(tmp_path / "hf2"))
    assert (tmp_path / "hf2" / "tokenizer.json").is_file()


def test_named_weights_are_hf_names_without_tied_duplicates():
    worker = make_worker(make_job())
    names = [n for n, _ in worker.named_weights()]
    hf = load_model(make_job())
    assert set(names) == set(hf.state_dict()) - {"lm_head.weight"}  # tied to the embeddings
    assert len(names) == len(set(names))


def test_bf16_with_fp32_lm_head_computes_logits_in_float32():
    job = make_job(model={"dtype": "bfloat16", "fp32_lm_head": True})
    worker = make_worker(job)
    assert next(worker.model.parameters()).dtype == torch.float32  # float32 master weights
    assert all(t.dtype == torch.bfloat16 for _, t in worker.named_weights())
    batch = make_batch(rows=2, width=12)
    out = worker.forward(batch)
    model = worker.model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = decoder_of(model)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   use_cache=False).last_hidden_state[:, :-1]
    w = model.lm_head.weight
    fp32 = torch.log_softmax(hidden.float() @ w.float().T, -1)
    bf16 = torch.log_softmax((hidden.bfloat16() @ w.bfloat16().T).float(), -1)
    ids = batch["input_ids"][:, 1:, None]
    valid = batch["loss_mask"][:, 1:].bool()  # the scored tokens
    got = out["logprobs"][:, 1:][valid]
    want_fp32 = fp32.gather(-1, ids).squeeze(-1)[valid]
    want_bf16 = bf16.gather(-1, ids).squeeze(-1)[valid]
    assert (want_fp32 - want_bf16).abs().max() > 1e-3  # the two heads are distinguishable
    torch.testing.assert_close(got, want_fp32, rtol=0, atol=1e-5)

    plain = make_worker(make_job(model={"dtype": "bfloat16"}))
    torch.testing.assert_close(plain.forward(batch)["logprobs"][:, 1:][valid], want_bf16, rtol=0, atol=1e-5)
    metrics = plain.train_mini_batch(with_old_logprobs(plain, batch), compute_norm(batch))
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_reference_role_is_frozen_and_takes_weight_updates():
    job = make_job()
    ref = make_worker(job, role="reference")
    actor = make_worker(job)
    batch = with_old_logprobs(actor, make_batch())
    assert torch.equal(ref.forward(batch)["logprobs"], actor.forward(batch)["logprobs"])
    assert not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(RuntimeError, match="forward-only"):
        ref.train_mini_batch(batch, compute_norm(batch))
    actor.train_mini_batch(batch, compute_norm(batch))
    assert not torch.equal(ref.forward(batch)["logprobs"], actor.forward(batch)["logprobs"])
    assert ref.load_weights(actor.named_weights()) == len(list(actor.named_weights()))
    assert torch.equal(ref.forward(batch)["logprobs"], actor.forward(batch)["logprobs"])
    with pytest.raises(KeyError, match="no_such"):
        ref.load_weights([("no_such.weight", torch.zeros(1))])


def test_gradient_checkpointing_gives_the_same_gradients():
    results = []
    for flag in (False, True):
        worker = make_worker(make_job(train={"gradient_checkpointing": flag}))
        batch = with_old_logprobs(worker, make_batch())
        worker.accumulate_gradients(batch, compute_norm(batch))
        results.append(grads(worker))
    for name, g in results[0].items():
        torch.testing.assert_close(results[1][name], g, rtol=1e-5, atol=1e-7)


def test_offload_and_onload_keep_training_state_on_cpu():
    worker = make_worker(make_job())
    batch = with_old_logprobs(worker, make_batch())
    worker.train_mini_batch(batch, compute_norm(batch))
    before = {n: t.clone() for n, t in worker.named_weights()}
    worker.offload()
    worker.onload()
    assert all(torch.equal(before[n], t) for n, t in worker.named_weights())
    worker.train_mini_batch(batch, compute_norm(batch))


def test_bad_inputs_raise_clear_errors(tmp_path):
    missing = tmp_path / "no_model_here"
    with pytest.raises(ModelLoadError, match=str(missing)):
        make_worker(make_job(model={"path": str(missing), "config": {}}))
    with pytest.raises(ValueError, match="backend_args: unknown keys \\['devise'\\]"):
        make_worker(make_job(train={"backend_args": {"devise": "cpu"}}))
    with pytest.raises(ValueError, match="role 'policy'"):
        make_worker(make_job(), role="policy")
    with pytest.raises(ValueError, match="float16"):
        make_worker(make_job(model={"dtype": "float16"}))
    with pytest.raises(ValueError, match="micro_batch_size"):
        make_worker(make_job(train={"micro_batch_size": 0}))
    with pytest.raises(ValueError, match="master_port"):
        make_worker(make_job(), rank=0, world_size=2, master_port=0)
    worker = make_worker(make_job())
    batch = make_batch()
    with pytest.raises(Exception, match="old_logprobs"):
        worker.train_mini_batch(batch, compute_norm(batch))


def test_optimizer_step_reports_weights_that_became_non_finite_without_rollback():
    """With ``rollback_overflow = false`` the step stays and is reported: the host stops the run."""
    worker = make_worker(make_job(train={"backend_args": {"rollback_overflow": False}}))
    assert worker.optimizer_step()["train/nonfinite_weights"] == 0.0  # zero gradients: a finite step
    with torch.no_grad():
        next(worker.model.parameters()).fill_(float("inf"))
    metrics = worker.optimizer_step()
    assert metrics["train/skipped_step"] == 0.0 and metrics["train/nonfinite_weights"] == 1.0
    assert metrics["train/rolled_back_step"] == 0.0


def optimizer_state(worker: TorchTrainWorker) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in worker.optimizer.state[p].items()} for p in worker.model.parameters()
            if p in worker.optimizer.state]


def assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.int32) if a[name].dtype == torch.float32 else a[name],
                           b[name].view(torch.int32) if b[name].dtype == torch.float32 else b[name]), name


def test_adamw_is_the_fused_kernel_with_the_for_each_update():
    fused, plain = make_worker(make_job()), make_worker(make_job())
    assert fused.optimizer.defaults["fused"]  # torch's one-kernel AdamW, on the CPU too
    plain.optimizer = torch.optim.AdamW(list(plain.model.parameters()), **{
        k: v for k, v in fused.optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")})
    start = {n: p.detach().clone() for n, p in fused.model.named_parameters()}
    for worker in (fused, plain):
        for seed in (1, 2):
            batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=seed))
            worker.train_mini_batch(batch, compute_norm(batch))
    assert max(float((p - start[n]).abs().max()) for n, p in fused.model.named_parameters()) > 1e-4
    for (name, a), b in zip(fused.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_an_optimizer_step_that_overflows_the_weights_is_rolled_back_bit_for_bit():
    worker = make_worker(make_job(train={"lr": 1e-3}))
    batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=1))
    assert worker.train_mini_batch(batch, compute_norm(batch))["train/rolled_back_step"] == 0.0
    params = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    state = optimizer_state(worker)
    # a finite learning rate whose AdamW update overflows float32 (|update| ~ lr), for this step only
    worker.optimizer.param_groups[0]["lr"] = 1e39
    batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=2))
    metrics = worker.train_mini_batch(batch, compute_norm(batch))
    assert metrics["train/rolled_back_step"] == 1.0 and metrics["train/skipped_step"] == 1.0
    assert metrics["train/nonfinite_weights"] > 0 and metrics["train/lr"] == 1e39
    assert_same_bits({n: p.detach() for n, p in worker.model.named_parameters()}, params)
    for before, after in zip(state, optimizer_state(worker)):
        assert_same_bits(after, before)  # Adam's step count and moments as before the step
    assert all(torch.isfinite(t).all() for _, t in worker.named_weights())
    # the schedule moved on (lr back to the schedule's), and the next step trains
    batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=3))
    metrics = worker.train_mini_batch(batch, compute_norm(batch))
    assert metrics["train/rolled_back_step"] == 0.0 and metrics["train/lr"] == pytest.approx(1e-3)
    assert any(not torch.equal(p.detach(), params[n]) for n, p in worker.model.named_parameters())
    assert worker.global_step == 3


def test_an_update_that_makes_weights_infinite_is_rolled_back():
    """Here the step completes (no error from torch) and leaves ``inf`` in the weights."""
    worker = make_worker(make_job(train={"lr": 1e-3}))
    batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=1))
    worker.train_mini_batch(batch, compute_norm(batch))
    with torch.no_grad():
        next(worker.model.parameters())[0, 0] = 1000.0  # decoupled decay of 1e37 overflows this entry
    params = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    state = optimizer_state(worker)
    worker.optimizer.param_groups[0]["weight_decay"] = 1e40  # with lr = 1e-3: p *= 1 - 1e37
    batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=2))
    metrics = worker.train_mini_batch(batch, compute_norm(batch))
    assert metrics["train/rolled_back_step"] == 1.0 and metrics["train/nonfinite_weights"] >= 1.0
    assert_same_bits({n: p.detach() for n, p in worker.model.named_parameters()}, params)
    for before, after in zip(state, optimizer_state(worker)):
        assert_same_bits(after, before)


def test_steps_that_cannot_overflow_take_no_snapshot_and_those_that_might_do(monkeypatch):
    """The copy that takes a step back (three times the weights' bytes) is made only for a step
    whose weight bound comes near the float range; a huge lr still gets it, and is rolled back."""
    from loongsage_plugin_torch.trainer import rollback, training_step

    taken = []

    class CountedSnapshot(rollback.StepSnapshot):  # the real snapshot, counted
        def __init__(self, *args, **kwargs):
            taken.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(training_step, "StepSnapshot", CountedSnapshot)
    worker = make_worker(make_job(train={"lr": 1e-3}))
    for seed in (1, 2):
        batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=seed))
        assert worker.train_mini_batch(batch, compute_norm(batch))["train/skipped_step"] == 0.0
    assert taken == []
    params = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    worker.optimizer.param_groups[0]["lr"] = 1e39
    batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=3))
    assert worker.train_mini_batch(batch, compute_norm(batch))["train/rolled_back_step"] == 1.0
    assert taken == [1]
    assert_same_bits({n: p.detach() for n, p in worker.model.named_parameters()}, params)


@pytest.mark.parametrize("lr,eps,decay,betas", [(1e-3, 1e-8, 0.01, (0.9, 0.999)), (10.0, 1e-12, 0.5, (0.5, 0.9)),
                                                (1e-5, 1e-6, 0.0, (0.0, 0.99)), (3.0, 1e-3, 2.0, (0.99, 0.999))])
def test_the_adamw_weight_bound_holds_for_the_fused_kernel(lr, eps, decay, betas):
    """Over several steps of torch's fused AdamW with gradients of bounded size (moments built up
    on the way), no weight ever exceeds the bound computed before its step."""
    from loongsage_plugin_torch.trainer.rollback import adamw_weight_bound

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 7, generator=g) * 3), torch.nn.Parameter(torch.randn(11, generator=g))]
    opt = torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=decay, betas=betas, fused=True)
    for step in range(6):
        largest_grad = 10.0 ** (step % 3 - 1)
        for p in params:  # gradients of every sign, as large as allowed in places
            p.grad = (torch.rand(p.shape, generator=g) * 2 - 1) * largest_grad
            p.grad.view(-1)[0] = largest_grad
        bound = adamw_weight_bound(opt, largest_grad)
        opt.step()
        assert 0 < max(float(p.detach().abs().max()) for p in params) <= bound


def test_the_adamw_weight_bound_refuses_what_it_does_not_cover():
    from loongsage_plugin_torch.trainer.rollback import adamw_step_cannot_overflow, adamw_weight_bound

    def adamw(**kwargs):
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 0.5)
        return p, torch.optim.AdamW([p], **{"lr": 1e-3, **kwargs})

    p, opt = adamw()
    assert adamw_step_cannot_overflow(opt, 0.5) and adamw_weight_bound(opt, 0.5) < 1e6
    assert not adamw_step_cannot_overflow(opt, float("inf")) and not adamw_step_cannot_overflow(opt, 1e19)
    assert not adamw_step_cannot_overflow(adamw(lr=1e39)[1], 0.5)  # the update alone overflows
    assert not adamw_step_cannot_overflow(adamw(lr=1e39)[1], 0.0)  # a zero update times an inf step size
    assert not adamw_step_cannot_overflow(adamw(lr=1e-3, weight_decay=1e40)[1], 0.0)
    assert not adamw_step_cannot_overflow(adamw(lr=1e-3, weight_decay=1e40)[1], 0.5)  # the decay does
    assert adamw_weight_bound(adamw(eps=0.0)[1], 0.5) == float("inf")  # no floor under the denominator
    with torch.no_grad():
        p[2] = float("nan")
    assert adamw_weight_bound(opt, 0.5) == float("inf")
    p, opt = adamw()
    opt.step()
    opt.state[p]["exp_avg"][1] = float("inf")  # a broken first moment
    assert adamw_weight_bound(opt, 0.5) == float("inf")
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert adamw_weight_bound(sgd, 0.5) == float("inf")  # another optimizer: the snapshot is taken


def test_nonfinite_count_counts_parameters_holding_inf_or_nan_and_not_huge_finite_ones():
    from loongsage_plugin_torch.trainer.rollback import nonfinite_count

    params = [torch.ones(3, 4), torch.ones(5), torch.full((2, 2), 1.0, dtype=torch.bfloat16)]
    assert nonfinite_count(params) == 0 and nonfinite_count([]) == 0
    huge = [torch.full((4,), 3e38), torch.full((3,), -3e38), torch.full((2,), 3e38)]
    assert nonfinite_count(huge) == 0  # finite weights whose sum overflows: none is counted
    params[0][1, 2] = float("nan")
    params[2][0, 0] = float("-inf")
    assert nonfinite_count(params) == 2
    params[1][4] = float("inf")
    assert nonfinite_count(params) == 3


def test_a_first_step_that_overflows_leaves_no_optimizer_state():
    worker = make_worker(make_job(train={"lr": 1e39}))
    params = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    batch = with_old_logprobs(worker, make_batch(rows=4, width=16, seed=1))
    assert worker.train_mini_batch(batch, compute_norm(batch))["train/rolled_back_step"] == 1.0
    assert len(worker.optimizer.state) == 0  # as before the first step: no Adam moments yet
    assert_same_bits({n: p.detach() for n, p in worker.model.named_parameters()}, params)
