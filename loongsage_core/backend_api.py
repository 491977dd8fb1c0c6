"""The host's public API for plugins: what backends and transports legitimately share.

Plugins import host names from this module only (the layer rules of ``.importlinter`` check it):
everything else in :mod:`loongsage_core` is private to the host and may change without notice.
Importing this module is light (no torch, ray, transformers or httpx: :class:`EngineClient` is
imported on first use, PEP 562); tensor work happens inside the functions.

What it offers:

* **loss pipeline** (:class:`LossPipeline`, :class:`LossPipelineError`) and exact mini-batch metric
  means (:class:`MetricAccumulator`), the aggregation denominators (:func:`compute_norm`), whether
  a batch's old log-probs are the training forward's own (:func:`old_from_training_forward`);
* **job schema** a backend reads (:class:`JobConfig` and its tables) and :func:`structure_args`,
  which turns a component's ``*_args`` table into its attrs class with one-line errors;
* **Hugging Face model loading** (:func:`load_causal_lm`, :class:`ModelLoadError`): a causal LM
  from a local directory or an inline config, the same code for trainers, engines and teachers;
* **learning-rate schedules** (:func:`make_scheduler`, :func:`lr_factor`), the same in every backend;
* **the SGLang-protocol client** (:class:`EngineClient`) every engine's HTTP API is driven with;
* **HTTP serving** from a background thread (:class:`ThreadedServer`) behind the run secret
  (:func:`secret_middleware`), as the router and the embedded engine serve;
* **rendezvous** for ``torch.distributed`` groups across processes (:func:`host_rendezvous`,
  :func:`reachable_address`, :func:`free_port`, :func:`retry_on_port_collision`; Gloo groups kept
  on the node's address with :func:`pin_gloo_to_this_node`);
* **weight-update groups** between trainers and engines (:func:`init_weight_update_group`,
  :func:`join_with_engines`, :func:`destroy_weight_update_group`, :func:`resolve_backend`,
  :func:`node_id`);
* **security**: the run secret on control endpoints (:func:`engine_headers`,
  :func:`presented_token`, :func:`token_matches`, :func:`process_secret`, :data:`OPEN_PATHS`) and
  the rule that anything listening beyond loopback needs it (:func:`check_listen_address`);
* **per-step JSONL files** cut back to a resumed step (:func:`truncate_jsonl`);
* **checkpoint files** written atomically, a full disk raised as an ``OSError`` naming the file
  (:func:`save_torch_atomically`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .algorithms import LossPipeline, LossPipelineError, MetricAccumulator, compute_norm
from .algorithms.old_logprobs import old_from_training_forward
from .config import JobConfig, ModelConfig, RunConfig, TrainConfig, structure_args
from .controller.run_dir import truncate_jsonl
from .disk_space import save_torch_atomically
from .hf_models import ModelLoadError, load_causal_lm
from .http_server import ThreadedServer, secret_middleware
from .lr_schedule import lr_factor, make_scheduler
from .rendezvous import free_port, host_rendezvous, pin_gloo_to_this_node, reachable_address, retry_on_port_collision
from .security import (
    OPEN_PATHS,
    check_listen_address,
    engine_headers,
    presented_token,
    process_secret,
    token_matches,
)
from .weight_group import (
    destroy_weight_update_group,
    init_weight_update_group,
    join_with_engines,
    node_id,
    resolve_backend,
)

if TYPE_CHECKING:  # pragma: no cover
    from loongsage_hookspecs import JobSettings

    from .engine_client import EngineClient

    def _the_job_is_what_backends_read(job: JobConfig) -> JobSettings:
        """Checked by the type checker (``tox -e type``): the host's schema keeps every field the
        contract promises backends (``loongsage_hookspecs.settings``)."""
        return job


def __getattr__(name: str) -> Any:
    """Names whose modules are heavier to import than the rest, loaded when first used."""
    if name == "EngineClient":
        from .engine_client import EngineClient

        return EngineClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "OPEN_PATHS",
    "EngineClient",
    "JobConfig",
    "LossPipeline",
    "LossPipelineError",
    "MetricAccumulator",
    "ModelLoadError",
    "ModelConfig",
    "RunConfig",
    "ThreadedServer",
    "TrainConfig",
    "check_listen_address",
    "compute_norm",
    "destroy_weight_update_group",
    "engine_headers",
    "free_port",
    "host_rendezvous",
    "init_weight_update_group",
    "join_with_engines",
    "load_causal_lm",
    "lr_factor",
    "make_scheduler",
    "node_id",
    "old_from_training_forward",
    "pin_gloo_to_this_node",
    "presented_token",
    "process_secret",
    "reachable_address",
    "resolve_backend",
    "retry_on_port_collision",
    "save_torch_atomically",
    "secret_middleware",
    "structure_args",
    "token_matches",
    "truncate_jsonl",
]
