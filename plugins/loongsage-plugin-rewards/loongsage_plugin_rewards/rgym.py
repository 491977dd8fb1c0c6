"""Procedural tasks of the `reasoning-gym` package: the ``reasoning_gym`` data source and reward.

The data source builds ``reasoning_gym.create_dataset(dataset, seed=seed, size=num_samples,
**config)`` and turns each entry into a row whose ``metadata["reasoning_gym"]`` records the
dataset name, its configuration and the entry itself. The reward rebuilds the same dataset from
that record (cached) and calls its own ``score_answer(answer, entry)``, so every task is graded
by the scorer written for it (partial credit included).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from typing import Any

from loongsage_hookspecs import BuildContext, Reward, Trajectory

from .extract import extract_final_answer

METADATA_KEY = "reasoning_gym"
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _datasets() -> dict[str, Any]:
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _check_dataset(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"reasoning_gym: 'dataset' must be a dataset name, got {name!r}")
    known = _datasets()
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"reasoning_gym: unknown dataset {name!r}{hint}; {len(known)} datasets are registered")
    return name


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, **json.loads(config_json))
    except TypeError as exc:
        raise ValueError(f"reasoning_gym: bad config for dataset {name!r}: {exc}") from None


def reasoning_gym_rows(ctx: BuildContext | None = None, /, *, dataset: str, num_samples: int = 1000, seed: int = 0,
                       config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rows of one reasoning-gym dataset.

    Args:
        ctx: the host's context (a data source factory's first argument, ``factory(ctx, **args)``);
            unused: the rows depend on the arguments only, so it may be left out in a direct call.
        dataset: a reasoning-gym dataset name (``basic_arithmetic``, ``chain_sum``, ``countdown``, ...).
        num_samples: number of rows (the dataset's ``size``).
        seed: the dataset's ``seed``; rows are a pure function of all arguments.
        config: further keyword arguments of the dataset's configuration class (e.g.
            ``{"min_terms": 2, "max_terms": 3}``); ``seed`` and ``size`` come from the arguments above.

    Returns:
        Rows ``{"prompt": question, "label": answer, "metadata": {"reasoning_gym": {"dataset",
        "config", "entry"}}}`` that the ``reasoning_gym`` reward scores.
    """
    _check_dataset(dataset)
    extra = dict(config or {})
    for key in ("seed", "size"):
        if key in extra:
            raise ValueError(f"reasoning_gym: set '{key}' with the data source argument "
                             f"{'seed' if key == 'seed' else 'num_samples'}, not inside 'config'")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"reasoning_gym: 'num_samples' must be a positive integer, got {num_samples!r}")
    full = dict(extra, seed=seed, size=num_samples)
    config_json = json.dumps(full, sort_keys=True)
    ds = _dataset(dataset, config_json)
    rows = []
    for i in range(num_samples):
        entry = ds[i]
        rows.append({
            "prompt": entry["question"],
            "label": entry["answer"],
            "metadata": {METADATA_KEY: {"dataset": dataset, "config": full, "entry": entry}},
        })
    return rows


def extract_for_reasoning_gym(response: str, extract: str) -> str:
    """The answer text handed to a dataset's scorer (see :func:`reasoning_gym_reward`)."""
    text = response.rpartition("</think>")[2]
    if extract in ("auto", "tags"):
        tags = _ANSWER_TAG_RE.findall(text)
        if tags:
            return tags[-1].strip()
        if extract == "tags":
            return ""
    if extract in ("auto", "final"):
        return extract_final_answer(text)
    return text.strip()


def reasoning_gym_reward(trajectory: Trajectory, *, extract: str = "auto") -> Reward:
    """The dataset's own ``score_answer`` for the response (a float in [0, 1]).

    Args:
        extract: how the answer is found: ``"tags"`` (the last ``<answer>...</answer>``, empty if
            none, reasoning-gym's own convention), ``"final"`` (the plugin's final-answer rules:
            boxed, "answer is", whole response), ``"auto"`` (tags if present, else final) or
            ``"none"`` (the whole stripped response).

    Needs ``metadata["reasoning_gym"]`` as written by the ``reasoning_gym`` data source. Details:
    ``correct`` (score >= 1), ``partial`` (the raw score), ``parsed`` (an answer was found).
    """
    if extract not in ("auto", "tags", "final", "none"):
        raise ValueError(f"reasoning_gym: 'extract' must be 'auto', 'tags', 'final' or 'none', got {extract!r}")
    record = trajectory.metadata.get(METADATA_KEY)
    if not isinstance(record, dict) or not {"dataset", "config", "entry"} <= set(record):
        raise ValueError(f"reasoning_gym: trajectory metadata has no '{METADATA_KEY}' record with dataset, config "
                         "and entry (use the reasoning_gym data source)")
    ds = _dataset(_check_dataset(record["dataset"]), json.dumps(record["config"], sort_keys=True))
    answer = extract_for_reasoning_gym(trajectory.response_text or "", extract)
    raw = ds.score_answer(answer if answer else None, record["entry"])
    value = float(raw or 0.0)
    details = {"correct": float(value >= 1.0), "partial": value, "parsed": float(bool(answer))}
    return Reward(score=value, details=details)
