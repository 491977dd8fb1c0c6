"""The ``fictional_qa_sft`` data source: tool-use transcripts for a warm start on ``fictional_qa``.

Each row is a whole conversation in the shape ``loongsage sft`` trains on (``{"messages",
"tools"}``, with ``[sft] tools_key = "tools"``): the question as the user turn, then one
``search`` call per document the question needs (the tool's real output, from the same corpus
and index the ``tool_agent`` will search during RL), then the final answer as a bare string.
The ``tools`` column holds the very schemas the ``tool_agent`` sends for the same tool import
paths, so the rendered tokens are the ones the router records when the policy runs.

A warm start must leave room to learn: a policy that always answers right teaches RL nothing, a
policy that never does gives it no signal. So a share of the transcripts is right
(``p_correct``) and the rest are wrong in the ways a real policy is wrong, drawn per question:

* **stops early** (two-hop questions, a ``p_stop_early`` share of the wrong ones): one search,
  then an answer taken from its results (often the entity the second hop should have looked up);
* **wrong fact**: every search done, then another fact of the last results, of the kind asked
  for where the results have one (where the person lives instead of where they were born, a
  namesake's city, another company's year), else any (the company's city instead of its year).

With ``wrong_answer = "entity"`` the wrong transcripts answer a *name* instead, one fixed name per
question, so the only thing that is wrong is *whether* the policy searches: two-hop ones stop
after one search and answer the entity the second hop should have looked up (``stop_early``),
one-hop ones answer the question's own entity without searching (``no_search``). A policy
trained on them copies names as exactly as on right transcripts (each answer is one name, not a
draw among several facts, which a tiny model learns as a blur of them) and errs only in a choice
that the reward can select.

Each row's ``metadata`` says which (``behaviour``), with the question's ``kind``, ``hops``,
``answer``, ``path`` (the titles a right transcript searches) and its world's seed. The draws are
seeded: the same arguments give the same rows.

A warm start that must *copy* names (from the question into a search, from the results into the
answer) rather than recall them learns from many worlds (``worlds``): each name is then seen a few
times only, too few to memorise. ``heldout_of`` keeps every name of a world's held-out split out
of the transcripts, so an evaluation on that split stays about entities the model never saw.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import attrs

from loongsage_hookspecs import BuildContext

from .fictional_qa import fictional_qa_rows
from .fictional_world import COMPANY_SUFFIXES, Document, WorldError, WorldSpec, build_world, spec_from
from .python_tools import function_schema, load_function
from .search_tools import corpus_index, search

DEFAULT_TOOLS = ("loongsage_plugin_agents.search_tools:search", "loongsage_plugin_agents.search_tools:open")
ANSWER_CLASS = {"born": "city", "home": "city", "based": "city", "capital": "city", "year": "year",
                "company": "company", "country": "country"}
"""What kind of thing each fact is; facts of other attributes (a profession) never answer a question."""
QUESTION_CLASS = {"born_city": "city", "home_city": "city", "company_city": "city", "founded_city": "city",
                  "company_year": "year", "founded_year": "year", "founded_company": "company",
                  "city_country": "country", "born_country": "country", "home_country": "country"}
"""What kind of thing each question kind asks for."""


class _RowContext:
    """What a tool reads of its trajectory (``ctx.metadata``), for calling it outside a run."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        self.metadata = metadata


def _call(n: int, query: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_{n}", "type": "function",
        "function": {"name": "search", "arguments": json.dumps({"query": query})}}]}


def _facts_in_results(query: str, metadata: dict[str, Any], docs: dict[str, Document]) -> list[tuple[str, str]]:
    """``(class, value)`` of the answerable facts of the documents a search for ``query`` lists."""
    index = corpus_index(metadata["corpus"])
    top_k = int(metadata["search"]["top_k"])
    out: list[tuple[str, str]] = []
    for i, _ in index.rank(query)[:top_k]:
        doc = docs.get(index.titles[i])
        for attr, value in doc.facts if doc is not None else ():
            if attr in ANSWER_CLASS and (ANSWER_CLASS[attr], value) not in out:
                out.append((ANSWER_CLASS[attr], value))
    return out


