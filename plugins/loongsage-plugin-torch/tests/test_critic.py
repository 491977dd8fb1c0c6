"""Tests of the torch backend's critic (role "critic") and its clipped value loss, on a tiny Qwen3."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from loongsage_plugin_rl.advantages import gae
from loongsage_plugin_torch.modeling import TINY_QWEN3, load_model
from loongsage_plugin_torch.trainer import TorchCriticWorker, create_train_worker
from loongsage_plugin_torch.trainer.critic import VALUE_HEAD_FILE
from loongsage_plugin_torch.trainer.logits import decoder_of
from loongsage_plugin_torch.trainer.value_loss import clipped_value_loss

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, CriticConfig, JobConfig, ModelConfig, RunConfig, TrainConfig
from loongsage_core.controller.critic import explained_variance
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import AdvantageInputs, Batch, TrainWorker, TrainWorkerContext

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


def Aggregations() -> PluginHost:  # noqa: N802 - reads like the registry a backend receives
    """The real registry with the rl and torch plugins (loss aggregations, policy losses)."""
    return PluginHost.create(enable=["rl", "torch"])


def make_job(*, critic=None, model=None, train=None, loss_agg="token_mean") -> JobConfig:
    model = {"config": dict(TINY_QWEN3), "tokenizer": TOKENIZER, **(model or {})}
    train = {"lr": 1e-3, "micro_batch_size": 2, "grad_clip": 1.0, **(train or {})}
    return JobConfig(model=ModelConfig(**model), train=TrainConfig(**train),
                     algorithm=AlgorithmConfig(loss_agg=loss_agg), critic=CriticConfig(**(critic or {})),
                     run=RunConfig(seed=3))


def make_critic(job: JobConfig) -> TorchCriticWorker:
    return create_train_worker(TrainWorkerContext(job=job, components=Aggregations(), role="critic"))


def make_batch(rows: int = 6, width: int = 20, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    lengths[0] = width
    prompt = torch.randint(3, 7, (rows,), generator=g)
    t = torch.arange(width)
    attention = (t[None, :] < lengths[:, None]).long()
    loss_mask = ((t[None, :] >= prompt[:, None]) & (t[None, :] < lengths[:, None])).float()
    ids = torch.randint(1, 512, (rows, width), generator=g) * attention
    return Batch(tensors={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
                          "rewards": torch.randint(0, 2, (rows,), generator=g).float(),
                          "group_index": torch.arange(rows) // 3})


def randomise_head(worker: TorchCriticWorker, seed: int = 1) -> None:
    """A fresh value head is all zeros; give it weights so the values depend on the hidden states."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = worker.model.value_head
        head.weight.copy_(torch.randn(head.weight.shape, generator=g))
        head.bias.fill_(0.25)


def with_targets(worker: TorchCriticWorker, batch: Batch) -> Batch:
    """``values`` from the critic and ``returns`` from GAE, as the controller fills them."""
    batch.tensors["values"] = worker.forward(batch)["values"] * batch["loss_mask"]
    out = gae(AdvantageInputs(rewards=batch["rewards"], response_mask=batch["loss_mask"],
                              group_index=batch["group_index"], values=batch["values"]), lam=0.9)
    batch.tensors["returns"] = out.returns
    return batch


# ---------------------------------------------------------------------------------------------
# Values: shape, alignment, initialisation
# ---------------------------------------------------------------------------------------------


def test_critic_starts_from_the_policy_backbone_and_predicts_zero():
    job = make_job()
    worker = make_critic(job)
    assert isinstance(worker, TorchCriticWorker) and isinstance(worker, TrainWorker)
    policy = decoder_of(load_model(job)).state_dict()
    critic = worker.model.backbone.state_dict()
    assert policy.keys() == critic.keys()
    assert all(torch.equal(policy[k], critic[k]) for k in policy)
    batch = make_batch()
    values = worker.forward(batch)["values"]
    assert values.shape == batch["input_ids"].shape and values.dtype == torch.float32
    assert torch.all(values == 0)  # zero-initialised head: the first advantages are the plain returns


