"""RoutedExperts: SGLang's ``routed_experts`` read into compact int16 records that stay aligned with
a segment's tokens, turn after turn, and survive JSON; the engine client's reading of them."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from loongsage_core.engine_results import EngineProtocolError, GenerationResult
from loongsage_hookspecs import RoutedExperts, Segment


def sglang_field(ids: np.ndarray) -> str:
    return base64.b64encode(ids.astype("<i4").tobytes()).decode("ascii")


def test_sglang_routes_are_read_row_major_into_int16():
    ids = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2) % 7
    ids[:, 0] = -1  # a dense layer
    routes = RoutedExperts.from_sglang(sglang_field(ids), positions=5)
    assert len(routes) == 5 and routes.width == 6 and routes.ids.itemsize == 2
    assert routes.to_tensor(2).numpy().tolist() == ids.tolist()
    assert routes.to_tensor().shape == (5, 6)
    assert RoutedExperts.from_json(routes.to_json()) == routes


@pytest.mark.parametrize(("payload", "positions", "message"), [
    ("not base64!", 2, "not valid base64"),
    (base64.b64encode(b"\0" * 6).decode(), 2, "not a whole number of int32 values"),
    (sglang_field(np.zeros(9, dtype=np.int32)), 2, "9 ids, not a whole number of rows for 2 positions"),
    (sglang_field(np.array([0, 40000], dtype=np.int32)), 1, r"outside \[-1, 32767\]"),
])
def test_malformed_routes_are_refused_with_the_reason(payload, positions, message):
    with pytest.raises(ValueError, match=message):
        RoutedExperts.from_sglang(payload, positions)


def test_a_segment_keeps_one_record_per_token_across_turns():
    seg = Segment()
    seg.append([1, 2, 3], generated=False)
    seg.append([4, 5], generated=True, logprobs=[-1.0, -1.0])
    seg.record_routes(RoutedExperts(2, [7, 8] * 4))  # the engine ran 4 of the 5 tokens
    assert seg.routed_experts is not None and len(seg.routed_experts) == 5
    assert seg.routed_experts.to_tensor()[-1].tolist() == [-1, -1]
    seg.append([6], generated=False)  # the next turn's prompt delta: no record yet
    assert len(seg.routed_experts) == 6 and seg.routed_experts.to_tensor()[-2:].tolist() == [[-1, -1], [-1, -1]]
    seg.append([9], generated=True, logprobs=[-0.5])
    seg.record_routes(RoutedExperts(2, [3, 4] * 6))  # the next call covers the whole segment
    assert seg.routed_experts.to_tensor().tolist() == [[3, 4]] * 6 + [[-1, -1]]
    seg.record_routes(None)  # an answer without routes keeps what there is
    assert len(seg.routed_experts) == 7
    with pytest.raises(ValueError, match="routed_experts=2"):
        Segment(tokens=[1], loss_mask=[0], logprobs=[0.0], weight_versions=[-1],
                routed_experts=RoutedExperts(1, [0, 1]))


def test_the_engine_client_reads_routes_for_prompt_and_output_tokens_but_the_last():
    ids = np.random.default_rng(0).integers(0, 8, size=(3 + 2 - 1, 4, 2)).astype(np.int32)
    body = {"output_ids": [5, 6], "meta_info": {"prompt_tokens": 3, "finish_reason": {"type": "stop"},
                                                "routed_experts": sglang_field(ids), "routed_experts_dtype": "int32"}}
    res = GenerationResult.from_response(body, "r1")
    assert res.routed_experts is not None and res.routed_experts.to_tensor(2).numpy().tolist() == ids.tolist()
    assert "routed_experts" not in res.meta_info  # decoded once, not carried twice
    bad = {**body, "meta_info": {**body["meta_info"], "prompt_tokens": 4}}  # 4 rows do not make 5 positions
    with pytest.raises(EngineProtocolError, match="unreadable routed_experts"):
        GenerationResult.from_response(bad, "r1")
    assert GenerationResult.from_response({"output_ids": [5], "meta_info": {}}, "r2").routed_experts is None
