"""Per-request sampling over a batch of next-token logits.

Every row has its own temperature, top-p, top-k, min-p and random stream. Greedy rows
(``temperature`` at or below :data:`GREEDY_TEMPERATURE`) take the arg-max. Sampled rows draw
one uniform number from their own ``torch.Generator`` (seeded per request when the request gives
``sampling_seed``/``seed``, else the engine's generator) and invert the cumulative distribution
of the filtered, renormalised probabilities, so a seeded request samples the same tokens whatever
else shares its batch.

The reported log-probability of a sampled token is ``log_softmax(raw logits)[token]``: the
policy's log-probability at temperature 1 before any filtering, which is exactly what a trainer
computes for the same token with a plain forward. It does not depend on the sampling
temperature or top-p/top-k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch

GREEDY_TEMPERATURE = 1e-5


@attrs.define(frozen=True)
class SamplingParams:
    """The sampling settings of one request (SGLang field names, validated by :mod:`.protocol`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    #: llguidance's serialized grammar the output must follow (constrained decoding), else ``None``
    grammar: str | None = None
    #: how many of the prompt's last tokens were generated under ``grammar`` already (a resumed turn)
    grammar_offset: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1


def sample(logits: "torch.Tensor", params: Sequence[SamplingParams],
           generators: Sequence["torch.Generator"]) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Pick one token per row of ``logits`` ``[B, V]``; returns ``(tokens [B], logprobs [B])``."""
    import torch

    B, V = logits.shape
    logprobs_all = torch.log_softmax(logits, dim=-1)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    # a batch of one kind (the usual case) uses ``logits`` as it is, without a copy of its rows
    if len(greedy) == B:
        tokens = logits.argmax(dim=-1)
    elif len(sampled) == B:
        tokens = _sample_rows(logits, params, generators)
    else:
        tokens = torch.empty(B, dtype=torch.long)
        if greedy:
            idx = torch.tensor(greedy)
            tokens[idx] = logits[idx].argmax(dim=-1)
        idx = torch.tensor(sampled)
        tokens[idx] = _sample_rows(logits[idx], [params[i] for i in sampled], [generators[i] for i in sampled])
    logprobs = logprobs_all.gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs


def _sample_rows(logits: "torch.Tensor", params: Sequence[SamplingParams],
                 generators: Sequence["torch.Generator"]) -> "torch.Tensor":
    import torch

    n, V = logits.shape
    if all(p.temperature == 1.0 for p in params):
        probs = torch.softmax(logits, dim=-1)  # the same numbers as dividing by 1, one pass fewer
    else:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    filtered = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
    if not filtered:
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # as .double().cumsum(), without the copy
        choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        return choice.clamp_(max=V - 1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = _dropped(sorted_p, params)
    kept = sorted_p.masked_fill(drop, 0.0).double()
    cdf = kept.cumsum(dim=-1)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # a draw can only land on a kept token; clamp guards float rounding at the top end
    last_kept = (~drop).sum(dim=-1) - 1
    choice = torch.minimum(choice, last_kept)
    return order.gather(-1, choice[:, None])[:, 0]


def _dropped(sorted_p: "torch.Tensor", params: Sequence[SamplingParams]) -> "torch.Tensor":
    """Which entries of the descending-sorted probabilities ``sorted_p`` ``[n, V]`` top-k, top-p
    and min-p filter out (the most likely token always survives)."""
    import torch

    V = sorted_p.shape[-1]
    drop = torch.zeros_like(sorted_p, dtype=torch.bool)
    ks = torch.tensor([p.top_k if p.top_k > 0 else V for p in params])
    drop |= torch.arange(V)[None, :] >= ks[:, None]
    top_ps = torch.tensor([p.top_p for p in params], dtype=sorted_p.dtype)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop |= mass_before > top_ps[:, None]
    min_ps = torch.tensor([p.min_p for p in params], dtype=sorted_p.dtype)
    drop |= sorted_p < (min_ps * sorted_p[:, 0])[:, None]
    drop[:, 0] = False
    return drop


def sampling_probs(logits: "torch.Tensor", params: SamplingParams) -> "torch.Tensor":
    """The distribution :func:`sample` draws from for rows of ``logits`` ``[n, V]`` of one
    (non-greedy) request: softmax at its temperature, top-k/top-p/min-p filtered, renormalised;
    float64 ``[n, V]`` in vocabulary order. Speculative decoding accepts drafts against it."""
    import torch

    probs = torch.softmax(logits if params.temperature == 1.0 else logits / params.temperature, dim=-1)
    if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        kept = sorted_p.masked_fill(_dropped(sorted_p, [params] * logits.shape[0]), 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, kept)
    probs = probs.double()
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: "torch.Tensor", generator: "torch.Generator") -> int:
    """One token from the (not necessarily normalised) non-negative weights ``probs`` ``[V]``,
    by inverting their cumulative sum at one uniform number of ``generator``."""
    import torch

    cdf = probs.cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    choice = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)[0])
    if choice >= probs.shape[0] or probs[choice] <= 0:  # float rounding at the top end
        choice = int(torch.nonzero(probs > 0)[-1, 0])
    return choice
