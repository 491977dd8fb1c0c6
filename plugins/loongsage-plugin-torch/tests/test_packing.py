"""Padding-free micro-batches (loongsage_plugin_torch.trainer.packing): the plan, and the packed
path's log-probs, loss and gradients against the padded path on a tiny Qwen3."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_plugin_torch.trainer import create_train_worker
from loongsage_plugin_torch.trainer.packing import PackedRows, plan_micro_batches, prompt_groups
from torch_test_support import prompt_group_tensors

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, JobConfig, ModelConfig, TrainConfig
from loongsage_core.controller.batching import balanced_shards, shard_rows
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import AggregationSpec, Batch, PolicyLossOutput, PolicyLossSpec, TrainWorkerContext

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


def ratio_pg(x, eps=0.2):
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    return PolicyLossOutput(loss=torch.maximum(-x.advantages * ratio, -x.advantages * clipped), metrics={})


def token_mean(loss, mask, norm):
    return (loss * mask).sum() / norm.num_tokens


def Components() -> PluginHost:  # noqa: N802 - reads like the registry a backend receives
    """The real registry with this file's reference loss and aggregation."""
    host = PluginHost.create(enable=["torch"])
    host.register_specs(PolicyLossSpec(name="ratio_pg", fn=ratio_pg), AggregationSpec(name="token_mean", fn=token_mean))
    return host


def make_worker(max_tokens: int | None, model: dict | None = None, **train):
    job = JobConfig(model=ModelConfig(config=dict(model or TINY_QWEN3), tokenizer=TOKENIZER),
                    train=TrainConfig(lr=1e-3, grad_clip=0.0, max_tokens_per_micro_batch=max_tokens,
                                      **{"micro_batch_size": 3, **train}),
                    algorithm=AlgorithmConfig(policy_loss="ratio_pg", loss_agg="token_mean", entropy_coef=0.01))
    return create_train_worker(TrainWorkerContext(job=job, components=Components()))


def make_batch(rows: int = 7, width: int = 30, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, width + 1, (rows,), generator=g)
    lengths[1] = width
    t = torch.arange(width)
    attention = (t[None, :] < lengths[:, None]).long()
    prompt = torch.randint(2, 4, (rows,), generator=g)
    loss_mask = ((t[None, :] >= prompt[:, None]) & (t[None, :] < lengths[:, None])).long()
    ids = torch.randint(1, 512, (rows, width), generator=g) * attention
    adv = torch.randn(rows, 1, generator=g) * loss_mask
    return Batch(tensors={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
                          "advantages": adv.float()}, meta={"sample_id": [f"s{i}" for i in range(rows)]})


