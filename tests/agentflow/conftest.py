"""Shared fixtures of the AgentFlow tests: the test tokenizer and real embedded rollout engines.

Two engines of loongsage-plugin-torch serve tiny Qwen3 models over SGLang's native HTTP API:

* ``engine_url``: random weights (``TINY_QWEN3``); its output is arbitrary token soup, which is
  what token-exactness tests want (special tokens, broken UTF-8, non-canonical tokenizations).
* ``tool_engine_url``: weights set so that, after any prompt ending with the generation prompt
  ``<|im_start|>assistant\\n``, greedy and sampled decoding alike write the tool call
  :data:`TOOL_CALL_TEXT` and stop: every layer's output projections are zero, so the logits depend
  on the current token only, and the output head maps each token of the call to the next one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
TOOL_CALL_PIECES = ["<tool_call>", '{"', "name", '":', ' "', "ad", "d", '"', "}", "</tool_call>", "<|im_end|>"]
TOOL_CALL_TEXT = '<tool_call>{"name": "add"}</tool_call>'
ENGINE_CONTEXT = 1024


@pytest.fixture(scope="session")
def tool_call() -> dict[str, Any]:
    """What the ``tool_engine_url`` model writes: its text and the pieces (one token each)."""
    return {"text": TOOL_CALL_TEXT, "pieces": list(TOOL_CALL_PIECES)}


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="session")
def renderer(tokenizer):
    from loongsage_core.agentflow import ChatRenderer

    return ChatRenderer(tokenizer)


def _job() -> Any:
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import structure_job

    return structure_job({"model": {"config": dict(TINY_QWEN3), "tokenizer": str(TOKENIZER_DIR)},
                          "rollout": {"max_context_length": ENGINE_CONTEXT},
                          "run": {"seed": 0}})


def _serve(model: Any = None) -> Iterator[str]:
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine

    from loongsage_hookspecs import EngineContext

    engine = EmbeddedEngine(EngineContext(job=_job(), components=None), model=model)
    try:
        yield engine.start()
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def engine_url() -> Iterator[str]:
    """A real embedded engine with a randomly initialised tiny Qwen3."""
    yield from _serve()


@pytest.fixture(scope="session")
def run_secret() -> str:
    """A run secret, as ``loongsage run`` generates one."""
    from loongsage_core.security import new_secret

    return new_secret()


@pytest.fixture(scope="session")
def secure_engine_url(run_secret) -> Iterator[str]:
    """A real embedded engine (random tiny Qwen3) that requires ``run_secret``, as a run's engines do."""
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine

    from loongsage_hookspecs import EngineContext

    engine = EmbeddedEngine(EngineContext(job=_job(), components=None, api_key=run_secret))
    try:
        yield engine.start()
    finally:
        engine.shutdown()


def tool_call_model(tokenizer: Any) -> Any:
    """A tiny Qwen3 whose next token depends only on the current one, chained through the tool call."""
    model = chain_model(tokenizer, TOOL_CALL_PIECES)
    assert tokenizer.decode(chain_ids(tokenizer, TOOL_CALL_PIECES)[1:-1]) == TOOL_CALL_TEXT
    return model


def chain_ids(tokenizer: Any, pieces: list[str]) -> list[int]:
    """The ids of ``pieces`` (one token each) after the ``"\n"`` that ends a generation prompt."""
    vocab = {tokenizer.decode([i]): i for i in range(len(tokenizer))}
    chain = [tokenizer.encode("\n", add_special_tokens=False)[-1]] + [vocab[p] for p in pieces]
    assert len(set(chain)) == len(chain), "the chain needs distinct tokens"
    return chain


def chain_model(tokenizer: Any, pieces: list[str]) -> Any:
    """A tiny Qwen3 that, after any prompt ending with ``"\n"``, writes ``pieces`` one token each
    (greedy and sampled alike): the logits depend on the current token only."""
    import torch
    from loongsage_plugin_torch.modeling import TINY_QWEN3
    from transformers import AutoConfig, AutoModelForCausalLM

    chain = chain_ids(tokenizer, pieces)
    conf = dict(TINY_QWEN3)
    model_type = conf.pop("model_type")
    conf["tie_word_embeddings"] = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for i, (cur, nxt) in enumerate(zip(chain[:-1], chain[1:])):
            emb[cur] = 0.0
            emb[cur, i] = 1.0
            head[nxt, i] = 4.0
    return model


