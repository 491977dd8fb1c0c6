"""The blocked log-prob and entropy of a logits matrix (``trainer/token_scores.py``) against the
plain formulas and their autograd gradients."""

from __future__ import annotations

import pytest
import torch
from loongsage_plugin_torch.trainer.token_scores import TokenScores, block_rows, token_scores


def plain(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax`` picked at the targets, and ``-(p * log p).sum()``, through autograd."""
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets[..., None]).squeeze(-1)
    source = logp if entropy_grad else logp.detach()
    return picked, -(source.exp() * source).sum(-1)


@pytest.mark.parametrize("vocab,rows", [(7, 3), (1 << 17, 5)])  # one block; three blocks of two rows
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_match_the_plain_formulas(vocab, rows, entropy_grad):
    g = torch.Generator().manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.randn(2, rows, generator=g, dtype=torch.float64)
    assert block_rows(logits) == (rows if vocab == 7 else 2)

    picked, entropy = token_scores(logits, targets, entropy_grad=entropy_grad)
    assert entropy is not None and entropy.requires_grad == entropy_grad
    ((picked * weights[0]).sum() + ((entropy * weights[1]).sum() if entropy_grad else 0)).backward()
    ours = logits.grad.clone()
    logits.grad = None
    want_picked, want_entropy = plain(logits, targets, entropy_grad)
    ((want_picked * weights[0]).sum() + ((want_entropy * weights[1]).sum() if entropy_grad else 0)).backward()

    torch.testing.assert_close(picked, want_picked, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours, logits.grad, rtol=1e-10, atol=1e-12)


def test_gradcheck_with_and_without_the_entropy_term():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (4,), generator=g)
    assert torch.autograd.gradcheck(lambda x: TokenScores.apply(x, targets, True, True), (logits,))
    assert torch.autograd.gradcheck(lambda x: TokenScores.apply(x, targets, True, False)[0], (logits,))


def test_leading_dimensions_and_no_entropy():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 11, generator=g)
    targets = torch.randint(0, 11, (2, 3), generator=g)
    picked, entropy = token_scores(logits, targets, with_entropy=False)
    assert entropy is None and picked.shape == (2, 3)
    torch.testing.assert_close(picked, plain(logits, targets, False)[0])
    picked, entropy = token_scores(logits, targets)
    assert entropy is not None and entropy.shape == (2, 3) and bool((entropy > 0).all())


def test_extreme_logits_stay_finite():
    """Shifted by the row maximum: logits of 1e4 and -1e4 neither overflow nor give nan."""
    logits = torch.tensor([[1e4, 0.0, -1e4], [-1e4, -1e4, -1e4]], dtype=torch.float32, requires_grad=True)
    picked, entropy = token_scores(logits, torch.tensor([1, 2]))
    (picked.sum() + entropy.sum()).backward()
    assert torch.isfinite(picked).all() and torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()
    torch.testing.assert_close(picked, torch.tensor([-1e4, -1.0986123]))