def assert_same_loss_and_gradients(reference, other, batch: Batch) -> None:
    """Both workers' loss metrics and gradients on ``batch`` agree (old log-probs: the reference's,
    perturbed, so the ratio is not 1)."""
    old = reference.forward(batch)["logprobs"]
    batch.tensors["old_logprobs"] = (old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
                                     ) * batch["loss_mask"]
    batch.tensors["rollout_logprobs"] = batch["old_logprobs"].clone()
    norm = compute_norm(batch)
    ma, mb = reference.accumulate_gradients(batch, norm), other.accumulate_gradients(batch, norm)
    assert ma["train/loss"] != 0.0
    for key in ("train/loss", "train/pg_loss", "train/entropy"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    ga = {n: p.grad for n, p in reference.model.named_parameters()}
    for n, p in other.model.named_parameters():
        torch.testing.assert_close(p.grad, ga[n], rtol=1e-4, atol=1e-6, msg=n)


def test_the_plan_respects_the_budget_and_takes_every_row_once():
    lengths = [30, 5, 12, 40, 7, 7, 18, 1]
    plan = plan_micro_batches(lengths, 32)
    assert sorted(r for rows in plan for r in rows) == list(range(len(lengths)))
    for rows in plan:
        assert sum(lengths[r] for r in rows) <= 32 or len(rows) == 1  # a row over the budget goes alone
        assert rows == sorted(rows)
    assert [3] in plan and len(plan) == 4  # 120 tokens in 4 bins of <= 32 (the 40 alone)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches(lengths, 0)


def test_the_plan_keeps_a_shared_prompt_together_and_counts_it_once():
    lengths = [30, 30, 30, 30, 12]
    groups = [[(0, 0), (1, 20), (2, 20), (3, 20)], [(4, 0)]]
    # 30 + 3 * 10 = 60 tokens for the group: one micro-batch of 64 holds it (4 x 30 would not)
    assert plan_micro_batches(lengths, 64, groups) == [[0, 1, 2, 3], [4]]
    # over the budget: cut into pieces, each piece's first row keeping the prompt
    # over the budget: cut into pieces of 30 + 10 tokens, each piece's first row keeping the prompt
    assert plan_micro_batches(lengths, 45, groups) == [[0, 1], [2, 3], [4]]


def test_ranks_get_equal_rows_and_near_equal_tokens():
    lengths = [100, 90, 80, 10, 10, 10, 5, 5]
    shards = balanced_shards(lengths, 2)
    assert [len(s) for s in shards] == [len(s) for s in shard_rows(8, 2)]
    assert sorted(r for s in shards for r in s) == list(range(8))
    tokens = [sum(lengths[r] for r in s) for s in shards]
    contiguous = [sum(lengths[r] for r in s) for s in shard_rows(8, 2)]
    assert max(tokens) - min(tokens) < max(contiguous) - min(contiguous)
    # the best split into two halves of 4 rows (brute force): one half must hold two of the three long rows
    from itertools import combinations

    best = min(abs(2 * sum(lengths[r] for r in half) - sum(lengths)) for half in combinations(range(8), 4))
    assert max(tokens) - min(tokens) == best == 50


def test_packed_rows_restart_positions_and_attend_within_a_row():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    packed = PackedRows(ids, (ids > 0).long())
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5]
    mask = packed.attention_mask(SimpleNamespace(_attn_implementation="sdpa"))[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True]
    assert mask[2].tolist() == [True, True, True, False, False]
    assert packed.attention_mask(SimpleNamespace(_attn_implementation="flash_attention_2")) is None
    # a model with sliding layers gets a mask per layer type, the sliding one within the window
    masks = packed.attention_mask(SimpleNamespace(_attn_implementation="sdpa", sliding_window=2,
                                                  layer_types=["full_attention", "sliding_attention"]))
    assert torch.equal(masks["full_attention"][0, 0], mask)
    assert masks["sliding_attention"][0, 0, 2].tolist() == [False, True, True, False, False]
    assert masks["sliding_attention"][0, 0, 4].tolist() == [False, False, False, True, True]
    # each token after a row's first is predicted by the state before it in its own row
    states, rows, cols = packed.predicting_states(torch.arange(5.0).view(1, 5, 1), ids > 0)
    assert (states.view(-1).tolist(), rows.tolist(), cols.tolist()) == ([0, 1, 3], [0, 0, 1], [1, 2, 1])


SLIDING = {**TINY_QWEN3, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}


@pytest.mark.parametrize("model", [TINY_QWEN3, SLIDING], ids=["full", "sliding_window"])
def test_packed_forward_equals_the_padded_forward(model):
    batch = make_batch()
    padded, packed = make_worker(None, model), make_worker(48, model)
    assert packed._micro_batch_rows(batch, 3) != [[0, 1, 2], [3, 4, 5], [6]]  # packed by tokens, reordered
    a, b = padded.forward(batch), packed.forward(batch)
    assert float(a["logprobs"].abs().sum()) > 0
    torch.testing.assert_close(b["logprobs"], a["logprobs"], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(b["entropy"], a["entropy"], rtol=1e-5, atol=2e-5)


def test_packed_training_gives_the_padded_loss_and_gradients():
    batch = make_batch(seed=1)
    padded, packed = make_worker(None), make_worker(40)
    assert_same_loss_and_gradients(padded, packed, batch)
    sa, sb = padded.optimizer_step(), packed.optimizer_step()
    assert sb["train/grad_norm"] == pytest.approx(sa["train/grad_norm"], rel=1e-5)


def make_critic(max_tokens: int | None, **backend_args):
    from loongsage_core.config import CriticConfig, RunConfig

    job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER),
                    train=TrainConfig(lr=1e-3, micro_batch_size=3, max_tokens_per_micro_batch=max_tokens,
                                      backend_args=backend_args),
                    algorithm=AlgorithmConfig(loss_agg="token_mean"), critic=CriticConfig(micro_batch_size=3),
                    run=RunConfig(seed=3))
    host = PluginHost.create(enable=["rl", "torch"])
    worker = create_train_worker(TrainWorkerContext(job=job, components=host, role="critic"))
    with torch.no_grad():  # a fresh head is all zeros: give it weights
        head = worker.model.value_head
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(1)))
    return worker


