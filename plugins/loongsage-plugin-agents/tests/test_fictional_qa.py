"""The made-up world, its ``fictional_qa`` questions and the ``fictional_qa_sft`` warm-start transcripts."""

from __future__ import annotations

import json
import re

import pytest
from loongsage_plugin_agents import plugin
from loongsage_plugin_agents.fictional_qa import fictional_qa_rows
from loongsage_plugin_agents.fictional_transcripts import fictional_qa_transcripts
from loongsage_plugin_agents.fictional_world import (
    QUESTION_KINDS,
    WorldError,
    WorldSpec,
    _build_split,
    _draw_names,
    build_world,
)

SMALL = {"people": 24, "cities": 10, "countries": 3, "heldout_people": 12, "heldout_cities": 6,
         "heldout_countries": 2}


def names_in(world) -> set[str]:
    return {d.title for d in world.documents}


def test_a_world_is_a_pure_function_of_its_spec():
    spec = WorldSpec(seed=3, **SMALL)
    for split in ("train", "heldout"):
        fresh = _build_split(spec, _draw_names(spec)[split], split)  # not the cache
        assert fresh == build_world(spec, split)
    other = build_world(WorldSpec(seed=4, **SMALL), "train")
    assert names_in(other) != names_in(build_world(spec, "train"))


def test_heldout_entities_never_appear_in_the_training_split():
    spec = WorldSpec()
    train, heldout = build_world(spec, "train"), build_world(spec, "heldout")
    train_text = " ".join([d.title + " " + d.text for d in train.documents] + [q.question for q in train.questions])
    train_words = set(re.findall(r"[A-Z][a-z]+", train_text))
    for doc in heldout.documents:  # no held-out name, nor any word of one, is in the training split
        words = set(doc.title.split()) - {"Labs", "Works", "Motors", "Foods", "Media", "Textiles"}
        assert not words & train_words, doc.title
    assert len(train.documents) == 2 * 240 + 60 + 8 and len(heldout.documents) == 2 * 60 + 20 + 4


def test_every_question_is_answered_by_the_documents_on_its_path():
    world = build_world(WorldSpec(**SMALL), "train")
    docs = {d.title: d for d in world.documents}
    kinds = {q.kind for q in world.questions}
    assert kinds == set(QUESTION_KINDS)
    for q in world.questions:
        assert q.hops == QUESTION_KINDS[q.kind][0] == len(q.path)
        first = docs[q.path[0]]
        assert q.path[0] in q.question
        if q.hops == 2:  # the first document names the second entity, whose document holds the answer
            assert q.path[1] in first.text and q.answer not in first.text
        assert q.answer in docs[q.path[-1]].text
        assert q.answer in [v for _, v in docs[q.path[-1]].facts]


def test_bad_world_arguments_are_one_line_errors():
    with pytest.raises(WorldError, match="'people' must be an integer >= 1"):
        build_world(WorldSpec(people=0), "train")
    with pytest.raises(WorldError, match="unknown split 'test'"):
        build_world(WorldSpec(), "test")
    with pytest.raises(WorldError, match="more countries"):
        build_world(WorldSpec(cities=2, countries=3), "train")
    with pytest.raises(WorldError, match="unknown argument.*colour"):
        fictional_qa_rows(world={"colour": 1})


def test_fictional_qa_rows_are_seeded_and_carry_the_corpus():
    rows = fictional_qa_rows(seed=1, world=SMALL, num_samples=30)
    assert rows == fictional_qa_rows(seed=1, world=SMALL, num_samples=30)
    assert rows != fictional_qa_rows(seed=2, world=SMALL, num_samples=30)  # another order
    assert len(rows) == 30 and len({r["prompt"] for r in rows}) == 30
    for row in rows:
        meta = row["metadata"]
        assert meta["corpus"] == {"world": WorldSpec(**SMALL).as_dict(), "split": "train"}
        assert meta["search"] == {"top_k": 3, "snippet_chars": 200}
        assert isinstance(row["label"], str) and meta["hops"] in (1, 2)
        json.dumps(row)  # rows travel as JSON (rollout records)
    two = fictional_qa_rows(world=SMALL, hops=[2], split="heldout")
    assert {r["metadata"]["hops"] for r in two} == {2}
    assert {r["metadata"]["corpus"]["split"] for r in two} == {"heldout"}
    born = fictional_qa_rows(world=SMALL, kinds=["born_city"])
    assert len(born) == SMALL["people"] and all("born?" in r["prompt"] for r in born)


def test_fictional_qa_argument_errors():
    with pytest.raises(WorldError, match="'hops' must list 1 and/or 2"):
        fictional_qa_rows(hops=[3])
    with pytest.raises(WorldError, match="unknown question kind"):
        fictional_qa_rows(kinds=["favourite_colour"])
    with pytest.raises(WorldError, match="has only"):
        fictional_qa_rows(world=SMALL, num_samples=10_000)
    with pytest.raises(WorldError, match="'top_k' must be an integer >= 1"):
        fictional_qa_rows(top_k=0)


