"""The ``fictional_qa`` data source: questions about a made-up world, answered by searching its corpus.

Each row is one question of :mod:`.fictional_world` with its answer as the label, and the
metadata the research tools (:mod:`.search_tools`) read: ``corpus`` (which world and split to
search) and ``search`` (results per search, snippet length), plus ``kind``, ``hops`` and
``path`` (the titles of the documents that answer it, for analysis). Score it with
``exact_match`` (or ``token_f1``).

.. code-block:: toml

    [[data]]
    name = "two_hop"
    generator = "fictional_qa"
    generator_args = { split = "train", hops = [2] }
    agent = "tool_agent"
    agent_args = { tools = ["loongsage_plugin_agents.search_tools:search",
                            "loongsage_plugin_agents.search_tools:open"] }
    reward = ["exact_match"]

The held-out split (``split = "heldout"``) is a disjoint set of entities with its own corpus: a
policy trained on ``"train"`` has never seen one of its names.
"""

from __future__ import annotations

import random
from typing import Any

from loongsage_hookspecs import BuildContext

from .fictional_world import QUESTION_KINDS, WorldError, build_world, check_split, spec_from


def fictional_qa_rows(
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
) -> list[dict[str, Any]]:
    """The questions of one split of a fictional world, in a seeded order.

    Args:
        ctx: the host's context (unused: rows depend on the arguments only).
        seed: order of the rows (the host passes ``[run] seed`` unless the job sets it).
        split: ``"train"`` or ``"heldout"`` (disjoint entities and corpora).
        world: :class:`~.fictional_world.WorldSpec` fields (its own ``seed`` and sizes); the same
            ``world`` must be given to every split of one experiment.
        hops: keep questions of these hop counts (1, 2; default both).
        kinds: keep these question kinds (default all, see ``QUESTION_KINDS``).
        num_samples: the first ``num_samples`` rows of the seeded order (0: all of them).
        top_k: results per ``search`` call.
        snippet_chars: each search result's text is cut to this many characters.

    Returns:
        Rows ``{"prompt", "label", "metadata": {"corpus", "search", "kind", "hops", "path"}}``.
    """
    check_split(split)
    spec = spec_from(world)
    hop_set = set(hops if hops is not None else (1, 2))
    if not hop_set or not hop_set <= {1, 2}:
        raise WorldError(f"fictional_qa: 'hops' must list 1 and/or 2, got {hops!r}")
    if kinds is not None:
        unknown = sorted(set(kinds) - set(QUESTION_KINDS))
        if unknown or not kinds:
            raise WorldError(f"fictional_qa: unknown question kind(s) {unknown or kinds}; "
                             f"known: {', '.join(QUESTION_KINDS)}")
    for name, value in (("num_samples", num_samples), ("top_k", top_k), ("snippet_chars", snippet_chars)):
        low = 0 if name == "num_samples" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise WorldError(f"fictional_qa: '{name}' must be an integer >= {low}, got {value!r}")
    questions = [q for q in build_world(spec, split).questions
                 if q.hops in hop_set and (kinds is None or q.kind in kinds)]
    if not questions:
        raise WorldError(f"fictional_qa: no question of hops={sorted(hop_set)} kinds={kinds} in the {split} split")
    random.Random(f"fictional-qa-{seed}-{split}").shuffle(questions)
    if num_samples:
        if num_samples > len(questions):
            raise WorldError(f"fictional_qa: num_samples={num_samples} but the {split} split has only "
                             f"{len(questions)} such questions")
        questions = questions[:num_samples]
    corpus = {"world": spec.as_dict(), "split": split}
    options = {"top_k": top_k, "snippet_chars": snippet_chars}
    return [{"prompt": q.question, "label": q.answer,
             "metadata": {"corpus": corpus, "search": options, "kind": q.kind, "hops": q.hops, "path": list(q.path)}}
            for q in questions]
