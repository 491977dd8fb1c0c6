"""Research tools over a local corpus: ``search`` (BM25, the ``bm25s`` library) and ``open``.

Give them to the ``tool_agent`` by import path::

    agent_args = { tools = ["loongsage_plugin_agents.search_tools:search",
                            "loongsage_plugin_agents.search_tools:open"] }

**Which corpus.** A tool reads it from its trajectory's row, ``ctx.metadata["corpus"]``:

* ``{"world": {...}, "split": "train"}``: a split of a made-up world
  (:mod:`.fictional_world`, the rows of the ``fictional_qa`` data source carry this);
* ``{"path": "/abs/docs.jsonl"}``: a JSONL file of ``{"title", "text"}`` objects, one a line.

and its options from ``ctx.metadata["search"]``: ``top_k`` (results per search, default 3) and
``snippet_chars`` (each result's text is cut there, default 200). The BM25 index of a corpus is
built once per process and kept (:func:`corpus_index`), so every trajectory of a run shares it.

**Ranking.** Documents are indexed by title and text, lower-cased, English stop words dropped
(``bm25s.tokenize``) and scored with BM25 (Lucene's variant, ``k1 = 1.5``, ``b = 0.75``);
results come by score, ties by corpus order, so a query always gives the same list. Documents
that share no word with the query are never listed.

Mistakes (an empty query, a title that no document has) come back as text the model reads,
never as exceptions: they are part of the episode.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Mapping

import attrs

from .fictional_world import build_world, check_split, spec_from

DEFAULT_TOP_K = 3
DEFAULT_SNIPPET_CHARS = 200


class CorpusError(ValueError):
    """A row's corpus cannot be found or read (the message names the key or file at fault)."""


@attrs.define(frozen=True)
class CorpusIndex:
    """A corpus and its BM25 index: ``titles`` and ``texts`` in corpus order."""

    titles: tuple[str, ...]
    texts: tuple[str, ...]
    retriever: Any
    by_title: Mapping[str, int]

    def rank(self, query: str) -> list[tuple[int, float]]:
        """``(document index, score)`` of every document sharing a word with ``query``, best first
        (ties in corpus order)."""
        import bm25s

        [tokens] = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        known = [t for t in tokens if t in self.retriever.vocab_dict]
        if not known:
            return []
        scores = self.retriever.get_scores(known)
        hits = [(i, float(s)) for i, s in enumerate(scores.tolist()) if s > 0]
        return sorted(hits, key=lambda hit: (-hit[1], hit[0]))


def _documents_of(key: tuple[str, str]) -> list[tuple[str, str]]:
    kind, value = key
    if kind == "world":
        spec_args, split = json.loads(value)
        world = build_world(spec_from(spec_args), split)
        return [(d.title, d.text) for d in world.documents]
    path = Path(value)
    if not path.is_file():
        raise CorpusError(f"corpus file {path} does not exist")
    docs = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise CorpusError(f"{path} line {n}: not JSON: {exc}") from None
            if not isinstance(row, dict) or not isinstance(row.get("title"), str) or \
                    not isinstance(row.get("text"), str):
                raise CorpusError(f"{path} line {n}: expected an object with string 'title' and 'text'")
            docs.append((row["title"], row["text"]))
    if not docs:
        raise CorpusError(f"corpus file {path} has no documents")
    return docs


@functools.lru_cache(maxsize=8)
def _index(key: tuple[str, str]) -> CorpusIndex:
    import bm25s

    docs = _documents_of(key)
    retriever = bm25s.BM25(k1=1.5, b=0.75, method="lucene")
    retriever.index(bm25s.tokenize([f"{t}\n{x}" for t, x in docs], stopwords="en", show_progress=False),
                    show_progress=False)
    by_title: dict[str, int] = {}
    for i, (title, _) in enumerate(docs):
        by_title.setdefault(title.casefold(), i)
    return CorpusIndex(titles=tuple(t for t, _ in docs), texts=tuple(x for _, x in docs), retriever=retriever,
                       by_title=by_title)


def corpus_key(corpus: Any) -> tuple[str, str]:
    """The cache key of a row's ``corpus`` entry (see the module docstring)."""
    if not isinstance(corpus, Mapping):
        raise CorpusError("the row has no corpus: metadata['corpus'] must be {'world': {...}, 'split': ...} or "
                          f"{{'path': ...}}, got {type(corpus).__name__}")
    if "path" in corpus:
        if not isinstance(corpus["path"], str) or not Path(corpus["path"]).is_absolute():
            raise CorpusError(f"metadata['corpus']['path'] must be an absolute path, got {corpus['path']!r}")
        return ("path", corpus["path"])
    if "world" in corpus:
        split = corpus.get("split", "train")
        check_split(split)
        spec = spec_from(corpus["world"])  # checks the arguments
        return ("world", json.dumps([spec.as_dict(), split], sort_keys=True))
    raise CorpusError(f"metadata['corpus'] needs 'world' or 'path', got keys {sorted(corpus)}")


def corpus_index(corpus: Any) -> CorpusIndex:
    """The (cached) index of a row's ``corpus`` entry."""
    return _index(corpus_key(corpus))


def _options(ctx: Any) -> tuple[CorpusIndex, int, int]:
    metadata = getattr(ctx, "metadata", None) or {}
    options = metadata.get("search") or {}
    top_k = int(options.get("top_k", DEFAULT_TOP_K))
    snippet = int(options.get("snippet_chars", DEFAULT_SNIPPET_CHARS))
    if top_k < 1 or snippet < 1:
        raise CorpusError(f"metadata['search']: top_k and snippet_chars must be >= 1, got {options}")
    return corpus_index(metadata.get("corpus")), top_k, snippet


def search(query: str, ctx: Any = None) -> str:
    """Search the documents.

    Args:
        query: words to look for
    """
    index, top_k, snippet = _options(ctx)
    if not isinstance(query, str) or not query.strip():
        return "Error: the query is empty"
    hits = index.rank(query)[:top_k]
    if not hits:
        return f"No document matches {query!r}."
    lines = []
    for n, (i, _) in enumerate(hits, 1):
        text = index.texts[i]
        cut = text if len(text) <= snippet else text[:snippet].rstrip() + " ..."
        lines.append(f"[{n}] {index.titles[i]}: {cut}")
    return "\n".join(lines)


def open(title: str, ctx: Any = None) -> str:  # noqa: A001 - the tool's name as the model sees it
    """Read a document.

    Args:
        title: its exact title
    """
    index, _, _ = _options(ctx)
    if not isinstance(title, str) or not title.strip():
        return "Error: the title is empty"
    i = index.by_title.get(title.strip().casefold())
    if i is None:
        return f"Error: no document is titled {title!r}; search for it first"
    return f"{index.titles[i]}\n{index.texts[i]}"