@pytest.mark.parametrize("case", ["packed", "shared_prompts", "shared_prompts_packed"])
def test_packed_or_shared_critic_values_and_gradients_equal_the_padded_ones(case):
    from loongsage_plugin_rl.advantages import gae

    from loongsage_hookspecs import AdvantageInputs

    if case == "packed":  # every real token's value, padding-free
        batch = make_batch(seed=2)
        reference, other = make_critic(None), make_critic(40)
    else:  # a group's prompt run once: the values at the trained tokens
        batch = make_group_batch(seed=4)
        reference = make_critic(None, share_prompts=False)
        other = make_critic(64 if case == "shared_prompts_packed" else None)
        micro = batch.select(list(range(len(batch))))
        assert other._prompt_groups(micro["input_ids"], micro["attention_mask"], micro["loss_mask"] > 0,
                                    one_row=True) is not None
    batch.tensors["loss_mask"] = batch["loss_mask"].float()
    batch.tensors["rewards"] = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    batch.tensors["group_index"] = torch.arange(7) // 4
    va, vb = reference.forward(batch)["values"], other.forward(batch)["values"]
    if case != "packed":  # a micro-batch that shares computes only its trained tokens' values
        va, vb = va * batch["loss_mask"], vb * batch["loss_mask"]
    assert float(va.abs().sum()) > 0
    torch.testing.assert_close(vb, va, rtol=1e-5, atol=2e-5)
    batch.tensors["values"] = va * batch["loss_mask"]
    batch.tensors["returns"] = gae(AdvantageInputs(rewards=batch["rewards"], response_mask=batch["loss_mask"],
                                                   group_index=batch["group_index"], values=batch["values"]),
                                   lam=0.9).returns
    assert_same_critic_loss_and_gradients(reference, other, batch)


def assert_same_critic_loss_and_gradients(reference, other, batch: Batch) -> None:
    """Both critics' value loss and gradients on ``batch`` (with ``values`` and ``returns``) agree."""
    norm = compute_norm(batch)
    ma, mb = reference.accumulate_gradients(batch, norm), other.accumulate_gradients(batch, norm)
    assert mb["train/critic_loss"] == pytest.approx(ma["train/critic_loss"], rel=1e-5)
    ga = {n: p.grad for n, p in reference.model.named_parameters()}
    for n, p in other.model.named_parameters():
        # float32 noise scales with the gradient (the random value head makes it large here)
        scale = max(float(ga[n].abs().max()), 1.0)
        torch.testing.assert_close(p.grad, ga[n], rtol=1e-4, atol=1e-6 * scale)


def make_group_batch(seed: int = 0) -> Batch:
    """Two prompts with three completions each, then a row of its own (see
    :func:`torch_test_support.prompt_group_tensors`)."""
    tensors = prompt_group_tensors(seed)
    return Batch(tensors=tensors, meta={"sample_id": [f"s{i}" for i in range(len(tensors["input_ids"]))]})