def fictional_qa_transcripts(
    ctx: BuildContext | None = None,
    /,
    *,
    seed: int = 0,
    split: str = "train",
    world: dict[str, Any] | None = None,
    hops: list[int] | None = None,
    kinds: list[str] | None = None,
    num_samples: int = 0,
    top_k: int = 3,
    snippet_chars: int = 200,
    tools: list[str] | None = None,
    p_correct: float = 1.0,
    p_stop_early: float = 0.5,
    wrong_answer: str = "fact",
    worlds: int = 1,
    heldout_of: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Tool-use transcripts of the ``fictional_qa`` questions (see the module docstring).

    Args:
        ctx: the host's context (unused).
        seed: question order and the behaviour draws.
        split, world, hops, kinds, num_samples, top_k, snippet_chars: as for ``fictional_qa``
            (the same values give transcripts of the same questions with the same search results).
        tools: the tool import paths offered (their schemas fill the ``tools`` column); the
            transcripts call ``search`` only, so one of them must be a ``search`` tool.
        p_correct: share of transcripts that search every hop and answer right.
        p_stop_early: share of the wrong two-hop transcripts that answer after one search.
        wrong_answer: ``"fact"`` (another fact of the results, the default) or ``"entity"`` (a
            name: two-hop ones stop early and answer the bridge entity, one-hop ones answer the
            question's entity without searching; ``p_stop_early`` is then unused).
        worlds: transcripts of this many worlds: ``world`` and the ones whose seeds follow its seed
            (the same sizes; ``num_samples`` questions of each). Names of many worlds, each seen a
            few times, cannot be memorised: a policy trained on them must copy names from the
            question and the results.
        heldout_of: a world (:class:`~.fictional_world.WorldSpec` fields) whose held-out split no
            transcript may name: a transcript in which any word of its entities' names appears is
            left out, so that split stays unseen by a model trained on these rows.

    Returns:
        Rows ``{"messages", "tools", "metadata": {"behaviour", "kind", "hops", "answer", "path", "world"}}``.
    """
    for name, value in (("p_correct", p_correct), ("p_stop_early", p_stop_early)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise WorldError(f"fictional_qa_sft: '{name}' must be a number in [0, 1], got {value!r}")
    if wrong_answer not in ("fact", "entity"):
        raise WorldError(f"fictional_qa_sft: 'wrong_answer' must be 'fact' or 'entity', got {wrong_answer!r}")
    if isinstance(worlds, bool) or not isinstance(worlds, int) or worlds < 1:
        raise WorldError(f"fictional_qa_sft: 'worlds' must be an integer >= 1, got {worlds!r}")
    paths = list(tools) if tools is not None else list(DEFAULT_TOOLS)
    schemas = [function_schema(load_function(p)) for p in paths]
    if "search" not in {s["function"]["name"] for s in schemas}:
        raise WorldError(f"fictional_qa_sft: 'tools' must include a tool named search, got {paths}")
    base = spec_from(world)
    forbidden: frozenset[str] = frozenset()
    if heldout_of is not None:
        try:
            forbidden = heldout_words(spec_from(heldout_of))
        except WorldError as exc:
            raise WorldError(f"fictional_qa_sft: 'heldout_of': {exc}") from None
    out: list[dict[str, Any]] = []
    for n in range(worlds):
        spec = attrs.evolve(base, seed=base.seed + n).as_dict()
        for row in _world_transcripts(spec, seed=seed + n, split=split, hops=hops, kinds=kinds,
                                      num_samples=num_samples, top_k=top_k, snippet_chars=snippet_chars,
                                      schemas=schemas, p_correct=p_correct, p_stop_early=p_stop_early,
                                      wrong_answer=wrong_answer):
            if forbidden and forbidden & _words(row["messages"]):
                continue
            out.append(row)
    return out


def heldout_words(spec: WorldSpec) -> frozenset[str]:
    """Every word of the names of ``spec``'s held-out entities (a company's suffix aside)."""
    held = build_world(spec, "heldout")
    suffixes = set(COMPANY_SUFFIXES)
    return frozenset(w for d in held.documents for w in d.title.split() if w not in suffixes)


def _words(messages: list[dict[str, Any]]) -> set[str]:
    text = " ".join(str(m.get("content") or "") + json.dumps(m.get("tool_calls") or []) for m in messages)
    return set(re.findall(r"[A-Za-z]+", text))


def _world_transcripts(world: dict[str, Any], *, seed: int, split: str, hops: list[int] | None,
                       kinds: list[str] | None, num_samples: int, top_k: int, snippet_chars: int,
                       schemas: list[dict[str, Any]], p_correct: float, p_stop_early: float,
                       wrong_answer: str = "fact") -> list[dict[str, Any]]:
    """The transcripts of one world (see :func:`fictional_qa_transcripts`)."""
    rows = fictional_qa_rows(None, seed=seed, split=split, world=world, hops=hops, kinds=kinds,
                             num_samples=num_samples, top_k=top_k, snippet_chars=snippet_chars)
    docs = {d.title: d for d in build_world(spec_from(world), split).documents}
    rng = random.Random(f"fictional-qa-sft-{seed}-{split}")
    out = []
    for row in rows:
        meta, answer = row["metadata"], row["label"]
        path = list(meta["path"])
        behaviour = "correct"
        if rng.random() >= p_correct:
            if wrong_answer == "entity":
                behaviour = "stop_early" if len(path) > 1 else "no_search"
            else:
                behaviour = "stop_early" if len(path) > 1 and rng.random() < p_stop_early else "wrong_fact"
        searched = {"stop_early": path[:1], "no_search": []}.get(behaviour, path)
        messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
        for n, query in enumerate(searched, 1):
            messages.append(_call(n, query))
            messages.append({"role": "tool", "tool_call_id": f"call_{n}",
                             "content": search(query, ctx=_RowContext(meta))})
        if wrong_answer == "entity" and behaviour != "correct":
            answer = path[len(searched)]  # the entity the next search should have looked up
        elif behaviour != "correct":
            wrong = [f for f in _facts_in_results(searched[-1], meta, docs) if f[1] != answer]
            alike = [f for f in wrong if f[0] == QUESTION_CLASS[meta["kind"]]]
            if wrong:
                answer = rng.choice(alike or wrong)[1]
            else:  # nothing else to confuse it with: this one is answered right
                behaviour = "correct"
        messages.append({"role": "assistant", "content": answer})
        out.append({"messages": messages, "tools": schemas,
                    "metadata": {"behaviour": behaviour, "kind": meta["kind"], "hops": meta["hops"],
                                 "answer": row["label"], "path": path, "world": world["seed"]}})
    return out
