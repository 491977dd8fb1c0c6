"""Speculative decoding in the embedded engine (``engine_args.speculative``): prompt-lookup drafts,
the acceptance rule, and its exactness: greedy output token for token and log-prob for log-prob
the same as without speculation, sampled output distributed as the policy's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from loongsage_plugin_torch.engine import create_engine
from loongsage_plugin_torch.engine.runner import sequence_logprobs
from loongsage_plugin_torch.engine.sampling import SamplingParams, sample, sampling_probs
from loongsage_plugin_torch.engine.settings import EngineConfigError, EngineSettings, SpeculativeSettings
from loongsage_plugin_torch.engine.speculative import PromptLookup, verify_drafts
from loongsage_plugin_torch.modeling import TINY_QWEN3, load_model

from loongsage_core.config import structure_job
from loongsage_core.engine_client import EngineClient
from loongsage_core.engine_results import GenerationResult
from loongsage_hookspecs import EngineContext

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = str(REPO / "tests" / "data" / "tokenizer")
SPEC = {"method": "prompt_lookup", "num_draft": 4, "ngram": 2}


def make_job(config=None, tokenizer=TOKENIZER, **engine_args):
    model = {"config": dict(config or TINY_QWEN3), "seed": 3}
    if tokenizer:
        model["tokenizer"] = tokenizer
    return structure_job({"model": model, "rollout": {"max_context_length": 256, "engine_args": {
        "num_threads": 1, "max_batch_size": 64, **engine_args}}})


def run(job, prompts, params, top_logprobs_num=0):
    """The engine's answers to ``prompts`` (one batch over HTTP), on a fresh engine for ``job``."""
    engine = create_engine(EngineContext(job=job, components=None))
    client = EngineClient(engine.start(), timeout=120)
    try:
        if not top_logprobs_num:
            return client.generate_sync(prompts, params)
        payload = client.generate_payload(prompts, params, return_logprob=True, top_logprobs_num=top_logprobs_num)
        body = httpx.post(engine.base_url + "/generate", json=payload, timeout=120, trust_env=False).json()
        return [GenerationResult.from_response(item) for item in body]
    finally:
        client.close()
        engine.shutdown()


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total-variation distance of two (possibly unnormalised) histograms."""
    return 0.5 * float((a / a.sum() - b / b.sum()).abs().sum())


# ------------------------------------------------------------------------------------------------
def test_prompt_lookup_drafts_what_followed_the_latest_match():
    drafter = PromptLookup(SpeculativeSettings(num_draft=3, ngram=2))
    index: dict = {}
    tokens = [5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6]
    draft, indexed = drafter.propose(tokens, index, 0, limit=10)
    assert draft == [1, 2, 5] and indexed == len(tokens)  # the latest earlier "5 6" is followed by 1 2 5
    tokens += [4, 4]
    draft, indexed = drafter.propose(tokens, index, indexed, limit=10)  # "4 4" never occurred before
    assert draft == [] and indexed == len(tokens)
    tokens += [4]  # "4 4" now did; the copy runs into the draft itself: a repeating span
    assert drafter.propose(tokens, index, indexed, limit=10)[0] == [4, 4, 4]
    assert drafter.propose(tokens, index, len(tokens), limit=1)[0] == [4]  # no more than the room left
    assert drafter.propose([1, 2], {}, 0, limit=5)[0] == []


def test_speculative_settings_are_checked_by_name():
    job = structure_job({"rollout": {"engine_args": {"speculative": SPEC}}})
    assert EngineSettings.from_job(job).speculative == SpeculativeSettings(num_draft=4, ngram=2)
    assert EngineSettings.from_job(structure_job({})).speculative is None
    bad = [({"num_drafts": 4}, "unknown key 'num_drafts'"), ({"method": "eagle"}, "method must be one of"),
           ({"ngram": 0}, "ngram must be an integer >= 1"), ("on", "must be a table")]
    for table, message in bad:
        with pytest.raises(EngineConfigError, match=message):
            EngineSettings.from_job(structure_job({"rollout": {"engine_args": {"speculative": table}}}))


# ------------------------------------------------------------------------------------------------
def copy_heavy_prompts():
    g = torch.Generator().manual_seed(0)
    text = torch.randint(3, 512, (48,), generator=g).tolist()
    return [text + text[:12], text[:20] + text + text[:6], torch.randint(3, 512, (30,), generator=g).tolist()]


def test_greedy_output_and_logprobs_are_those_without_speculation():
    """Greedy: the same tokens, log-probs within float rounding (and equal to a full forward's),
    top log-probs, stop tokens and lengths; drafts were accepted, so the fast path ran."""
    prompts = copy_heavy_prompts()
    params = {"temperature": 0.0, "max_new_tokens": 37, "ignore_eos": True}
    plain = run(make_job(), prompts, params, top_logprobs_num=3)
    spec = run(make_job(speculative=SPEC), prompts, params, top_logprobs_num=3)
    ref = load_model(make_job())
    for prompt, a, b in zip(prompts, plain, spec):
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason == "length"
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5)
        expected = sequence_logprobs(ref, prompt + b.output_ids)[len(prompt) - 1:]
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(expected), atol=1e-5)
        assert [[t for _, t in row] for row in b.top_logprobs] == [[t for _, t in row] for row in a.top_logprobs]
        assert a.meta_info.get("spec_verify_ct") is None
        meta = b.meta_info
        assert meta["spec_accepted_tokens"] > 0 and meta["spec_verify_ct"] < len(b.output_ids) - 1
        assert meta["spec_emitted_tokens"] == len(b.output_ids) - 1  # all but the prefill's token
    # a stop token met inside an accepted run of drafts ends the output there, as without speculation
    stop = plain[0].output_ids[20]
    stopped = {**params, "stop_token_ids": [stop]}
    a, b = run(make_job(), prompts[:1], stopped)[0], run(make_job(speculative=SPEC), prompts[:1], stopped)[0]
    assert b.output_ids == a.output_ids and b.output_ids[-1] == stop and b.finish_reason == "stop"


# ------------------------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Tiny tensor ops on one thread (on a busy 2-core machine a second one only waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_acceptance_rule_samples_the_target_distribution(one_thread):
    """Through the real acceptance code on fixed logits over 8 tokens: the first emitted token is
    distributed as the target's p (temperature, top-k applied) and as the plain sampler's draws;
    the token after an accepted draft follows the next position's p; a draft the filter removes
    is never accepted."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 8, generator=g) * 2
    params = SamplingParams(temperature=0.8, top_k=6)
    p = sampling_probs(logits, params).float()
    d0 = int(p[0].argmax())  # likely: often accepted
    d1 = int(p[1].argsort()[-2])  # the second most likely
    d2 = int(p[2].argmin())  # removed by top-k: probability 0
    assert p[2, d2] == 0
    n = 20000
    gen = torch.Generator().manual_seed(2)
    first, second, third = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    for _ in range(n):
        out = verify_drafts(logits, [d0, d1, d2], params, gen)
        first[out[0]] += 1
        if out[0] == d0 and len(out) > 1:
            second[out[1]] += 1
        if out[:2] == [d0, d1]:
            assert len(out) == 3 and out[2] != d2  # d2 cannot be accepted: the residual is p without it
            third[out[2]] += 1
    plain_gen = torch.Generator().manual_seed(3)
    plain = torch.zeros(8)
    for _ in range(n // 4):
        tokens, _ = sample(logits[:1].repeat(4, 1), [params] * 4, [plain_gen] * 4)
        plain.index_add_(0, tokens, torch.ones(4))
    assert tv(first, p[0]) < 0.02
    assert tv(first, plain) < 0.03
    assert tv(second, p[1]) < 0.03 and second.sum() > 0.5 * n * float(p[0, d0])
    assert tv(third, p[2]) < 0.07 and third.sum() > 400
    assert first[p[0] == 0].sum() == 0 and second[p[1] == 0].sum() == 0  # filtered tokens never come out


def test_acceptance_rule_greedy_takes_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0.0)
    assert verify_drafts(logits, [1, 0], greedy, None) == [1, 0, 2]  # both accepted, then the bonus
    assert verify_drafts(logits, [1, 2], greedy, None) == [1, 0]  # second rejected: the arg-max instead


def test_sampled_tokens_through_the_engine_follow_the_policy():
    """A tiny model over 16 tokens and a prompt whose every token recurs (a draft every step): the
    second and third sampled tokens (the first comes from the prefill; the second is a verified
    draft or the correction, the third a bonus token or the next step's) are distributed with
    speculation as the exact policy (from plain forwards of the model) and as the engine's draws
    without speculation."""
    config = {**TINY_QWEN3, "vocab_size": 16}
    prompt = [*range(16), 3, 5, 7, 9, 11, 3, 5]  # every token occurs: whatever comes first, a draft follows
    n = 4000
    params = {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 3, "ignore_eos": True}
    spec = run(make_job(config, tokenizer=None, speculative={"num_draft": 3, "ngram": 1}), [prompt] * n, params)
    plain = run(make_job(config, tokenizer=None), [prompt] * n, params)
    drafted = sum(r.meta_info["spec_draft_tokens"] for r in spec)
    accepted = sum(r.meta_info["spec_accepted_tokens"] for r in spec)
    assert drafted == n and 0.05 * n < accepted < 0.95 * n  # one draft each: some accepted, some rejected
    model, sp = load_model(make_job(config, tokenizer=None)), SamplingParams(temperature=0.7, top_p=0.95)
    with torch.inference_mode():  # the exact joint of the three tokens, by plain forwards
        p1 = sampling_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1:].float(), sp)[0]
        p2 = sampling_probs(model(input_ids=torch.tensor([prompt + [a] for a in range(16)])).logits[:, -1].float(), sp)
        pairs = torch.tensor([prompt + [a, b] for a in range(16) for b in range(16)])
        p3 = sampling_probs(model(input_ids=pairs).logits[:, -1].float(), sp).view(16, 16, 16)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    exact = {1: joint.sum(dim=(0, 2)).float(), 2: joint.sum(dim=(0, 1)).float()}
    for position in (1, 2):
        hist = {}
        for name, results in (("spec", spec), ("plain", plain)):
            hist[name] = torch.bincount(torch.tensor([r.output_ids[position] for r in results]), minlength=16).float()
        # sampling noise of a 16-bin histogram at n = 4000 is about 0.025 in total variation
        assert tv(hist["spec"], exact[position]) < 0.05, position
        assert tv(hist["plain"], exact[position]) < 0.05, position
        assert tv(hist["spec"], hist["plain"]) < 0.06, position
