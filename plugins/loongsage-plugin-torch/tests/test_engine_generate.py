"""Generation behaviour of the embedded engine over real HTTP (tiny Qwen3, real tokenizer)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch  # noqa: E402  (a hard dependency of this plugin)
from loongsage_plugin_torch.engine import create_engine  # noqa: E402
from loongsage_plugin_torch.engine.runner import sequence_logprobs  # noqa: E402
from loongsage_plugin_torch.modeling import TINY_QWEN3, load_model, load_tokenizer  # noqa: E402

from loongsage_core.config import structure_job  # noqa: E402
from loongsage_core.engine_client import EngineClient  # noqa: E402
from loongsage_hookspecs import EngineContext  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = str(REPO / "tests" / "data" / "tokenizer")


def make_job(**engine_args):
    args = {"num_threads": 1, "max_batch_size": 16, "max_prefill_tokens": 48, **engine_args}
    return structure_job({"model": {"config": dict(TINY_QWEN3), "tokenizer": TOKENIZER, "seed": 3},
                          "rollout": {"max_context_length": 192, "engine_args": args}})


def serve(job):
    """A started engine for ``job``, a client and a reference copy of the model; stopped after."""
    engine = create_engine(EngineContext(job=job, components=None))
    client = EngineClient(engine.start())
    yield engine, client, load_model(job)
    client.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def served():
    yield from serve(make_job())


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def assert_logprobs_match(ref, prompt, result, tol=1e-5):
    expected = sequence_logprobs(ref, prompt + result.output_ids)[len(prompt) - 1:]
    assert len(result.logprobs) == len(result.output_ids) == len(expected)
    assert max(abs(a - b) for a, b in zip(expected, result.logprobs)) < tol


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_logprobs_equal_a_full_forward_of_the_model(served):
    engine, client, ref = served
    batch = prompts(4, 30, 100)  # 100 > max_prefill_tokens: prefilled in chunks
    for params in ({"temperature": 1.0, "sampling_seed": 1}, {"temperature": 0.7, "top_p": 0.9, "top_k": 50}):
        results = client.generate_sync(batch, {**params, "max_new_tokens": 24, "ignore_eos": True})
        for prompt, res in zip(batch, results):
            assert res.finish_reason == "length" and len(res.output_ids) == 24
            # the reported logprob is the policy's (temperature 1, unfiltered), whatever the sampling settings
            assert_logprobs_match(ref, prompt, res)
            assert res.prompt_tokens == len(prompt)


# a mixture of experts: 4 experts, 2 per token; the first layer dense, the second sparse
MOE = {**TINY_QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 24, "norm_topk_prob": True, "mlp_only_layers": [0]}


@pytest.fixture(scope="module")
def served_moe():
    yield from serve(structure_job({"model": {"config": dict(MOE), "tokenizer": TOKENIZER, "seed": 3},
                                    "rollout": {"max_context_length": 192, "engine_args": {"num_threads": 1}}}))


def test_a_mixture_of_experts_model_is_served_with_the_models_log_probs(served_moe):
    _, client, ref = served_moe
    batch = prompts(5, 40, seed=2)
    results = client.generate_sync(batch, {"temperature": 1.0, "sampling_seed": 4, "max_new_tokens": 16,
                                            "ignore_eos": True})
    for prompt, res in zip(batch, results):
        assert len(res.output_ids) == 16
        assert_logprobs_match(ref, prompt, res)


def router_choices(model, tokens):
    """Each layer's top-k experts for every position of ``tokens`` ``[len, layers, k]`` from the
    model's own routers (forward hooks), -1 in a dense layer: computed apart from the engine."""
    layers = model.model.layers
    k = model.config.num_experts_per_tok
    out = torch.full((len(tokens), len(layers), k), -1, dtype=torch.int32)
    def keep(index):
        def hook(_module, _inputs, output):  # (logits, weights, indices); returns None: output unchanged
            out[:, index] = output[2]
        return hook

    hooks = [layer.mlp.gate.register_forward_hook(keep(index)) for index, layer in enumerate(layers)
             if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return out


def test_routed_experts_are_those_of_the_models_routers_through_the_caches(served_moe):
    import base64

    _, client, ref = served_moe
    url = client.base_url
    a, b = prompts(40, 24, seed=7)

    def generate(batch):
        body = {"input_ids": batch, "return_routed_experts": True, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}}
        answer = httpx.post(f"{url}/generate", json=body, timeout=60).raise_for_status().json()
        return answer if isinstance(answer, list) else [answer]

    # a prompt twice in one batch (one prefill, copied), then again (the prefix cache's KV)
    answers = generate([a, a, b]) + generate([a])
    assert answers[3]["meta_info"]["cached_tokens"] >= 16
    for prompt, answer in zip([a, a, b, a], answers):
        meta = answer["meta_info"]
        assert meta["routed_experts_dtype"] == "int32"
        tokens = prompt + answer["output_ids"]
        got = torch.frombuffer(bytearray(base64.b64decode(meta["routed_experts"])), dtype=torch.int32)
        expected = router_choices(ref, tokens[:-1])  # every position the model ran
        assert torch.equal(got.view(expected.shape), expected)
        assert bool((expected[:, 0] == -1).all()) and bool((expected[:, 1] >= 0).all())
    # without the question, no routing; a dense model refuses it by name
    plain = httpx.post(f"{url}/generate", json={"input_ids": a, "sampling_params": {"max_new_tokens": 2}},
                       timeout=60).json()
    assert "routed_experts" not in plain["meta_info"]


