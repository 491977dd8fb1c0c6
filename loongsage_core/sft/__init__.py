"""Supervised fine-tuning (``loongsage sft``): chat data rendered like AgentFlow renders it, loss on
the assistant turns, packing, and a training loop that drives the job's train backend worker.

* :mod:`.render`: a conversation to token ids and a loss mask through the router's own TITO code;
* :mod:`.data`: ``[[data]]`` rows to rendered examples, the held-back split, steps and packed rows;
* :mod:`.loss`: the token-mean negative log-likelihood as loss-pipeline components;
* :mod:`.run`: the loop (one process, no Ray): steps, evaluation, loggers, checkpoints, export.

Heavy imports (torch, transformers) happen inside functions.
"""

from .render import ConversationError, render_conversation

__all__ = ["ConversationError", "render_conversation"]