def test_critic_path_overrides_the_policy_checkpoint(tmp_path):
    other = load_model(make_job(model={"seed": 11}))
    other.save_pretrained(tmp_path / "critic_init")
    worker = make_critic(make_job(critic={"path": str(tmp_path / "critic_init")}))
    expected = decoder_of(other).state_dict()
    got = worker.model.backbone.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    policy = decoder_of(load_model(make_job())).state_dict()
    assert not torch.equal(policy["embed_tokens.weight"], got["embed_tokens.weight"])


def test_values_are_aligned_like_logprobs():
    worker = make_critic(make_job())
    randomise_head(worker)
    batch = make_batch()
    values = worker.forward(batch)["values"]
    attention = batch["attention_mask"].bool()
    assert torch.all(values[:, 0] == 0) and torch.all(values[~attention] == 0)

    # float64 reference: values[:, t] = head(hidden[:, t - 1])
    ref = copy.deepcopy(worker.model).double().eval()
    with torch.no_grad():
        hidden = ref.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        expected = ref.value_head(hidden[:, :-1]).squeeze(-1)
    valid = attention[:, 1:]
    torch.testing.assert_close(values[:, 1:][valid].double(), expected[valid], rtol=0, atol=1e-4)

    # values[:, t] is the state before token t: changing token t moves values from t + 1 on, not t
    t = 9
    changed = copy.deepcopy(batch)
    changed.tensors["input_ids"][0, t] = (batch["input_ids"][0, t] % 511) + 1
    moved = worker.forward(changed)["values"]
    assert torch.equal(moved[0, :t + 1], values[0, :t + 1])
    assert not torch.allclose(moved[0, t + 1:], values[0, t + 1:])


def test_forward_does_not_depend_on_chunking_or_padding():
    job = make_job(train={"backend_args": {"forward_micro_batch_size": 1}})
    one = make_critic(job)
    all_rows = make_critic(make_job(train={"micro_batch_size": 6}))
    randomise_head(one)
    randomise_head(all_rows)
    batch = make_batch()
    torch.testing.assert_close(one.forward(batch)["values"], all_rows.forward(batch)["values"], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------


def reference_value_loss(values, old, returns, mask, clip):
    """Float64, element by element: 0.5 * max((v - R)^2, (clip(v) - R)^2) summed over the mask,
    divided by the number of trained tokens (token_mean)."""
    total, tokens, clipped = 0.0, 0, 0
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            if mask[i, t] == 0:
                continue
            v, o, r = float(values[i, t]), float(old[i, t]), float(returns[i, t])
            vc = o + min(max(v - o, -clip), clip)
            a, b = (v - r) ** 2, (vc - r) ** 2
            total += 0.5 * max(a, b)
            clipped += b > a
            tokens += 1
    return total / tokens, clipped / tokens


def loss_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(5, 9, generator=g) > 0.3).float()
    old = torch.randn(5, 9, generator=g, dtype=torch.float64)
    values = old + 0.4 * torch.randn(5, 9, generator=g, dtype=torch.float64)  # many beyond clip = 0.2
    returns = torch.randn(5, 9, generator=g, dtype=torch.float64)
    values[mask == 0] = float("nan")  # padding garbage must not reach the loss
    old[mask == 0] = float("inf")
    return values, old, returns, mask