def test_a_dense_model_refuses_return_routed_experts(served):
    engine, client, _ = served
    resp = httpx.post(client.base_url + "/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": True})
    assert resp.status_code == 400 and "return_routed_experts" in resp.text


def test_greedy_batch_of_mixed_lengths_equals_one_at_a_time(served):
    _, client, ref = served
    batch = prompts(3, 17, 8, 41, 1, seed=1)
    together = client.generate_sync(batch, {**GREEDY, "max_new_tokens": 12})
    alone = [client.generate_sync([p], {**GREEDY, "max_new_tokens": 12})[0] for p in batch]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    for prompt, res in zip(batch, together):
        # every greedy token is the arg-max of a plain forward of the same model
        with torch.inference_mode():
            logits = ref(input_ids=torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1:-1]
        picked = logits.gather(-1, torch.tensor(res.output_ids)[:, None])[:, 0]
        assert torch.all(picked >= logits.max(-1).values - 1e-4)


def test_concurrent_requests_join_the_running_batch(served):
    _, client, _ = served
    batch = prompts(5, 9, 13, 21, 2, 7, seed=2)
    expected = [r.output_ids for r in client.generate_sync(batch, {**GREEDY, "max_new_tokens": 10})]

    async def one_by_one():
        async def go(i, p):
            await asyncio.sleep(0.005 * i)  # staggered: later requests join between decode steps
            return (await client.generate([p], {**GREEDY, "max_new_tokens": 10}))[0].output_ids
        try:
            return await asyncio.gather(*(go(i, p) for i, p in enumerate(batch)))
        finally:
            await client.aclose()

    assert asyncio.run(one_by_one()) == expected


def test_seeded_sampling_is_reproducible(served):
    _, client, _ = served
    prompt, other = prompts(6, 11, seed=3)
    params = {"temperature": 1.0, "sampling_seed": 1234, "max_new_tokens": 30, "ignore_eos": True}
    first = client.generate_sync([prompt], params)[0].output_ids
    # same seed inside a batch with other requests, and via SGLang's older name "seed"
    again = client.generate_sync([other, prompt], [{**params, "sampling_seed": 9}, params])[1].output_ids
    legacy = client.generate_sync([prompt], {**{k: v for k, v in params.items() if k != "sampling_seed"},
                                             "seed": 1234})[0].output_ids
    different = client.generate_sync([prompt], {**params, "sampling_seed": 4321})[0].output_ids
    assert first == again == legacy
    assert different != first


