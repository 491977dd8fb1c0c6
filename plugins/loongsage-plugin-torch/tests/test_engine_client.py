"""The engine client reads both the embedded engine's and SGLang's response shapes."""

from __future__ import annotations

import pytest

from loongsage_core.engine_client import EngineClient, GenerationResult


def test_sglang_response_with_version_spans_and_string_versions():
    body = {"text": "hi", "output_ids": [5, 6, 7, 8],
            "meta_info": {"id": "abc", "finish_reason": {"type": "stop", "matched": 8}, "prompt_tokens": 3,
                          "completion_tokens": 4, "cached_tokens": 2, "weight_version": "4",
                          "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                              {"version": "4", "start": 1, "end": 4}],
                          "output_token_logprobs": [[-0.5, 5, None], [-1.0, 6, None], [-0.25, 7, None],
                                                    [-2.0, 8, None]]}}
    res = GenerationResult.from_response(body)
    assert res.rid == "abc" and res.output_ids == [5, 6, 7, 8] and res.finish_reason == "stop"
    assert res.finish_detail == {"type": "stop", "matched": 8}
    assert res.logprobs == [-0.5, -1.0, -0.25, -2.0]
    assert res.weight_version == 4 and res.weight_versions == [3, 4, 4, 4]
    assert res.prompt_tokens == 3 and res.cached_tokens == 2 and res.text == "hi"


def test_older_sglang_response_without_spans_or_logprobs():
    body = {"text": "", "output_ids": [1, 2], "meta_info": {"id": "x", "finish_reason": {"type": "length",
                                                                                          "length": 2},
                                                             "weight_version": "default"}}
    res = GenerationResult.from_response(body)
    assert res.logprobs is None and res.weight_versions == ["default", "default"]
    assert res.finish_reason == "length" and not res.aborted


def test_generate_payload_batches_with_request_ids():
    # one prompt is sent unbatched, with a string rid (what SGLang routers accept)
    payload = EngineClient.generate_payload([3, 4], {"temperature": 0}, return_logprob=True)
    assert payload["input_ids"] == [3, 4] and isinstance(payload["rid"], str)
    assert payload["sampling_params"] == {"temperature": 0} and payload["return_logprob"] is True
    single = EngineClient.generate_payload([[3, 4]], [{"top_k": 2}], rids=["r"])
    assert single == {"input_ids": [3, 4], "sampling_params": {"top_k": 2}, "return_logprob": True, "rid": "r"}
    payload = EngineClient.generate_payload([[1], [2, 3]], [{}, {"top_k": 5}], rids=["a", "b"])
    assert payload["rid"] == ["a", "b"] and payload["sampling_params"][1] == {"top_k": 5}
    with pytest.raises(ValueError, match="rids"):
        EngineClient.generate_payload([[1], [2]], rids=["only-one"])
    # logprob_start_len: one for all, or one per prompt (a batch of one sends its own, unbatched)
    assert EngineClient.generate_payload([[1], [2]], logprob_start_len=[0, -1])["logprob_start_len"] == [0, -1]
    assert EngineClient.generate_payload([[1, 2]], logprob_start_len=[1])["logprob_start_len"] == 1
    assert "logprob_start_len" not in EngineClient.generate_payload([1, 2])


def test_a_malformed_generate_answer_is_a_protocol_error():
    from loongsage_core.engine_client import EngineProtocolError

    for body, wanted in (([1, 2], "unexpected /generate body"), ({"meta_info": {}}, "did not return output_ids"),
                         ({"output_ids": [1]}, "unexpected /generate body")):
        with pytest.raises(EngineProtocolError, match=wanted) as info:
            GenerationResult.from_response(body)
        assert info.value.status_code == 502


def test_incremental_stream_chunks_add_up_to_the_whole_generation():
    from loongsage_core.engine_client import merge_stream_chunk

    def chunk(ids, lps, total, finish=None):
        return {"output_ids": ids, "meta_info": {"completion_tokens": total, "finish_reason": finish,
                                                 "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                                                 "weight_version": "2"}}

    first = merge_stream_chunk(None, chunk([5, 6], [-0.5, -0.25], 2))
    assert first.output_ids == [5, 6] and first.finish_reason == ""
    second = merge_stream_chunk(first, chunk([7], [-1.0], 3, {"type": "stop", "matched": 7}))  # an increment
    assert second.output_ids == [5, 6, 7] and second.logprobs == [-0.5, -0.25, -1.0]
    assert second.finish_reason == "stop" and second.weight_versions == [2, 2, 2]
    cumulative = merge_stream_chunk(first, chunk([5, 6, 7], [-0.5, -0.25, -1.0], 3, "length"))
    assert cumulative.output_ids == [5, 6, 7] and cumulative.finish_reason == "length"
