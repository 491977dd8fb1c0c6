"""Helpers several of the megatron plugin's test modules share: the tiny Qwen3-MoE checkpoint, the
job and batch builders, the transformers reference outputs, the Router Replay job and batch, and
the runner of jobs on spawned ranks with their rendezvous ports.

The tests run with ``--import-mode=importlib``, so a test module cannot import another one;
``conftest.py`` puts this folder on ``sys.path`` so that every test module (and every process a
test spawns) can ``import megatron_test_support``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from loongsage_plugin_torch.trainer.router_replay import RouterReplay

from loongsage_core.config import AlgorithmConfig, JobConfig, ModelConfig, TrainConfig
from loongsage_core.rendezvous import host_rendezvous
from loongsage_hookspecs import Batch

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


# -- models ----------------------------------------------------------------------------------------

# A tiny Qwen3-MoE: every layer sparse, 4 experts, top-2 with renormalised top-k weights (as the
# released Qwen3-MoE checkpoints).
TINY_QWEN3_MOE = dict(vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], max_position_embeddings=128, tie_word_embeddings=False)
TINY_MOE_LAYERS = TINY_QWEN3_MOE["num_hidden_layers"]
TINY_MOE_TOP_K = TINY_QWEN3_MOE["num_experts_per_tok"]


def save_tiny_moe(out: str, **overrides):
    """Write a tiny Qwen3-MoE Hugging Face directory to ``out``; returns the transformers model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})).float()
    with torch.no_grad():  # decisive routing and experts that matter: a wrong expert shows in the log-probs
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return model.eval()


def hf_token_outputs(model, batch: Batch) -> dict[str, torch.Tensor]:
    """Per-token log-probs and entropies ``[B, T]`` of a transformers model at the tokens a train
    worker scores (its ``loss_mask``; 0 elsewhere, at padding and at position 0)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1)
    picked = logp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    real = batch["loss_mask"][:, 1:] > 0
    pad = (1, 0)
    return {"logprobs": torch.nn.functional.pad(torch.where(real, picked, 0.0), pad),
            "entropy": torch.nn.functional.pad(torch.where(real, entropy, 0.0), pad)}


# -- jobs and batches ------------------------------------------------------------------------------

def make_job(path: str, **backend_args) -> JobConfig:
    """The tests' job on the checkpoint at ``path`` with ``[train] backend_args``."""
    # Warmup then cosine decay: the first step trains at lr / 2, so the schedule shows in every step.
    return JobConfig(model=ModelConfig(path=path, tokenizer=TOKENIZER),
                     train=TrainConfig(lr=1e-3, micro_batch_size=2, grad_clip=1.0, lr_schedule="cosine",
                                       lr_warmup_steps=2, total_steps=6, weight_decay=0.01,
                                       backend_args=backend_args),
                     algorithm=AlgorithmConfig(entropy_coef=0.01))


def make_batch(rows: int = 4, width: int = 12, seed: int = 0) -> Batch:
    """``rows`` right-padded rows of ``width // 2`` to ``width`` tokens (the first one full), a loss
    mask from position 3 on and advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    lengths[0] = width
    t = torch.arange(width)
    attention = (t[None, :] < lengths[:, None]).long()
    loss_mask = ((t[None, :] >= 3) & (t[None, :] < lengths[:, None])).long()
    ids = torch.randint(1, 512, (rows, width), generator=g) * attention
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:rows, None] * loss_mask
    return Batch(tensors={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
                          "advantages": adv.float()}, meta={"sample_id": [f"s{i}" for i in range(rows)]})


def with_old_logprobs(batch: Batch, logprobs: torch.Tensor, seed: int) -> Batch:
    """``batch`` as a GRPO batch whose ``old_logprobs`` are ``logprobs`` plus a little noise drawn
    from ``seed + 2`` (ratios near 1)."""
    noise = 0.05 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(seed + 2))
    batch.tensors["old_logprobs"] = (logprobs + noise) * batch["loss_mask"]
    return batch


def with_hf_old_logprobs(model, batch: Batch, seed: int) -> Batch:
    """:func:`with_old_logprobs` from the transformers ``model``'s log-probs of ``batch``."""
    return with_old_logprobs(batch, hf_token_outputs(model, batch)["logprobs"], seed)


def make_train_batch(ref, seed: int) -> Batch:
    """A GRPO batch whose ``old_logprobs`` are ``ref``'s log-probs plus a little noise (ratios near 1)."""
    batch = make_batch(seed=seed)
    return with_old_logprobs(batch, ref.forward(batch)["logprobs"], seed)


# -- Router Replay on the tiny Qwen3-MoE ------------------------------------------------------------