def test_stop_token_ids_end_generation_on_the_token(served):
    _, client, _ = served
    (prompt,) = prompts(7, seed=4)
    free = client.generate_sync([prompt], {**GREEDY, "max_new_tokens": 16})[0].output_ids
    stop = free[5]
    first = free.index(stop)
    res = client.generate_sync([prompt], {**GREEDY, "max_new_tokens": 16, "stop_token_ids": [stop]})[0]
    assert res.output_ids == free[: first + 1]  # the stop token is returned (it was generated)
    assert res.finish_reason == "stop" and res.finish_detail["matched"] == stop


def test_max_new_tokens_finishes_with_length(served):
    _, client, _ = served
    (prompt,) = prompts(5, seed=5)
    res = client.generate_sync([prompt], {**GREEDY, "max_new_tokens": 7})[0]
    assert res.finish_reason == "length" and res.finish_detail["length"] == 7 and len(res.output_ids) == 7
    empty = client.generate_sync([prompt], {"max_new_tokens": 0})[0]
    assert empty.output_ids == [] and empty.finish_reason == "length"


def test_eos_of_the_tokenizer_is_a_stop_token(served):
    engine, _, _ = served
    tok = load_tokenizer(make_job())
    assert tok.eos_token_id in engine.scheduler.eos_token_ids


def test_identical_prompts_share_one_prefill_and_prefixes_are_reused(served):
    _, client, ref = served
    (prompt,) = prompts(37, seed=6)
    group = client.generate_sync([prompt] * 4, [{"temperature": 1.0, "sampling_seed": s, "max_new_tokens": 12,
                                                 "ignore_eos": True} for s in range(4)])
    assert sorted(r.cached_tokens for r in group)[1:] == [len(prompt)] * 3  # one prefill, three copies
    assert len({tuple(r.output_ids) for r in group}) > 1
    for res in group:
        assert_logprobs_match(ref, prompt, res)
    # a later request extending a finished sequence reuses its KV (multi-turn prefix)
    turn2 = prompt + group[0].output_ids + prompts(5, seed=7)[0]
    res = client.generate_sync([turn2], {**GREEDY, "max_new_tokens": 6})[0]
    assert res.cached_tokens >= len(prompt) + len(group[0].output_ids) - 1
    assert_logprobs_match(ref, turn2, res)


