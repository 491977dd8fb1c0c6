"""The log-probs of a prompt's own tokens (SGLang's ``logprob_start_len``), scored in its prefill.

A request with ``return_logprob`` and ``logprob_start_len`` = ``s`` >= 0 gets, besides its output
tokens' log-probs, the log-probability of each prompt token from position ``s`` on given the
tokens before it (``meta_info.input_token_logprobs``; position 0 has none: ``null``), and with
``top_logprobs_num`` the most likely tokens at each of those positions (``input_top_logprobs``).
This is what scoring a text under a model needs: a reference or teacher model's log-probs of a
trajectory, Tinker's ``compute_logprobs``.

The logits of position ``p`` score the token at ``p + 1``, so the prefill must run every position
from ``s - 1`` on: the prefix cache serves at most ``s - 1`` positions of such a request, it is
never folded into an identical request's prefill, and it is prefilled alone with the logits of
every position (:class:`PromptScorer` keeps only the scores, chunk by chunk, so a long prompt never
holds ``[length, vocabulary]`` logits at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .request_state import RequestState


class PromptScorer:
    """Collects the prompt scores of one request from its prefill's chunks (:meth:`add`), then
    stores them on the request (:meth:`finish`)."""

    def __init__(self, req: "RequestState") -> None:
        self.req = req
        self.start = req.item.logprob_start_len
        self.top_n = req.item.top_logprobs_num
        self.logprobs: list[float | None] = [None] if self.start == 0 else []
        self.top: list[list[tuple[float, int]] | None] = [None] if self.start == 0 else []

    def add(self, logits: "torch.Tensor", first: int) -> None:
        """The logits ``[n, V]`` of positions ``first .. first + n - 1`` of the request's tokens."""
        import torch

        tokens = self.req.tokens
        lo = max(self.start - 1, 0) - first  # the first row that scores a wanted token
        hi = min(first + logits.shape[0], len(tokens) - 1) - first  # the last position scores no token
        if hi <= max(lo, 0):
            return
        rows = logits[max(lo, 0):hi].float()
        targets = torch.tensor(tokens[first + max(lo, 0) + 1: first + hi + 1])
        logp = torch.log_softmax(rows, dim=-1)
        self.logprobs.extend(logp.gather(-1, targets[:, None])[:, 0].tolist())
        if self.top_n:
            vals, ids = logp.topk(self.top_n, dim=-1)
            self.top.extend(list(zip(v, t)) for v, t in zip(vals.tolist(), ids.tolist()))

    def finish(self) -> None:
        self.req.prompt_logprobs = self.logprobs
        self.req.prompt_top_logprobs = self.top if self.top_n else None


def input_logprob_fields(item: Any, res: Any, decode: Any) -> dict[str, Any]:
    """SGLang's ``input_token_logprobs`` (``[[logprob, token_id, text_or_null], ...]`` from
    ``logprob_start_len`` on) and ``input_top_logprobs`` for a ``meta_info`` (empty when the
    request asked for none). ``decode`` turns one token id into its text (``return_text_in_logprobs``)."""
    if res.prompt_logprobs is None:
        return {}
    tokens = item.input_ids[item.logprob_start_len:]
    texts = [decode(t) for t in tokens] if decode is not None else [None] * len(tokens)
    out: dict[str, Any] = {"input_token_logprobs": [[lp, t, s] for lp, t, s in zip(res.prompt_logprobs, tokens, texts)]}
    if res.prompt_top_logprobs is not None:
        out["input_top_logprobs"] = [None if row is None else [[lp, t, None] for lp, t in row]
                                     for row in res.prompt_top_logprobs]
    return out