def replay_job(path: str, **backend_args) -> JobConfig:
    """:func:`make_job` with Router Replay on (and gradients left unclipped, to compare them)."""
    job = make_job(path, **backend_args)
    return attrs.evolve(job, train=attrs.evolve(job.train, grad_clip=1e9),
                        algorithm=attrs.evolve(job.algorithm, router_replay=True))


def own_ranking(model, batch: Batch) -> torch.Tensor:
    """``[B, T, layers, experts]``: each router's experts for each token, best first, in the
    model's own (unreplayed) forward."""
    B, T = batch["input_ids"].shape
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    return torch.stack([lg.view(B, T, -1).argsort(dim=-1, descending=True) for lg in out.router_logits], dim=2)


def records(ranking: torch.Tensor, batch: Batch, *, differ: bool) -> torch.Tensor:
    """int16 ``[B, T, layers * top_k]`` records as an engine returns them: the model's own top-2,
    or (``differ``) its 2nd and 3rd choices on about two thirds of the token-layers; -1 on
    padding, on each row's last token (every layer) and on layer 1 of every fifth token."""
    B, T = batch["input_ids"].shape
    ranks = torch.tensor([0, 1]).expand(B, T, TINY_MOE_LAYERS, TINY_MOE_TOP_K).clone()
    if differ:
        b, t, layer = torch.meshgrid(torch.arange(B), torch.arange(T), torch.arange(TINY_MOE_LAYERS), indexing="ij")
        ranks[(b + t + layer) % 3 != 0] = torch.tensor([1, 2])
    routes = ranking.gather(-1, ranks)
    lengths = batch["attention_mask"].sum(dim=1)
    routes[batch["attention_mask"] == 0] = -1
    routes[torch.arange(B), lengths - 1] = -1
    routes[:, ::5, 1] = -1
    return routes.flatten(2).to(torch.int16)


def replayed_reference(model, batch: Batch) -> dict[str, torch.Tensor]:
    """The torch backend's replay of ``batch["routed_experts"]`` on the transformers model."""
    replay = RouterReplay(model)
    try:
        replay.set_routes(batch["routed_experts"], replay=True)
        return hf_token_outputs(model, batch)
    finally:
        replay.close()


def with_routes(batch: Batch, routes: torch.Tensor) -> Batch:
    return Batch(tensors={**batch.tensors, "routed_experts": routes}, meta=batch.meta)


def grpo_batch(model) -> Batch:
    """A GRPO batch with differing records whose ``old_logprobs`` are the replayed log-probs plus noise."""
    batch = make_batch(seed=6)
    batch = with_routes(batch, records(own_ranking(model, batch), batch, differ=True))
    return with_old_logprobs(batch, replayed_reference(model, batch)["logprobs"], seed=6)


# -- weights ---------------------------------------------------------------------------------------

def weights_of(worker) -> dict[str, torch.Tensor]:
    """A copy of the worker's exported (Hugging Face named) weights."""
    return {name: tensor.clone() for name, tensor in worker.named_weights()}


def assert_weights_equal(got: dict, expected: dict, atol: float) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=name)


# -- spawned ranks ---------------------------------------------------------------------------------

def rendezvous_ports(rank: int, out: str, count: int) -> tuple[list[int], list]:
    """One rendezvous port per phase: rank 0 listens on ``count`` ports the OS assigns and
    publishes them in ``out/ports.json``; the other ranks wait for that file. Returns the ports
    and (on rank 0) the listening stores, which must stay alive while the phases run."""
    published = Path(out) / "ports.json"
    if rank == 0:
        stores = [host_rendezvous() for _ in range(count)]
        (Path(out) / "ports.tmp").write_text(json.dumps([r.port for r in stores]))
        (Path(out) / "ports.tmp").rename(published)  # whole or absent, never half written
        return [r.port for r in stores], stores
    deadline = time.monotonic() + 300
    while not published.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 published no rendezvous ports in {published}")
        time.sleep(0.05)
    return json.loads(published.read_text()), []


def run_ranks(job: Callable[..., dict], nprocs: int, out: str | Path, *args: Any) -> list[dict]:
    """Run ``job(rank, out, *args)`` in ``nprocs`` spawned processes, one per rank, and return what
    each rank's ``job`` returned, by rank (saved to ``out/rank{rank}.pt`` and loaded back once all
    ranks have exited).

    ``job`` must be a module-level function: it is pickled by reference, and the child imports its
    test module, which imports this one. The spawn start method gives the child the parent's
    ``sys.path``, on which ``conftest.py`` put this folder, before it unpickles anything."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank_main, args=(job, str(out), args), nprocs=nprocs, join=True, start_method="spawn")
    return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(nprocs)]


def _rank_main(rank: int, job: Callable[..., dict], out: str, args: tuple) -> None:
    """The process of ``rank`` that :func:`run_ranks` spawns: runs ``job`` and saves its result."""
    torch.save(job(rank, out, *args), str(Path(out) / f"rank{rank}.pt"))
