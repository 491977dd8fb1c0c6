"""Shared helpers of the SFT tests: a tiny chat data set and job files for a tiny Qwen3."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "tests" / "data" / "tokenizer"

TINY = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "tie_word_embeddings": True}


def arithmetic_chats(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of two-turn arithmetic chats (some with a system prompt)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c, d = (rng.randint(0, 9) for _ in range(4))
        msgs = [{"role": "system", "content": "Answer with a number."}] if i % 3 == 0 else []
        msgs += [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)},
                 {"role": "user", "content": f"What is {c} - {d}?"}, {"role": "assistant", "content": str(c - d)}]
        rows.append({"messages": msgs})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_text(data: Path, *, sft: dict[str, Any] | None = None, train: dict[str, Any] | None = None,
             run: dict[str, Any] | None = None) -> str:
    """A job file for ``loongsage sft`` on ``data`` (a tiny random Qwen3, the JSONL logger)."""
    import tomli_w

    job = {"plugins": {"enable": ["torch", "loggers"]},
           "model": {"tokenizer": str(TOKENIZER_DIR), "config": TINY},
           "train": {"lr": 3e-3, "mini_batch_size": 8, "micro_batch_size": 4, **(train or {})},
           "sft": {"max_seq_len": 256, **(sft or {})},
           "data": [{"path": str(data)}],
           "loggers": [{"name": "jsonl"}],
           "run": {"save_hf_at_end": False, **(run or {})}}
    return tomli_w.dumps(job)


@pytest.fixture
def make_job(tmp_path: Path) -> Callable[..., Path]:
    """Writes a job file (and its data, ``rows`` chats) under the test's directory; returns its path."""
    counter = iter(range(1000))

    def make(rows: int = 40, **kwargs: Any) -> Path:
        n = next(counter)
        data = write_jsonl(tmp_path / f"chat{n}.jsonl", arithmetic_chats(rows))
        path = tmp_path / f"job{n}.toml"
        path.write_text(job_text(data, **kwargs))
        return path

    return make


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
