"""The research tools (``search`` over a BM25 index, ``open``): what they return, deterministically,
for the corpus a row names."""

from __future__ import annotations

import json

import pytest
from loongsage_plugin_agents import search_tools
from loongsage_plugin_agents.fictional_qa import fictional_qa_rows
from loongsage_plugin_agents.python_tools import function_schema
from loongsage_plugin_agents.search_tools import CorpusError, corpus_index, open, search

from loongsage_hookspecs import AgentContext

SMALL = {"people": 24, "cities": 10, "countries": 3, "heldout_people": 12, "heldout_cities": 6,
         "heldout_countries": 2}


def ctx_for(metadata: dict) -> AgentContext:
    return AgentContext(trajectory_id="t", base_url="http://x", api_key="k", prompt="p", metadata=metadata)


def row_ctx(split: str = "train", **search) -> AgentContext:
    row = fictional_qa_rows(world=SMALL, split=split, num_samples=1, **search)[0]
    return ctx_for(row["metadata"])


def test_search_lists_the_best_matches_with_their_text():
    ctx = row_ctx()
    world_docs = corpus_index(ctx.metadata["corpus"])
    person = next(t for t, x in zip(world_docs.titles, world_docs.texts) if x.endswith(("Labs.", "Works.", "Motors.",
                                                                                         "Foods.", "Media.",
                                                                                         "Textiles.")))
    out = search(person, ctx=ctx)
    lines = out.splitlines()
    assert 1 <= len(lines) <= 3 and lines[0].startswith(f"[1] {person}: A")  # the exact name ranks first
    first_name = person.split()[0]
    assert all(first_name in line.split(":")[0] or person.split()[1] in line for line in lines)
    assert search(person, ctx=ctx) == out  # deterministic
    assert len(search(person, ctx=row_ctx(top_k=1)).splitlines()) == 1
    cut = search(person, ctx=row_ctx(snippet_chars=10)).splitlines()[0]
    assert cut.endswith(" ...") and len(cut.split(": ", 1)[1]) <= 10 + 4


def test_search_misses_and_bad_queries_are_text_for_the_model():
    ctx = row_ctx()
    assert search("the of and", ctx=ctx).startswith("No document matches")  # stop words only
    assert search("Qqqxxz", ctx=ctx) == "No document matches 'Qqqxxz'."
    assert search("   ", ctx=ctx) == "Error: the query is empty"


def test_open_reads_a_document_by_title():
    ctx = row_ctx()
    index = corpus_index(ctx.metadata["corpus"])
    title, text = index.titles[1], index.texts[1]
    assert open(title, ctx=ctx) == f"{title}\n{text}"
    assert open(title.upper(), ctx=ctx) == f"{title}\n{text}"  # titles match without case
    assert open("Nowhere Labs", ctx=ctx).startswith("Error: no document is titled 'Nowhere Labs'")


def test_splits_search_their_own_corpus():
    train, heldout = row_ctx("train"), row_ctx("heldout")
    held_titles = corpus_index(heldout.metadata["corpus"]).titles
    assert not set(held_titles) & set(corpus_index(train.metadata["corpus"]).titles)
    assert search(held_titles[0], ctx=train).startswith("No document matches")
    assert search(held_titles[0], ctx=heldout).startswith(f"[1] {held_titles[0]}:")


def test_a_jsonl_corpus_file(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"title": "Rivers", "text": "The Ombra flows north."}) + "\n\n" +
                    json.dumps({"title": "Hills", "text": "The Vell hills are low."}) + "\n")
    ctx = ctx_for({"corpus": {"path": str(docs)}, "search": {"top_k": 5}})
    assert search("Which way does the Ombra flow?", ctx=ctx) == "[1] Rivers: The Ombra flows north."
    assert open("Hills", ctx=ctx) == "Hills\nThe Vell hills are low."
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "x"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl line 1: expected an object with string 'title' and 'text'"):
        search("x", ctx=ctx_for({"corpus": {"path": str(bad)}}))
    with pytest.raises(CorpusError, match="must be an absolute path"):
        search("x", ctx=ctx_for({"corpus": {"path": "docs.jsonl"}}))
    with pytest.raises(CorpusError, match="the row has no corpus"):
        search("x", ctx=ctx_for({}))


def test_the_schemas_the_model_sees():
    assert function_schema(search_tools.search)["function"] == {
        "name": "search", "description": "Search the documents.",
        "parameters": {"type": "object", "required": ["query"], "additionalProperties": False,
                       "properties": {"query": {"type": "string", "description": "words to look for"}}}}
    assert function_schema(search_tools.open)["function"]["parameters"]["required"] == ["title"]