def test_value_loss_matches_float64_reference_and_clips():
    agg = Aggregations().get("loss_aggregation", "token_mean").fn
    values, old, returns, mask = loss_inputs()
    v = values.clone().requires_grad_(True)
    loss, metrics = clipped_value_loss(v, old, returns, mask, compute_norm(Batch(tensors={"loss_mask": mask})),
                                       clip=0.2, aggregate=agg)
    expected, clip_frac = reference_value_loss(values, old, returns, mask, 0.2)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    assert 0.1 < clip_frac < 0.9  # both branches occur
    on = mask > 0
    assert float(metrics["value_clip_frac"][on].mean()) == pytest.approx(clip_frac, rel=1e-12)
    loss.backward()
    grad = v.grad
    assert torch.isfinite(grad).all() and torch.all(grad[~on] == 0)
    # where the clipped term wins and V left the clip range, the gradient is 0 (V_clip is constant);
    # elsewhere it is (V - R) / num_tokens
    outside = (values - old).abs() > 0.2
    clipped_wins = metrics["value_clip_frac"] > 0
    frozen = on & clipped_wins & outside
    assert frozen.any()
    assert torch.all(grad[frozen] == 0)
    live = on & ~clipped_wins
    torch.testing.assert_close(grad[live], ((values - returns) / on.sum())[live], rtol=1e-12, atol=0)

    # clip = 0: plain 0.5 * MSE and nothing counted as clipped
    plain, m0 = clipped_value_loss(values, old, returns, mask, compute_norm(Batch(tensors={"loss_mask": mask})),
                                   clip=0.0, aggregate=agg)
    assert float(plain) == pytest.approx(float((0.5 * (values - returns) ** 2)[on].mean()), rel=1e-12)
    assert float(m0["value_clip_frac"].sum()) == 0.0
    with pytest.raises(ValueError, match="clip must be >= 0"):
        clipped_value_loss(values, old, returns, mask, compute_norm(Batch(tensors={"loss_mask": mask})),
                           clip=-0.1, aggregate=agg)