def test_prompt_groups_share_a_prompt_only_where_it_saves():
    batch = make_group_batch()
    wanted = batch["loss_mask"] > 0
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    groups = prompt_groups(batch["input_ids"], lengths, wanted)
    assert groups == [[(0, 0), (1, 7), (2, 7)], [(3, 0), (4, 10), (5, 10)], [(6, 0)]]
    # one sequence per group: kept while the prompt saves more than the longer attention costs
    assert prompt_groups(batch["input_ids"], lengths, wanted, hidden_size=64) == groups
    # a 4-token prompt and three 20-token completions: one sequence of 64 tokens adds
    # 64**2 - 3 * 24**2 = 2368 query-key pairs and saves 2 * 4 prompt tokens of 6 * hidden each
    ids = torch.randint(1, 512, (3, 24), generator=torch.Generator().manual_seed(0))
    ids[:, :4] = ids[0, :4]
    scored = torch.ones_like(ids, dtype=torch.bool)
    scored[:, :4] = False
    assert prompt_groups(ids, [24] * 3, scored, hidden_size=50) == [[(0, 0), (1, 4), (2, 4)]]
    assert prompt_groups(ids, [24] * 3, scored, hidden_size=49) == [[(0, 0)], [(1, 0)], [(2, 0)]]
    # a prompt under MIN_SHARED_TOKENS, or a row with nothing scored, stays alone
    short = wanted.clone()
    short[:3, 1:] = True
    assert prompt_groups(batch["input_ids"], lengths, short)[:3] == [[(0, 0)], [(1, 0)], [(2, 0)]]
    short[3] = False
    assert [(3, 0)] in prompt_groups(batch["input_ids"], lengths, short)


def test_a_sharing_row_attends_to_the_anchor_prompt_and_itself():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 4, 3, 2]])
    packed = PackedRows(ids, (ids > 0).long(), [[(0, 0), (1, 3)]], one_row=False)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 3, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]
    mask = packed.attention_mask(SimpleNamespace(_attn_implementation="sdpa"))[0, 0].int().tolist()
    assert mask[4] == [1, 1, 1, 1, 1, 0, 0, 0]  # the anchor's last token: its own row
    assert mask[6] == [1, 1, 1, 0, 0, 1, 1, 0]  # the second row's "3": the prompt, then its own tokens
    # the second row's first kept token ("4", position 3) is predicted by the anchor's "7"
    assert packed.predictor[5] == 2 and packed.predictor[6] == 5
    states, rows, cols = packed.predicting_states(torch.arange(8.0).view(1, 8, 1), ids > 0)
    assert states.view(-1).tolist() == [0, 1, 2, 3, 2, 5, 6]  # the second row's "4" from the anchor's "7"
    assert (rows.tolist(), cols.tolist()) == ([0, 0, 0, 0, 1, 1, 1], [1, 2, 3, 4, 3, 4, 5])
    with pytest.raises(ValueError, match="attention mask"):
        packed.attention_mask(SimpleNamespace(_attn_implementation="flash_attention_2"))


@pytest.mark.parametrize("max_tokens", [None, 40], ids=["rows", "token_budget"])
@pytest.mark.parametrize("model", [TINY_QWEN3, SLIDING], ids=["full", "sliding_window"])
def test_shared_prompts_give_the_unshared_log_probs(model, max_tokens):
    batch = make_group_batch(seed=1)
    plain = make_worker(max_tokens, model, backend_args={"share_prompts": False})
    shared = make_worker(max_tokens, model)
    micro = shared._to_device(batch.select(list(range(len(batch)))))
    groups = shared._prompt_groups(micro["input_ids"], micro["attention_mask"], micro["loss_mask"] > 0,
                                   one_row=bool(max_tokens))
    assert groups is not None and plain._prompt_groups(micro["input_ids"], micro["attention_mask"],
                                                       micro["loss_mask"] > 0, one_row=True) is None
    a, b = plain.forward(batch), shared.forward(batch)
    assert float(a["logprobs"].abs().sum()) > 0
    torch.testing.assert_close(b["logprobs"], a["logprobs"], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(b["entropy"], a["entropy"], rtol=1e-5, atol=2e-5)
    assert bool((b["logprobs"][batch["loss_mask"] == 0] == 0).all())


@pytest.mark.parametrize("max_tokens", [None, 64], ids=["rows", "token_budget"])
def test_shared_prompts_give_the_unshared_loss_and_gradients(max_tokens):
    batch = make_group_batch(seed=2)
    plain = make_worker(max_tokens, backend_args={"share_prompts": False}, micro_batch_size=7)
    shared = make_worker(max_tokens, micro_batch_size=7)
    assert_same_loss_and_gradients(plain, shared, batch)


@pytest.mark.parametrize("max_tokens", [None, 40], ids=["rows", "token_budget"])
def test_the_same_rows_in_another_order_give_bit_identical_log_probs(max_tokens):
    batch = make_group_batch(seed=3)
    batch.meta["trajectory_id"] = batch.meta["sample_id"]
    worker = make_worker(max_tokens)
    perm = [5, 2, 6, 0, 3, 1, 4]
    shuffled = batch.select(perm)
    plan, shuffled_plan = worker._micro_batch_rows(batch, 3), worker._micro_batch_rows(shuffled, 3)
    assert plan == [[perm[r] for r in rows] for rows in shuffled_plan]  # the same micro-batches
    assert any(set(rows) >= {0, 1, 2} or set(rows) >= {3, 4, 5} for rows in plan)  # a prompt's rows together
    assert torch.equal(worker.forward(shuffled)["logprobs"], worker.forward(batch)["logprobs"][perm])


TINY_LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 256, "tie_word_embeddings": True}