@pytest.fixture(scope="session")
def tool_engine_url(tokenizer) -> Iterator[str]:
    """A real embedded engine whose model answers every chat turn with :data:`TOOL_CALL_TEXT`."""
    yield from _serve(tool_call_model(tokenizer))


@pytest.fixture
def router_factory(tokenizer):
    """Builds started routers and shuts them all down after the test."""
    from loongsage_core.agentflow import AgentFlowRouter

    routers = []

    def make(engine_urls, middlewares=(), **kwargs):
        router = AgentFlowRouter(tokenizer, engine_urls, middlewares, **kwargs)
        router.start()
        routers.append(router)
        return router

    yield make
    for r in routers:
        r.shutdown()


MARKOV_TRANSITIONS: dict[str, list[str]] = {
    "\n": ["The", " ", "<think>", "<tool_call>", "\t", "<|im_end|>"],
    "The": [" answer", "\n", "<tool_call>"],
    " answer": [" is", "\n", "<|im_end|>", " "],
    " is": [" ok", " "],
    " ok": [".", "\n", "<tool_call>", "<|im_end|>"],
    ".": ["\n", "<|im_end|>", " "],
    " ": ["The", "\n", "<tool_call>", "<|im_end|>"],
    "\t": ["The", "<think>"],
    "<think>": [" think", "</think>"],
    " think": [" step", "</think>"],
    " step": ["</think>", " think"],
    "</think>": ["\n", "The"],
    "<tool_call>": ['{"'], '{"': ["name"], "name": ['":'], '":': [' "'], ' "': ["ad"], "ad": ["d"], "d": ['"'],
    '"': ["}"], "}": ["</tool_call>"], "</tool_call>": ["\n", "<|im_end|>", " "],
}
"""What the ``markov_engine_url`` model may write after each token (one token each): answers
that start with white space or not, reasoning blocks, hermes tool calls, in any order."""


def markov_model(tokenizer: Any, transitions: dict[str, list[str]]) -> Any:
    """A tiny Qwen3 whose next token depends on the current one only, drawn evenly from
    ``transitions[current]`` (greedy decoding takes the first); the prompt's last token is the
    ``"\n"`` of the generation prompt."""
    import torch
    from loongsage_plugin_torch.modeling import TINY_QWEN3
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = {tokenizer.decode([i]): i for i in range(len(tokenizer))}
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    ids = {piece: (newline if piece == "\n" else vocab[piece]) for piece in transitions}
    conf = dict(TINY_QWEN3)
    model_type = conf.pop("model_type")
    conf["tie_word_embeddings"] = False
    assert len(transitions) <= conf["hidden_size"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for i, (piece, following) in enumerate(transitions.items()):
            emb[ids[piece]] = 0.0
            emb[ids[piece], i] = 1.0
            for rank, nxt in enumerate(following):
                head[vocab[nxt] if nxt != "\n" else newline, i] = 4.0 + (0.01 if rank == 0 else 0.0)
    return model


@pytest.fixture(scope="session")
def markov_engine_url(tokenizer) -> Iterator[str]:
    """A real embedded engine whose model writes random walks over :data:`MARKOV_TRANSITIONS`."""
    yield from _serve(markov_model(tokenizer, MARKOV_TRANSITIONS))


EOT_PIECES = ["4", "<|endoftext|>", "7", "<|im_end|>"]


@pytest.fixture(scope="session")
def eot_engine(tokenizer) -> Iterator[dict[str, Any]]:
    """A real embedded engine whose model answers every chat turn with ``4<|endoftext|>7<|im_end|>``:
    it ends its turn with ``<|endoftext|>``, a chat turn-end token that is not the tokenizer's EOS
    (``<|im_end|>``), and would go on writing after it. ``{"url", "pieces"}``."""
    for url in _serve(chain_model(tokenizer, EOT_PIECES)):
        yield {"url": url, "pieces": list(EOT_PIECES)}


@pytest.fixture(scope="session")
def shapes() -> Any:
    """``protocol_shapes`` (next to this file): checks of the router's answers against the
    OpenResponses schema and the official SDKs' types."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("agentflow_protocol_shapes",
                                                  Path(__file__).parent / "protocol_shapes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
