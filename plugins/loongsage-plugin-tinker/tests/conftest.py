"""A tiny random Qwen3 model directory and a running Tinker service on it, with the SDK pointed at it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[3]
TOKENIZER_DIR = REPO / "tests" / "data" / "tokenizer"


@contextlib.contextmanager
def _tinker_serve(key: str, model: str, state: Path, cwd: Path | None = None) -> Iterator[dict[str, str]]:
    """``loongsage tinker-serve --model MODEL`` as a subprocess (API key ``key``, run from ``cwd``):
    the variables it prints (``export NAME=VALUE``); it is stopped with SIGINT afterwards and must
    exit 0. The caller checks the variables (stderr comes with a failed check)."""
    env = {**os.environ, "LOONGSAGE_TINKER_API_KEY": key}
    command = [sys.executable, "-m", "loongsage_core", "tinker-serve", "--model", model, "--state-dir", str(state)]
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    exports: dict[str, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("export "):
            name, _, value = line[len("export "):].strip().partition("=")
            exports[name] = value
        if "TINKER_API_KEY" in exports:
            break
    try:
        if "TINKER_API_KEY" not in exports:
            raise AssertionError(f"tinker-serve printed no TINKER_API_KEY: {proc.stderr.read() if proc.stderr else ''}")
        yield exports
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="session")
def tinker_serve() -> Any:
    """:func:`_tinker_serve`: ``with tinker_serve(key, "name=path", state_dir[, cwd]) as exports``."""
    return _tinker_serve


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_model")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from loongsage_plugin_tinker.cli import DEFAULT_JOB
    from loongsage_plugin_tinker.serve import served_models, start_service

    from loongsage_core.cli import load_job_and_host

    job, host = load_job_and_host(str(DEFAULT_JOB))
    running = start_service(job, host, served_models(job, [f"tiny={tiny_model_dir}"]),
                            state_dir=str(tmp_path_factory.mktemp("tinker_state")))
    yield running
    running.stop()


@pytest.fixture
def client(service: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A ``tinker.ServiceClient`` of the service (through the SDK's own environment variables),
    its session finished after the test, so that no heartbeat outlives the service."""
    import tinker

    monkeypatch.setenv("TINKER_BASE_URL", service.base_url)
    monkeypatch.setenv("TINKER_API_KEY", service.api_key)
    with tinker.ServiceClient() as client:
        yield client


def _logprobs_of(tc: Any, datum: Any) -> Any:
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _state_round_trip(tc: Any, datum: Any) -> str:
    """A step, ``save_state``, another step (the log-probs move), ``load_state_with_optimizer``:
    the log-probs are bit for bit those saved. Returns the state's path."""
    import numpy as np
    from tinker import types

    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_state("round_trip").result().path
    saved = _logprobs_of(tc, datum)
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert not np.allclose(_logprobs_of(tc, datum), saved)
    tc.load_state_with_optimizer(path).result()
    np.testing.assert_array_equal(_logprobs_of(tc, datum), saved)
    return path


@pytest.fixture(scope="session")
def state_round_trip() -> Any:
    """:func:`_state_round_trip`: ``state_round_trip(training_client, datum) -> path``."""
    return _state_round_trip