@pytest.mark.parametrize("layout", ["groups", "groups_token_budget", "token_budget"])
@pytest.mark.parametrize("model", [TINY_QWEN3, SLIDING, TINY_LLAMA], ids=["qwen3", "sliding_window", "llama"])
def test_the_prompt_tree_attention_gives_the_masked_attention_outputs_and_gradients(model, layout, monkeypatch):
    """Rows packed into one sequence (a group sharing its prompt, or a whole padding-free
    micro-batch) attend per row (shared prompt + own tokens) instead of over the whole packed
    sequence: the same log-probs, entropies and gradients as the masked path."""
    from loongsage_plugin_torch.trainer import packing, prompt_tree

    max_tokens = None if layout == "groups" else 40
    worker = make_worker(max_tokens, model)
    micro = worker._to_device(make_group_batch(seed=4).select(list(range(7))))
    ids, attention, scored = micro["input_ids"], micro["attention_mask"], micro["loss_mask"] > 0
    groups = None
    if layout != "token_budget":
        groups = worker._prompt_groups(ids, attention, scored, one_row=bool(max_tokens))
        assert groups is not None
    masks_built: list[int | None] = []
    real_sdpa = prompt_tree.banded_sdpa

    def spy_sdpa(*args, window, **kwargs):  # calls through: counts the layers the tree attention served
        masks_built.append(window)
        return real_sdpa(*args, window=window, **kwargs)

    monkeypatch.setattr(prompt_tree, "banded_sdpa", spy_sdpa)
    outputs, grads = {}, {}
    for tree in (True, False):
        worker.model.zero_grad(set_to_none=True)
        lp, ent = packing.packed_token_outputs(worker.model, ids, attention, compute_dtype=torch.float32,
                                               fp32_lm_head=False, entropy_grad=True, scored=scored, groups=groups,
                                               one_row=bool(max_tokens), tree_attention=tree)
        (lp.sum() + ent.sum()).backward()
        outputs[tree] = (lp.detach(), ent.detach())
        grads[tree] = {n: p.grad.clone() for n, p in worker.model.named_parameters() if p.grad is not None}
        assert worker.model.config._attn_implementation == "sdpa"  # switched back after the forward
    layers = worker.model.config.num_hidden_layers
    assert len(masks_built) == layers  # every layer of the first forward, none of the second
    if model is SLIDING:
        assert None in masks_built and 6 in masks_built
    assert float(outputs[False][0].abs().sum()) > 0
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(outputs[True][1], outputs[False][1], rtol=1e-5, atol=2e-5)
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_prompt_tree_layout_lists_each_row_with_its_prompt_keys():
    from loongsage_plugin_torch.trainer.prompt_tree import PromptTreeLayout, Segment

    # one packed row of 9 columns: an anchor of 4 tokens (prompt of 2), then a row keeping 3 tokens after it
    layout = PromptTreeLayout.build([Segment(0, 0, 4, 0, 0), Segment(0, 4, 3, 0, 2)], cols=9)
    assert layout.q_index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 0]]
    assert layout.q_valid.tolist() == [[True] * 4, [True, True, True, False]]
    assert layout.k_index.tolist() == [[0, 1, 2, 3, 0], [0, 1, 4, 5, 6]]
    mask = layout.banded.mask(0, 4, 0, 5, None)[:, 0]
    assert mask[1].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert mask[0, 3].int().tolist() == [1, 1, 1, 1, 0]  # the anchor's last token: its 4 keys, not the padding
    assert layout.banded.mask(0, 4, 0, 5, 2)[1, 0, 2].int().tolist() == [0, 0, 0, 1, 1]  # window 2: positions 3, 4