def test_text_is_decoded_with_the_tokenizer(served):
    _, client, _ = served
    tok = load_tokenizer(make_job())
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    res = client.generate_sync([ids], {**GREEDY, "max_new_tokens": 8})[0]
    assert res.text == tok.decode(res.output_ids, skip_special_tokens=True)
    # SGLang's "text" input is tokenized by the engine: the same prompt gives the same tokens
    body = {"text": tok.decode(ids), "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    out = httpx.post(client.base_url + "/generate", json=body).json()
    assert out["output_ids"] == res.output_ids and out["meta_info"]["prompt_tokens"] == len(ids)


def test_stream_sends_every_token_as_it_is_generated(served):
    _, client, _ = served
    (prompt,) = prompts(9, seed=8)
    params = {"temperature": 1.0, "sampling_seed": 77, "max_new_tokens": 20, "ignore_eos": True}
    plain = httpx.post(client.base_url + "/generate", json={"input_ids": prompt, "sampling_params": params,
                                                            "return_logprob": True}, timeout=60).json()
    events = []
    with httpx.stream("POST", client.base_url + "/generate", json={
            "input_ids": prompt, "sampling_params": params, "return_logprob": True, "stream": True},
            timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(events) == 20  # SGLang's format: one event per token, each with everything so far
    for n, event in enumerate(events, start=1):
        meta = event["meta_info"]
        assert event["output_ids"] == plain["output_ids"][:n] and meta["completion_tokens"] == n
        assert len(meta["output_token_logprobs"]) == n
        assert (meta["finish_reason"] is None) == (n < 20)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert events[-1]["text"] == plain["text"]
    assert [e[0] for e in events[-1]["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in plain["meta_info"]["output_token_logprobs"]], abs=1e-6)


def test_top_logprobs_num_lists_the_most_likely_tokens(served):
    _, client, ref = served
    (prompt,) = prompts(6, seed=9)
    out = httpx.post(client.base_url + "/generate", json={
        "input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 5}, "return_logprob": True,
        "top_logprobs_num": 3}, timeout=60).json()
    meta = out["meta_info"]
    rows = meta["output_top_logprobs"]
    assert len(rows) == 5 and all(len(row) == 3 for row in rows)
    full = torch.log_softmax(ref(torch.tensor([prompt + out["output_ids"]])).logits[0].float(), dim=-1)
    for i, (row, (lp, tok, _)) in enumerate(zip(rows, meta["output_token_logprobs"])):
        expected = full[len(prompt) - 1 + i].topk(3)
        assert [t for _, t, _ in row] == expected.indices.tolist()
        assert [v for v, _, _ in row] == pytest.approx(expected.values.tolist(), abs=1e-4)
        assert row[0][1] == tok and row[0][0] == pytest.approx(lp, abs=1e-5)  # greedy took the top token


@pytest.mark.parametrize("start", [0, 1, 37])
def test_logprob_start_len_scores_the_prompt_tokens(served, start):
    """SGLang's ``input_token_logprobs``: each prompt token from ``logprob_start_len`` on, scored
    by a full forward of the model (``null`` at position 0), with ``input_top_logprobs``; the
    100-token prompt is prefilled in chunks of 48, after a first request put its first 60
    tokens in the prefix cache (which must not hide the positions to score)."""
    _, client, ref = served
    (prompt,) = prompts(100, seed=11)
    client.generate_sync([prompt[:60]], {**GREEDY, "max_new_tokens": 1})
    out = httpx.post(client.base_url + "/generate", json={
        "input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 3}, "return_logprob": True,
        "logprob_start_len": start, "top_logprobs_num": 2}, timeout=60).json()
    meta = out["meta_info"]
    scored = meta["input_token_logprobs"]
    assert [t for _, t, _ in scored] == prompt[start:]
    full = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = [None] * (start == 0) + full[max(start - 1, 0):-1].gather(
        -1, torch.tensor(prompt[max(start, 1):])[:, None])[:, 0].tolist()
    assert (scored[0][0] is None) == (start == 0)
    assert [lp for lp, _, _ in scored[start == 0:]] == pytest.approx(expected[start == 0:], abs=1e-4)
    top = meta["input_top_logprobs"]
    assert len(top) == len(scored) and (top[0] is None) == (start == 0)
    row = top[-1]
    assert [t for _, t, _ in row] == full[-2].topk(2).indices.tolist()
    assert len(meta["output_token_logprobs"]) == 3 and meta["prompt_tokens"] == 100


def test_without_logprob_start_len_no_prompt_scores_are_sent(served):
    _, client, _ = served
    (prompt,) = prompts(8, seed=12)
    for extra in ({}, {"logprob_start_len": -1}):
        out = httpx.post(client.base_url + "/generate", json={
            "input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 2}, "return_logprob": True,
            **extra}, timeout=60).json()
        assert "input_token_logprobs" not in out["meta_info"] and len(out["meta_info"]["output_token_logprobs"]) == 2


def test_stop_strings_end_generation_on_the_token_that_completes_them(served):
    _, client, _ = served
    tok = load_tokenizer(make_job())
    (prompt,) = prompts(7, seed=4)
    free = client.generate_sync([prompt], {**GREEDY, "max_new_tokens": 16})[0].output_ids
    text = tok.decode(free[3:6], skip_special_tokens=False)
    stop = text[1:-1] if len(text) > 2 else text  # spans token boundaries
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 16, "stop": [stop]}}
    out = httpx.post(client.base_url + "/generate", json=body, timeout=60).json()
    ids = out["output_ids"]
    assert ids == free[:len(ids)] and stop in tok.decode(ids, skip_special_tokens=False)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=False)  # the last token completed it
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"]  # SGLang trims the matched stop string from the text
