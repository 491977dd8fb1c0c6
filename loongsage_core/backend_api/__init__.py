"""The host's public API for plugins: what backends and transports legitimately share.

Plugins import host names from this package only (the layer rules of ``pyproject.toml``'s
``[tool.importlinter]`` check it): everything else in :mod:`loongsage_core` is private to the host
and may change without notice. The API is split into small submodules, so a plugin imports only
what it uses and importing one pulls in nothing heavy (no torch, ray, transformers or httpx; tensor
work happens inside the functions):

* :mod:`.loss`: the ``[algorithm]`` loss of a micro-batch (:class:`LossPipeline`), exact mini-batch
  metric means (:class:`MetricAccumulator`), the aggregation denominators (:func:`compute_norm`),
  whether a batch's old log-probs are the training forward's own (:func:`old_from_training_forward`);
* :mod:`.schema`: the job tables a backend reads (:class:`JobConfig` and its tables) and
  :func:`structure_args` (a component's ``*_args`` table as its attrs class, one-line errors);
* :mod:`.models`: Hugging Face model loading (:func:`load_causal_lm`, :class:`ModelLoadError`);
* :mod:`.training`: the learning-rate schedule every backend uses (:func:`make_scheduler`, :func:`lr_factor`);
* :mod:`.engines`: the SGLang-protocol client every engine is driven with (:class:`EngineClient`);
* :mod:`.serving`: HTTP serving from a background thread (:class:`ThreadedServer`) behind the run
  secret (:func:`secret_middleware`), and the run secret itself (:func:`engine_headers`,
  :func:`presented_token`, :func:`token_matches`, :func:`process_secret`, :data:`OPEN_PATHS`,
  :func:`check_listen_address`);
* :mod:`.distributed`: rendezvous of ``torch.distributed`` groups (:func:`host_rendezvous`,
  :func:`reachable_address`, :func:`free_port`, :func:`retry_on_port_collision`; Gloo groups kept on
  the node's address with :func:`pin_gloo_to_this_node`) and weight-update groups between trainers
  and engines (:func:`init_weight_update_group`, :func:`join_with_engines`,
  :func:`destroy_weight_update_group`, :func:`resolve_backend`, :func:`node_id`);
* :mod:`.files`: per-step JSONL files cut back to a resumed step (:func:`truncate_jsonl`), checkpoint
  files written atomically with a full disk said plainly (:func:`save_torch_atomically`);
* :mod:`.grammar`: grammar-constrained decoding that engines and trainers compute alike
  (:func:`compile_grammar`, :class:`TokenGrammar`, :func:`token_grammar`, :func:`mask_logits`,
  :func:`allowed_sets`, :class:`GrammarError`).

``from loongsage_core.backend_api import X`` keeps working for every name above (each is loaded
from its submodule when first asked for), so plugins written against the package stay valid.
"""

from __future__ import annotations

import importlib
from typing import Any

SUBMODULES: dict[str, tuple[str, ...]] = {
    "loss": ("LossPipeline", "LossPipelineError", "MetricAccumulator", "compute_norm", "old_from_training_forward"),
    "schema": ("AlgorithmConfig", "JobConfig", "LoraConfig", "ModelConfig", "RunConfig", "TrainConfig",
               "structure_args"),
    "models": ("ModelLoadError", "load_causal_lm"),
    "training": ("lr_factor", "make_scheduler"),
    "engines": ("EngineClient",),
    "serving": ("OPEN_PATHS", "ThreadedServer", "check_listen_address", "engine_headers", "presented_token",
                "process_secret", "secret_middleware", "token_matches"),
    "distributed": ("destroy_weight_update_group", "free_port", "host_rendezvous", "init_weight_update_group",
                    "join_with_engines", "node_id", "pin_gloo_to_this_node", "reachable_address", "resolve_backend",
                    "retry_on_port_collision"),
    "files": ("save_torch_atomically", "truncate_jsonl"),
    "grammar": ("GrammarError", "TokenGrammar", "allowed_sets", "compile_grammar", "mask_logits", "token_grammar"),
}
"""Every public name, by the submodule that provides it."""

_WHERE = {name: module for module, names in SUBMODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, loaded from its submodule on first use (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted(_WHERE)