def test_rows_attend_per_row_where_the_masked_attention_wastes_the_most_pairs():
    """A GRPO group (8 rows of 24 new tokens after a 14-token prompt) packed alone keeps its mask;
    four groups in one padding-free sequence attend per row (:data:`TREE_PAIRS_PER_TOKEN`)."""
    from loongsage_plugin_torch.trainer.packing import TREE_PAIRS_PER_TOKEN

    g = torch.Generator().manual_seed(0)
    rows, prompt, new = 32, 14, 24
    ids = torch.randint(1, 512, (rows, prompt + new), generator=g)
    for r in range(rows):
        ids[r, :prompt] = ids[r - r % 8, :prompt]
    attention = torch.ones_like(ids)
    groups = [[(r, 0 if r % 8 == 0 else prompt) for r in range(k, k + 8)] for k in range(0, rows, 8)]
    alone, together = PackedRows(ids, attention, groups, one_row=False), PackedRows(ids, attention, groups)
    assert alone.packed_lengths == [prompt + 8 * new] * 4 and together.packed_lengths == [4 * (prompt + 8 * new)]
    assert not alone.tree_saves() and together.tree_saves()
    config = SimpleNamespace(_attn_implementation="sdpa")
    with alone.attention(config) as (mask, kwargs):
        assert mask is not None and kwargs == {}
    with together.attention(config) as (mask, kwargs):
        assert mask is None and set(kwargs) == {"prompt_tree"}
        assert config._attn_implementation == "loongsage_prompt_tree"
    assert config._attn_implementation == "sdpa"
    with alone.attention(config, tree=True) as (mask, kwargs):
        assert mask is None
    saved_per_token = (206 ** 2 - (8 * 24 * 38 + 14 * 14)) / 206
    assert saved_per_token < TREE_PAIRS_PER_TOKEN < 4 * saved_per_token


def test_a_packed_critic_attends_per_row_with_the_padded_values_and_gradients(monkeypatch):
    """40 rows in one padding-free micro-batch: the rule picks per-row attention for the critic's
    forward too (counted by a spy on the real layout), and its values and value-loss gradients
    equal the padded critic's."""
    from loongsage_plugin_torch.trainer import prompt_tree

    built: list[int] = []
    real_build = prompt_tree.PromptTreeLayout.build.__func__

    def spy_build(cls, segments, cols, device=None):  # calls through: counts the packed forwards
        built.append(len(segments))
        return real_build(cls, segments, cols, device)

    monkeypatch.setattr(prompt_tree.PromptTreeLayout, "build", classmethod(spy_build))
    batch = make_batch(rows=40, width=30, seed=5)
    reference, packed = make_critic(None), make_critic(4096)
    va, vb = reference.forward(batch)["values"], packed.forward(batch)["values"]
    assert built == [40] and float(va.abs().sum()) > 0  # one packed forward of the 40 rows, per row
    torch.testing.assert_close(vb, va, rtol=1e-5, atol=2e-5)
    batch.tensors["loss_mask"] = batch["loss_mask"].float()
    batch.tensors["values"] = va * batch["loss_mask"]
    batch.tensors["returns"] = batch["values"] + torch.randn(va.shape, generator=torch.Generator().manual_seed(6))
    assert_same_critic_loss_and_gradients(reference, packed, batch)
