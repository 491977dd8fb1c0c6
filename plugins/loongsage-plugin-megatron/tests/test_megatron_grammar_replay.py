"""Turns decoded under a grammar, scored by the megatron train backend (CPU) as the engine sampled
them: the worker replays each constrained span's grammar (``meta["constraints"]``) and masks its
logits, so its log-probs equal the torch backend's (which replays the same way) and differ from
the unconstrained log-probs of the same tokens."""

from __future__ import annotations

import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

import megatron_test_support as support
from loongsage_plugin_megatron import plugin
from loongsage_plugin_torch.trainer import create_train_worker as create_torch_worker
from transformers import AutoTokenizer

from loongsage_core.backend_api.grammar import compile_grammar
from loongsage_hookspecs import Batch, TrainWorkerContext

ANSWERS = ["abcde", "cdabe", "abe"]


def constrained_batch() -> Batch:
    """Rows of a random prompt then an answer of the regex ``(ab|cd)+e`` and the turn end, the
    answers marked as constrained spans (loss mask 1 on them)."""
    tokenizer = AutoTokenizer.from_pretrained(support.TOKENIZER)
    grammar = compile_grammar("regex", "(ab|cd)+e")
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    g = torch.Generator().manual_seed(0)
    rows, spans = [], []
    for answer in ANSWERS:
        prompt = torch.randint(10, 500, (5,), generator=g).tolist()
        out = tokenizer.encode(answer, add_special_tokens=False) + [stop]
        rows.append((prompt, out))
        spans.append([(len(prompt), len(prompt) + len(out), grammar, [stop])])
    width = max(len(p) + len(o) for p, o in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, (prompt, out) in enumerate(rows):
        ids[i, :len(prompt) + len(out)] = torch.tensor(prompt + out)
        attention[i, :len(prompt) + len(out)] = 1
        loss_mask[i, len(prompt):len(prompt) + len(out)] = 1
    return Batch(tensors={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask},
                 meta={"sample_id": [f"s{i}" for i in range(len(rows))], "constraints": spans})


def test_megatron_scores_constrained_turns_as_the_torch_backend_does(hf_dir, host):
    job = support.make_job(hf_dir)
    meg = plugin.create_train_worker(TrainWorkerContext(job=job, components=host))
    try:
        ref = create_torch_worker(TrainWorkerContext(job=support.make_job(hf_dir), components=host))
        batch = constrained_batch()
        free = Batch(tensors=batch.tensors, meta={"sample_id": batch.meta["sample_id"]})
        scored = batch["loss_mask"] > 0
        got, want = meg.forward(batch)["logprobs"], ref.forward(batch)["logprobs"]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        unconstrained = meg.forward(free)["logprobs"]
        assert float((got[scored] - unconstrained[scored]).mean()) > 1.0  # the masks showed
        # a forced step (a single allowed token, like the turn end after "e") has log-prob 0
        assert float(got[scored].max()) > -1e-6
    finally:
        meg.close()
