"""Engine parts without a server: forward passes per model family, sampling, prefix cache, settings."""

from __future__ import annotations

import pytest
import torch  # noqa: E402  (a hard dependency of this plugin)
from loongsage_plugin_torch.engine.kv_cache import PrefixCache  # noqa: E402
from loongsage_plugin_torch.engine.protocol import InvalidRequest, parse_generate  # noqa: E402
from loongsage_plugin_torch.engine.runner import ModelRunner, UnsupportedModelError, sequence_logprobs  # noqa: E402
from loongsage_plugin_torch.engine.sampling import SamplingParams, sample  # noqa: E402
from loongsage_plugin_torch.engine.settings import EngineConfigError, EngineSettings  # noqa: E402
from loongsage_plugin_torch.modeling import TINY_QWEN3, load_model  # noqa: E402

from loongsage_core.config import structure_job  # noqa: E402

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
FAMILIES = {
    "qwen3": dict(TINY_QWEN3),
    "qwen2": {"model_type": "qwen2", **SMALL},  # biased q/k/v projections
    "llama": {"model_type": "llama", **SMALL, "tie_word_embeddings": False},
    # a window of 4 (shorter than every test sequence): a full layer, then a sliding one
    "qwen2-sliding": {"model_type": "qwen2", **SMALL, "use_sliding_window": True, "sliding_window": 4,
                      "max_window_layers": 1},
    "qwen3-sliding": {**TINY_QWEN3, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
    # mixture of experts: 4 experts, 2 per token; the first layer dense, the second sparse
    "qwen3-moe": {**TINY_QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 24, "mlp_only_layers": [0], "norm_topk_prob": True},
    # Mixtral: every layer sparse, top-k weights always renormalised, no q/k norms
    "mixtral": {"model_type": "mixtral", **SMALL, "num_local_experts": 4, "num_experts_per_tok": 2,
                "head_dim": 8},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread is fastest on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model_of(config, seed=0):
    return load_model(structure_job({"model": {"config": config, "seed": seed}}))


@pytest.mark.parametrize("packed,fused_decode", [(False, False), (True, False), (True, True)],
                         ids=["plain", "packed", "fused-decode-attention"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_prefill_and_decode_match_a_full_forward(family, packed, fused_decode):
    model, ref = model_of(FAMILIES[family]), model_of(FAMILIES[family])
    runner = ModelRunner(model, num_slots=3, packed_weights=packed)
    assert runner.packed_weights == packed  # this machine's torch packs weights for oneDNN
    if fused_decode:  # decode attends with the kernel long contexts use
        runner.fused_decode_keys = 1
    gen = torch.Generator().manual_seed(1)
    # longest first: rows that finish early are at the end, so the rows still running stay in slots 0..k-1
    seqs = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (23, 14, 9)]
    got: list[list[float]] = [[], [], []]
    lengths = [0, 0, 0]

    def feed(chunks):
        """Append ``chunks[i]`` tokens to row i (packed), record log-probs of the tokens that follow."""
        flat = [t for i, c in enumerate(chunks) for t in seqs[i][lengths[i]: lengths[i] + c]]
        logits = runner.forward(torch.tensor(flat), 0, torch.tensor(lengths[: len(chunks)]), torch.tensor(chunks),
                                all_logits=True)
        offset = 0
        for i, c in enumerate(chunks):
            nxt = torch.tensor(seqs[i][lengths[i] + 1: lengths[i] + c + 1])
            got[i] += torch.log_softmax(logits[offset: offset + c], -1)[torch.arange(c), nxt].tolist()
            offset += c
            lengths[i] += c

    with torch.inference_mode():
        feed([5, 6, 3])  # prefill, uneven
        feed([3, 3, 1])  # a second packed chunk on top of the cached positions
        while lengths[0] < len(seqs[0]) - 1:  # decode: one token per running row
            feed([1] * sum(n < len(s) - 1 for n, s in zip(lengths, seqs)))
    for s, lp in zip(seqs, got):
        expected = sequence_logprobs(ref, s)
        assert len(lp) == len(expected)
        assert max(abs(a - b) for a, b in zip(expected, lp)) < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "qwen3-moe", "mixtral"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_fused_weights_follow_in_place_updates_of_the_hf_parameters(packed, family):
    model, other = model_of(FAMILIES[family]), model_of(FAMILIES[family], seed=5)
    runner = ModelRunner(model, num_slots=1, packed_weights=packed)
    seq = list(range(1, 12))
    with torch.inference_mode():  # a forward first: the packed copies are made from the old weights
        runner.forward(torch.tensor(seq), 0, torch.tensor([0]), torch.tensor([len(seq)]))
    targets = runner.named_tensors()
    with torch.inference_mode():  # as the engine's weight updates write them
        for name, p in other.named_parameters():
            targets[name].copy_(p)
    with torch.inference_mode():
        logits = runner.forward(torch.tensor(seq), 0, torch.tensor([0]), torch.tensor([len(seq)]), all_logits=True)
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(sequence_logprobs(other, seq), lp)) < 1e-5


def test_auto_packing_follows_the_measured_rule():
    """``"auto"`` packs bfloat16 models and float32 ones from 16M parameters (where oneDNN's packed
    product measured faster); a small float32 model keeps the plain product."""
    from loongsage_plugin_torch.engine.packed_linear import FP32_PACK_MIN_PARAMETERS, worth_packing

    assert worth_packing(torch.bfloat16, 1_000) and worth_packing(torch.float32, FP32_PACK_MIN_PARAMETERS)
    assert not worth_packing(torch.float32, FP32_PACK_MIN_PARAMETERS - 1)
    config = FAMILIES["qwen3"]
    assert not ModelRunner(model_of(config), num_slots=1, packed_weights="auto").packed_weights
    assert ModelRunner(model_of(config).to(torch.bfloat16), num_slots=1, packed_weights="auto").packed_weights
    assert ModelRunner(model_of(config), num_slots=1, packed_weights=True).packed_weights


def test_a_float32_one_row_product_takes_the_plain_weight():
    """float32 packed weights multiply a single row with the plain weight (the faster matrix-vector
    path), more rows packed; both give the plain product to float rounding."""
    from loongsage_plugin_torch.engine.packed_linear import PackedWeight

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen)
    packed = PackedWeight(lambda: weight, [weight], plain_single_row=True)
    one, many = torch.randn(1, 32, generator=gen), torch.randn(5, 32, generator=gen)
    assert torch.equal(packed.linear(one, None), torch.nn.functional.linear(one, weight))
    assert packed.packed is None  # nothing was packed for the single row
    assert torch.allclose(packed.linear(many, None), many @ weight.T, atol=1e-5)
    assert packed.packed is not None


def test_unsupported_architectures_are_refused_by_name():
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2,
                                                                 vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelRunner(gpt2, num_slots=1)
    chunked = model_of(FAMILIES["qwen3"])
    chunked.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        ModelRunner(chunked, num_slots=1)


def test_sampling_respects_greedy_topk_topp_and_reports_raw_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
              SamplingParams(temperature=1.0)]
    gens = [None, None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    tokens, logprobs = sample(logits, params, gens)
    assert tokens[:3].tolist() == logits[:3].argmax(-1).tolist()
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])
    # top-k 3 at a high temperature: only the three most likely tokens ever come out
    row = logits[3:4].expand(400, 50)
    draws, _ = sample(row, [SamplingParams(temperature=5.0, top_k=3)] * 400,
                      [torch.Generator().manual_seed(i) for i in range(400)])
    assert set(draws.tolist()) == set(logits[3].topk(3).indices.tolist())
    # top-p: the kept set is the smallest prefix of the sorted distribution reaching top_p
    probs = torch.softmax(logits[3], -1)
    order = probs.argsort(descending=True)
    need = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    draws, _ = sample(row, [SamplingParams(top_p=0.5)] * 400, [torch.Generator().manual_seed(i) for i in range(400)])
    assert set(draws.tolist()) <= set(order[:need].tolist()) and len(set(draws.tolist())) > 1