def test_transcripts_search_every_hop_when_right_and_err_as_configured():
    rows = fictional_qa_transcripts(world=SMALL, seed=0, p_correct=0.3, p_stop_early=0.5)
    assert rows == fictional_qa_transcripts(world=SMALL, seed=0, p_correct=0.3, p_stop_early=0.5)
    behaviours = [r["metadata"]["behaviour"] for r in rows]
    assert 0.15 < behaviours.count("correct") / len(rows) < 0.45
    assert behaviours.count("stop_early") > 0 and behaviours.count("wrong_fact") > 0
    for row in rows:
        messages, meta = row["messages"], row["metadata"]
        calls = [m for m in messages if m.get("tool_calls")]
        results = [m for m in messages if m["role"] == "tool"]
        assert messages[0]["role"] == "user" and messages[-1]["role"] == "assistant"
        assert len(calls) == len(results)
        final = messages[-1]["content"]
        if meta["behaviour"] == "correct":
            assert final == meta["answer"] and len(calls) == meta["hops"]
        else:
            assert final != meta["answer"]
            assert final in results[-1]["content"]  # a fact the last results show
            assert len(calls) == (1 if meta["behaviour"] == "stop_early" else meta["hops"])
        for call in calls:
            [tc] = call["tool_calls"]
            assert tc["function"]["name"] == "search" and set(json.loads(tc["function"]["arguments"])) == {"query"}
    assert [t["function"]["name"] for t in rows[0]["tools"]] == ["search", "open"]


def test_entity_transcripts_err_only_in_whether_they_search():
    rows = fictional_qa_transcripts(world=SMALL, seed=0, p_correct=0.3, wrong_answer="entity")
    behaviours = {(r["metadata"]["behaviour"], r["metadata"]["hops"]) for r in rows}
    assert behaviours == {("correct", 1), ("correct", 2), ("no_search", 1), ("stop_early", 2)}
    for row in rows:
        messages, meta = row["messages"], row["metadata"]
        calls = [m for m in messages if m.get("tool_calls")]
        final = messages[-1]["content"]
        if meta["behaviour"] == "correct":
            assert final == meta["answer"] and len(calls) == meta["hops"]
            continue
        assert final != meta["answer"] and len(calls) == meta["hops"] - 1  # one search short
        queried = [json.loads(c["tool_calls"][0]["function"]["arguments"])["query"] for c in calls]
        assert queried + [final] == meta["path"][:len(calls) + 1]  # the name the next search would look up
        assert final in (messages[-2]["content"] if calls else messages[0]["content"])  # copied, not made up
    with pytest.raises(WorldError, match="'wrong_answer' must be 'fact' or 'entity'"):
        fictional_qa_transcripts(world=SMALL, wrong_answer="guess")


def test_transcripts_of_many_worlds_follow_the_given_seed():
    one = fictional_qa_transcripts(world={**SMALL, "seed": 7}, seed=3, num_samples=10)
    many = fictional_qa_transcripts(world={**SMALL, "seed": 7}, seed=3, num_samples=10, worlds=3)
    assert many[:10] == one  # the first world is the given one, with the given seed
    assert [r["metadata"]["world"] for r in many] == [7] * 10 + [8] * 10 + [9] * 10
    asked = [{r["messages"][0]["content"] for r in many if r["metadata"]["world"] == w} for w in (7, 8, 9)]
    assert not asked[0] & asked[1] and not asked[1] & asked[2]  # other worlds, other names
    eighth = fictional_qa_transcripts(world={**SMALL, "seed": 8}, seed=4, num_samples=10)
    assert many[10:20] == [{**r, "metadata": {**r["metadata"], "world": 8}} for r in eighth]


def test_transcripts_leave_out_every_name_of_a_heldout_split():
    heldout = {"seed": 0}  # the default world's held-out split: 60 people, 60 companies, 24 places
    names = {w for d in build_world(WorldSpec(seed=0), "heldout").documents for w in d.title.split()}
    words = names - {"Labs", "Works", "Motors", "Foods", "Media", "Textiles"}
    kept = fictional_qa_transcripts(world={"seed": 100}, num_samples=60, worlds=8, heldout_of=heldout)
    every = fictional_qa_transcripts(world={"seed": 100}, num_samples=60, worlds=8)
    assert 0 < len(every) - len(kept) < len(every) // 4  # some transcripts name one, most do not
    for row in kept:
        text = json.dumps(row["messages"])
        assert not words & set(re.findall(r"[A-Za-z]+", text))
    assert any(words & set(re.findall(r"[A-Za-z]+", json.dumps(r["messages"]))) for r in every)
    assert kept == [r for r in every if r in kept]  # the same rows, in order, less the left-out ones


def test_transcript_argument_errors():
    with pytest.raises(WorldError, match="'p_correct' must be a number in"):
        fictional_qa_transcripts(p_correct=1.5)
    for worlds in (0, True, 2.0):
        with pytest.raises(WorldError, match="'worlds' must be an integer >= 1"):
            fictional_qa_transcripts(worlds=worlds)
    with pytest.raises(WorldError, match="'heldout_of': fictional world: unknown argument"):
        fictional_qa_transcripts(heldout_of={"seeds": 0})
    with pytest.raises(WorldError, match="must include a tool named search"):
        fictional_qa_transcripts(tools=["loongsage_plugin_agents.search_tools:open"])


def test_the_plugin_registers_its_data_sources():
    sources = {s.name: s for s in plugin.loongsage_data_sources()}
    assert set(sources) == {"fictional_qa", "fictional_qa_sft", "swe_mini_sft"}
    rows = sources["fictional_qa"].factory(None, world=SMALL, num_samples=2)
    assert len(rows) == 2
    agents = {s.name: s for s in plugin.loongsage_agents()}
    assert not agents["tool_agent"].needs_sandbox  # Python tools need none; bash comes with a source's sandbox