@pytest.mark.parametrize("agg_name", ["token_mean", "seq_mean_token_sum_norm"])
def test_value_loss_uses_the_global_norm(agg_name):
    """Summed over micro-batches with the mini-batch's norm, the loss equals the whole-batch loss."""
    agg = Aggregations().get("loss_aggregation", agg_name).fn
    values, old, returns, mask = loss_inputs(seed=1)
    norm = compute_norm(Batch(tensors={"loss_mask": mask}))
    whole, _ = clipped_value_loss(values, old, returns, mask, norm, clip=0.2, aggregate=agg)
    parts = sum(float(clipped_value_loss(values[r], old[r], returns[r], mask[r], norm, clip=0.2, aggregate=agg)[0])
                for r in (slice(0, 2), slice(2, 3), slice(3, 5)))
    assert parts == pytest.approx(float(whole), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Training, checkpoints, export
# ---------------------------------------------------------------------------------------------


def test_training_fits_the_returns_and_reports_metrics():
    worker = make_critic(make_job(critic={"lr": 3e-3, "value_clip": 0.5, "micro_batch_size": 3}))
    batch = with_targets(worker, make_batch(rows=6))
    losses = []
    for _ in range(12):
        batch.tensors["values"] = worker.forward(batch)["values"] * batch["loss_mask"]
        metrics = worker.train_mini_batch(batch, compute_norm(batch))
        losses.append(metrics["train/critic_loss"])
    assert {"train/critic_loss", "train/value_mean", "train/value_clip_frac", "train/critic_grad_norm",
            "train/critic_lr", "train/critic_skipped_step"} <= metrics.keys()
    assert metrics["train/critic_lr"] == pytest.approx(3e-3)
    assert losses[-1] < 0.5 * losses[0]
    values = worker.forward(batch)["values"]
    assert explained_variance(values, batch["returns"], batch["loss_mask"]) > 0.5
    with pytest.raises(KeyError, match="'returns'"):
        del batch.tensors["returns"]
        worker.train_mini_batch(batch, compute_norm(batch))


def test_checkpoint_resume_is_bit_identical(tmp_path):
    job = make_job(critic={"lr": 3e-3}, train={"lr_schedule": "cosine", "total_steps": 4})
    batches = [make_batch(rows=4, width=14, seed=20 + k) for k in range(3)]
    targets = make_critic(job)
    randomise_head(targets)
    batches = [with_targets(targets, b) for b in batches]

    def run(worker, k):
        b = copy.deepcopy(batches[k])
        b.tensors["values"] = worker.forward(b)["values"] * b["loss_mask"]
        return worker.train_mini_batch(b, compute_norm(b))

    straight = make_critic(job)
    for k in range(3):
        last = run(straight, k)
    first = make_critic(job)
    run(first, 0)
    first.save_checkpoint(str(tmp_path / "critic_rank_0"))
    resumed = make_critic(job)
    resumed.load_checkpoint(str(tmp_path / "critic_rank_0"))
    assert resumed.global_step == 1
    run(resumed, 1)
    again = run(resumed, 2)
    assert again == last
    a, b = dict(straight.named_weights()), dict(resumed.named_weights())
    assert a.keys() == b.keys() and "value_head.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(FileNotFoundError, match="trainer_state.pt"):
        make_critic(job).load_checkpoint(str(tmp_path / "missing"))


def test_policy_checkpoint_is_refused(tmp_path):
    from loongsage_plugin_torch.trainer import TorchTrainWorker

    policy = TorchTrainWorker(TrainWorkerContext(job=make_job(), components=Aggregations(), role="actor"))
    policy.save_checkpoint(str(tmp_path / "rank_0"))
    with pytest.raises(ValueError, match="saved by a 'actor' worker, not a critic"):
        make_critic(make_job()).load_checkpoint(str(tmp_path / "rank_0"))


def test_save_hf_round_trips_backbone_and_head(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModel

    worker = make_critic(make_job())
    randomise_head(worker)
    worker.save_hf(str(tmp_path / "critic_hf"))
    backbone = AutoModel.from_pretrained(tmp_path / "critic_hf").eval()
    head = load_file(tmp_path / "critic_hf" / VALUE_HEAD_FILE)
    batch = make_batch(rows=3)
    with torch.no_grad():
        hidden = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    expected = torch.nn.functional.pad((hidden[:, :-1] @ head["weight"].T + head["bias"]).squeeze(-1), (1, 0))
    expected = expected * batch["attention_mask"]
    torch.testing.assert_close(worker.forward(batch)["values"], expected, rtol=0, atol=1e-5)


def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="role must be 'critic'"):
        TorchCriticWorker(TrainWorkerContext(job=make_job(), components=Aggregations(), role="actor"))
    with pytest.raises(ValueError, match="float16"):
        make_critic(make_job(model={"dtype": "float16"}))


# ---------------------------------------------------------------------------------------------
# Explained variance
# ---------------------------------------------------------------------------------------------


def test_explained_variance():
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(4, 10, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 10, generator=g) > 0.2).float()
    on = mask > 0
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    mean = torch.full_like(returns, float(returns[on].mean()))
    assert explained_variance(mean, returns, mask) == pytest.approx(0.0, abs=1e-12)
    noisy = returns + 0.5 * torch.randn(4, 10, generator=g, dtype=torch.float64)
    r, v = returns[on], noisy[on]
    expected = 1 - float(((r - v) - (r - v).mean()).pow(2).mean() / (r - r.mean()).pow(2).mean())
    assert explained_variance(noisy, returns, mask) == pytest.approx(expected, rel=1e-12)
    garbage = noisy.clone()
    garbage[~on] = 1e6  # padding does not count
    assert explained_variance(garbage, returns, mask) == pytest.approx(expected, rel=1e-12)
    assert explained_variance(-returns, returns, mask) < -1  # worse than predicting the mean
    assert explained_variance(noisy, torch.ones_like(returns), mask) is None
    assert explained_variance(noisy, returns, torch.zeros_like(mask)) is None
    with pytest.raises(ValueError, match="same shape"):
        explained_variance(noisy[:, :5], returns, mask)