def test_seeded_rows_do_not_depend_on_their_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=gen)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    alone = [sample(logits[i:i + 1], [p], [torch.Generator().manual_seed(10 + i)])[0].item() for i in range(3)]
    together = sample(logits, [p] * 3, [torch.Generator().manual_seed(10 + i) for i in range(3)])[0].tolist()
    assert alone == together


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]]))
    n = 3000
    draws, _ = sample(logits.expand(n, 3), [SamplingParams()] * n, [torch.Generator().manual_seed(7)] * n)
    freq = torch.bincount(draws, minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)


def kv(n, fill):
    return [torch.full((2, n, 4), float(fill))], [torch.full((2, n, 4), -float(fill))]


def test_prefix_cache_finds_the_longest_shared_prefix():
    cache = PrefixCache(capacity_tokens=1000, block=4)
    a = list(range(20))
    b = list(range(10)) + [99] * 10
    cache.insert(a, *kv(20, 1), version=0)
    cache.insert(b, *kv(20, 2), version=0)
    entry, n = cache.lookup(list(range(14)) + [7, 7], version=0, max_len=15)
    assert n == 14 and entry.tokens == a
    entry, n = cache.lookup(list(range(10)) + [99, 99, 5], version=0, max_len=100)
    assert n == 12 and entry.tokens == b
    assert cache.lookup(a, version=1, max_len=100) == (None, 0)  # other weights: no reuse
    assert cache.lookup([5, 6, 7, 8, 9], version=0, max_len=100) == (None, 0)
    assert cache.lookup(a, version=0, max_len=19)[1] == 19


def test_prefix_cache_evicts_least_recently_used_to_its_budget():
    cache = PrefixCache(capacity_tokens=40, block=4)
    first, second, third = [list(range(k, k + 16)) for k in (0, 100, 200)]
    cache.insert(first, *kv(16, 1), version=0)
    cache.insert(second, *kv(16, 2), version=0)
    cache.lookup(first, version=0, max_len=16)  # touch: second becomes the oldest
    cache.insert(third, *kv(16, 3), version=0)
    assert cache.tokens <= 40 and len(cache) == 2
    assert cache.lookup(second, version=0, max_len=16) == (None, 0)
    assert cache.lookup(first, version=0, max_len=16)[1] == 16
    cache.insert(first, *kv(16, 9), version=0)  # the same tokens again add nothing
    assert len(cache) == 2
    cache.clear()
    assert cache.tokens == 0 and cache.lookup(third, version=0, max_len=16) == (None, 0)


def test_engine_args_are_validated_by_name():
    ok = EngineSettings.from_job(structure_job({"rollout": {"max_context_length": 512,
                                                            "engine_args": {"max_batch_size": 4}}}))
    assert ok.max_batch_size == 4 and ok.max_context_length == 512
    with pytest.raises(EngineConfigError, match="max_batchsize"):
        EngineSettings.from_job(structure_job({"rollout": {"engine_args": {"max_batchsize": 4}}}))
    with pytest.raises(EngineConfigError, match="max_prefill_tokens"):
        EngineSettings.from_job(structure_job({"rollout": {"engine_args": {"max_prefill_tokens": 0}}}))
    assert ok.packed_weights == "auto"  # packed where measured faster, by default
    off = EngineSettings.from_job(structure_job({"rollout": {"engine_args": {"packed_weights": False}}}))
    assert off.packed_weights is False
    with pytest.raises(EngineConfigError, match='packed_weights must be "auto", true or false'):
        EngineSettings.from_job(structure_job({"rollout": {"engine_args": {"packed_weights": 1}}}))
    assert ok.strict_priority  # a waiting request does not join a more urgent batch, by default
    with pytest.raises(EngineConfigError, match="strict_priority must be true or false"):
        EngineSettings.from_job(structure_job({"rollout": {"engine_args": {"strict_priority": "yes"}}}))


def test_generate_bodies_follow_sglang_shapes():
    items, single = parse_generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "r"},
                                   vocab_size=10, max_context=16, encode=None)
    assert single and items[0].rid == "r" and items[0].params.max_new_tokens == 4
    items, single = parse_generate({"input_ids": [[1], [2, 3]], "sampling_params": [{"temperature": 0}, {}],
                                    "return_logprob": [True, False]}, vocab_size=10, max_context=16, encode=None)
    assert not single and [i.return_logprob for i in items] == [True, False]
    assert items[0].params.greedy and not items[1].params.greedy
    # max_new_tokens defaults to SGLang's 128, clipped to the room left in the context
    assert items[1].params.max_new_tokens == 14
    with pytest.raises(InvalidRequest) as err:
        parse_generate({"input_ids": [[1], [2]], "sampling_params": [{}]}, vocab_size=10, max_context=16, encode=None)
    assert err.value.param == "sampling_params"


def test_fp32_lm_head_computes_the_output_layer_in_float32():
    import torch
    from loongsage_plugin_torch.engine.runner import ModelRunner
    from loongsage_plugin_torch.modeling import TINY_QWEN3
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = dict(TINY_QWEN3)
    model_type = conf.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf), dtype=torch.bfloat16)
    plain = ModelRunner(model, num_slots=2)
    wide = ModelRunner(model, num_slots=2, fp32_lm_head=True)
    hidden = torch.randn(3, conf["hidden_size"], dtype=torch.bfloat16)
    normed = plain._rms(hidden, plain.final_norm)
    expected = normed.double() @ model.lm_head.weight.double().T
    err_wide = (wide.output_logits(hidden).double() - expected).abs().max()
    err_plain = (plain.output_logits(hidden).double() - expected).abs().max()
    # float32 output layer: only float32 rounding; bf16 output layer: bf16 rounding of every logit
    assert err_wide < 1e-5
    assert err_plain > 10 * err_wide


def test_prefix_cache_keeps_one_copy_of_a_growing_conversation():
    cache = PrefixCache(capacity_tokens=1000, block=4)
    turn1 = list(range(20))
    turn2 = turn1 + [50, 51, 52, 53, 54, 55]
    turn3 = turn2 + [60] * 9
    for turn in (turn1, turn2, turn3):
        cache.insert(turn, *kv(len(turn), len(turn)), version=0)
    assert len(cache) == 1 and cache.tokens == len(turn3)  # earlier turns subsumed, not duplicated
    entry, n = cache.lookup(turn3 + [1, 2], version=0, max_len=100)
    assert n == len(turn3) and entry.tokens == turn3
    other = list(range(12)) + [7, 7, 7, 7]  # shares 12 tokens but is no prefix: kept beside
    cache.insert(other, *kv(16, 3), version=0)
    assert len(cache) == 2 and cache.lookup(turn1, version=0, max_len=20)[1] == 20
