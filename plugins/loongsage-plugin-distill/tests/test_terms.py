"""Distillation terms against independent pure-Python float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from loongsage_plugin_distill import plugin, terms

from loongsage_hookspecs import KLInputs

TOL = 1e-10


def assert_per_token(value: torch.Tensor, case, expected) -> None:
    """``value[b, t] == expected(b, t)`` on trained tokens and exactly 0 elsewhere."""
    assert value.shape == case.mask.shape
    for b in range(case.mask.shape[0]):
        for t in range(case.mask.shape[1]):
            if case.mask[b, t]:
                assert value[b, t].item() == pytest.approx(expected(b, t), abs=TOL, rel=1e-9), (b, t)
            else:
                assert value[b, t].item() == 0.0, (b, t)


def sampled_d(case, b: int, t: int) -> float:
    y = int(case.tokens[b, t])
    return math.log(case.student(b, t)[y]) - math.log(case.teacher(b, t)[y])


# -- sampled-token terms -----------------------------------------------------------------------


def test_pg_is_detached_log_ratio(case):
    value = terms.pg(case.inputs())
    assert not value.requires_grad
    assert_per_token(value, case, lambda b, t: sampled_d(case, b, t))
    clamped = terms.pg(case.inputs(), clamp=0.1)
    assert float(clamped.abs().max()) <= 0.1 + 1e-12
    assert float(clamped.abs().max()) == pytest.approx(0.1)


def test_k2_and_k3_values_and_gradients(case):
    x = case.inputs()
    logp = x.logprobs.detach().clone().requires_grad_(True)
    x.logprobs = logp
    assert_per_token(terms.k2(x), case, lambda b, t: 0.5 * sampled_d(case, b, t) ** 2)
    assert_per_token(terms.k3(x), case,
                     lambda b, t: math.exp(-sampled_d(case, b, t)) + sampled_d(case, b, t) - 1)
    # d k2 / d logp = d ; d k3 / d logp = 1 - exp(-d)
    (g2,) = torch.autograd.grad(terms.k2(x).sum(), logp)
    (g3,) = torch.autograd.grad(terms.k3(x).sum(), logp)
    assert_per_token(g2, case, lambda b, t: sampled_d(case, b, t))
    assert_per_token(g3, case, lambda b, t: 1 - math.exp(-sampled_d(case, b, t)))


def test_k3_log_ratio_clamp_keeps_values_finite():
    mask = torch.tensor([[0.0, 1.0]])
    x = KLInputs(logprobs=torch.tensor([[0.0, -200.0]]), ref_logprobs=torch.tensor([[0.0, -0.1]]),
                 response_mask=mask)
    value = terms.k3(x, log_ratio_clamp=5.0)
    assert value[0, 1].item() == pytest.approx(math.exp(5.0) - 5.0 - 1.0, rel=1e-6)


# -- vocabulary-level terms --------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_full_kl_matches_reference(case, ref, direction):
    value = terms.full_kl(case.inputs(), direction=direction)
    if direction == "reverse":
        assert_per_token(value, case, lambda b, t: ref.kl(case.student(b, t), case.teacher(b, t)))
    else:
        assert_per_token(value, case, lambda b, t: ref.kl(case.teacher(b, t), case.student(b, t)))


@pytest.mark.parametrize("mode", ["tail", "renorm"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_topk_kl_with_k_equal_to_vocab_is_full_kl(case, ref, mode, direction):
    vocab = case.student_logits.shape[-1]
    value = terms.topk_kl(case.inputs(topk=vocab), direction=direction, mode=mode)
    full = terms.full_kl(case.inputs(), direction=direction)
    torch.testing.assert_close(value, full, atol=1e-10, rtol=1e-9)
    pick = (lambda b, t: ref.kl(case.student(b, t), case.teacher(b, t))) if direction == "reverse" else \
        (lambda b, t: ref.kl(case.teacher(b, t), case.student(b, t)))
    assert_per_token(value, case, pick)


@pytest.mark.parametrize("mode", ["tail", "renorm"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_topk_kl_partial_support_matches_bucket_reference(case, ref, mode, direction):
    k = 4

    def expected(b, t):
        teacher = case.teacher(b, t)
        support = sorted(range(len(teacher)), key=lambda i: -teacher[i])[:k]
        s = ref.topk_buckets(case.student(b, t), support, mode)
        q = ref.topk_buckets(teacher, support, mode)
        return ref.kl(s, q) if direction == "reverse" else ref.kl(q, s)

    value = terms.topk_kl(case.inputs(topk=k), direction=direction, mode=mode)
    assert_per_token(value, case, expected)


def test_topk_arg_k_keeps_the_teachers_largest_entries_in_any_order(case):
    x = case.inputs(topk=8)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    x.ref_topk_ids, x.ref_topk_logprobs = x.ref_topk_ids[..., perm], x.ref_topk_logprobs[..., perm]
    torch.testing.assert_close(terms.topk_kl(x, k=3), terms.topk_kl(case.inputs(topk=3)))


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_topk_tail_kl_never_exceeds_full_kl(ref, direction):
    """Merging the vocabulary outside the top-k into one bucket cannot increase a KL."""
    for seed in range(4):
        case = ref.make_case(seed=seed, vocab=17, scale=3.0)
        full = terms.full_kl(case.inputs(), direction=direction)
        for k in (1, 3, 8, 16):
            part = terms.topk_kl(case.inputs(topk=k), direction=direction, mode="tail")
            assert bool((part <= full + 1e-9).all()), (seed, k)  # 1 - sum(q) cancels at k ~ V
        assert float(terms.topk_kl(case.inputs(topk=3), direction=direction).detach().sum()) > 0


def test_jsd_endpoints_are_the_kl_limits(case, ref):
    forward = terms.full_kl(case.inputs(), direction="forward")
    reverse = terms.full_kl(case.inputs(), direction="reverse")
    torch.testing.assert_close(terms.jsd(case.inputs(), beta=0.0), forward)
    torch.testing.assert_close(terms.jsd(case.inputs(), beta=1.0), reverse)
    assert_per_token(terms.jsd(case.inputs(), beta=0), case,
                     lambda b, t: ref.kl(case.teacher(b, t), case.student(b, t)))
    # normalize=true is continuous: the interior tends to the endpoint KLs
    near0 = terms.jsd(case.inputs(), beta=1e-7, normalize=True)
    near1 = terms.jsd(case.inputs(), beta=1 - 1e-7, normalize=True)
    torch.testing.assert_close(near0, forward, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(near1, reverse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_interior_matches_reference(case, ref, beta):
    value = terms.jsd(case.inputs(), beta=beta)
    assert_per_token(value, case, lambda b, t: ref.jsd(case.student(b, t), case.teacher(b, t), beta))
    scaled = terms.jsd(case.inputs(), beta=beta, normalize=True)
    torch.testing.assert_close(scaled, value / (beta * (1 - beta)))


def test_jsd_half_is_symmetric_and_bounded(case):
    x = case.inputs()
    swapped = KLInputs(logprobs=x.ref_logprobs, ref_logprobs=x.logprobs, response_mask=x.response_mask,
                       logits=case.teacher_logits, ref_logits=case.student_logits.detach())
    a, b = terms.jsd(x, beta=0.5), terms.jsd(swapped, beta=0.5)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    assert float(a.detach().max()) <= math.log(2) and float(a.detach().max()) > 0
    # other beta values are not symmetric
    assert not torch.allclose(terms.jsd(x, beta=0.2), terms.jsd(swapped, beta=0.2))
    assert torch.allclose(terms.jsd(x, beta=0.2), terms.jsd(swapped, beta=0.8))


def test_next_token_logit_layout_is_aligned(case):
    x = case.inputs(topk=5)
    shifted = KLInputs(logprobs=x.logprobs, ref_logprobs=x.ref_logprobs, response_mask=x.response_mask,
                       logits=case.student_logits[:, 1:], ref_logits=case.teacher_logits[:, 1:],
                       ref_topk_ids=x.ref_topk_ids[:, 1:], ref_topk_logprobs=x.ref_topk_logprobs[:, 1:])
    # entry t of the shifted layout scores token t + 1: shifting back gives the aligned tensors
    torch.testing.assert_close(terms.full_kl(shifted), terms.full_kl(x))
    torch.testing.assert_close(terms.topk_kl(shifted), terms.topk_kl(x))
    torch.testing.assert_close(terms.jsd(shifted), terms.jsd(x))


# -- properties shared by every term -----------------------------------------------------------

ALL_TERMS = [
    ("opd_pg", {}), ("opd_k2", {}), ("opd_k3", {}),
    ("opd_topk_kl", {"mode": "tail"}), ("opd_topk_kl", {"mode": "renorm", "direction": "forward"}),
    ("opd_full_kl", {"direction": "forward"}), ("opd_full_kl", {"direction": "reverse"}),
    ("opd_jsd", {"beta": 0.0}), ("opd_jsd", {"beta": 0.5}), ("opd_jsd", {"beta": 1.0}),
    ("opd_jsd", {"beta": 0.3, "normalize": True}),
    ("opd_mix", {"gkd": "k2"}), ("opd_mix", {}), ("opd_mix_topk", {"pg_ratio": 0.2, "gkd_ratio": 2.0}),
    ("opd_mix_logits", {"gkd": "jsd", "gkd_args": {"beta": 0.5}}),
]


def specs():
    return {s.name: s for s in plugin.loongsage_kls()}


@pytest.mark.parametrize(("name", "args"), ALL_TERMS)
def test_every_term_is_zero_when_student_equals_teacher(case, name, args):
    same = type(case)(case.student_logits, case.student_logits.detach().clone(), case.tokens, case.mask)
    value = specs()[name].fn(same.inputs(topk=6), **args)
    assert value.shape == case.mask.shape
    assert float(value.detach().abs().max()) < 1e-12


@pytest.mark.parametrize(("name", "args"), ALL_TERMS)
def test_masked_tokens_never_contribute(case, name, args):
    """Garbage (NaN, inf, out-of-range ids) on untrained positions changes nothing, gradients included."""
    clean = case.inputs(topk=6)
    off = case.mask == 0
    student = case.student_logits.detach().clone()
    student[off] = float("nan")
    student.requires_grad_(True)
    teacher = case.teacher_logits.clone()
    teacher[off] = float("inf")
    logp = clean.logprobs.detach().masked_fill(off, float("nan")).requires_grad_(True)
    dirty = KLInputs(logprobs=logp, ref_logprobs=clean.ref_logprobs.masked_fill(off, float("-inf")),
                     response_mask=case.mask, logits=student, ref_logits=teacher,
                     ref_topk_ids=clean.ref_topk_ids.masked_fill(off.unsqueeze(-1), -7),
                     ref_topk_logprobs=clean.ref_topk_logprobs.masked_fill(off.unsqueeze(-1), float("nan")))
    fn = specs()[name].fn
    value = fn(dirty, **args)
    torch.testing.assert_close(value, fn(clean, **args).detach(), atol=1e-12, rtol=1e-10)
    assert bool((value[off] == 0).all())
    if value.requires_grad:
        grads = torch.autograd.grad(value.sum(), [student, logp], allow_unused=True)
        used = [g for g in grads if g is not None]
        assert used
        for g in used:
            assert bool(torch.isfinite(g).all())
            assert bool((g[off] == 0).all())
        assert sum(float(g[~off].abs().sum()) for g in used) > 0


@pytest.mark.parametrize(("name", "args"), [t for t in ALL_TERMS if t[0] != "opd_pg"])
def test_gkd_terms_have_gradient_only_on_the_student(case, name, args):
    x = case.inputs(topk=6)
    teacher_logits = case.teacher_logits.clone().requires_grad_(True)
    ref_lp = x.ref_logprobs.detach().clone().requires_grad_(True)
    topk_lp = x.ref_topk_logprobs.detach().clone().requires_grad_(True)
    x.ref_logits, x.ref_logprobs, x.ref_topk_logprobs = teacher_logits, ref_lp, topk_lp
    value = specs()[name].fn(x, **args)
    assert value.requires_grad
    value.sum().backward()
    grad = case.student_logits.grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0
    assert teacher_logits.grad is None and ref_lp.grad is None and topk_lp.grad is None


def test_pg_has_no_gradient_and_feeds_advantages(case):
    x = case.inputs()
    value = terms.pg(x)
    assert not value.requires_grad and value.grad_fn is None
    adv = torch.ones_like(case.mask)
    out = terms.penalize_advantages(adv, value, coef=0.5, mask=case.mask)
    torch.testing.assert_close(out, (adv - 0.5 * value) * case.mask)


def test_full_kl_gradient_matches_closed_form(case):
    """d KL(pi || q) / d logits_v = pi_v * (log pi_v - log q_v - KL)."""
    value = terms.full_kl(case.inputs(), direction="reverse")
    (grad,) = torch.autograd.grad(value.sum(), case.student_logits)
    log_s = torch.log_softmax(case.student_logits.detach(), -1)
    log_t = torch.log_softmax(case.teacher_logits, -1)
    kl = (log_s.exp() * (log_s - log_t)).sum(-1, keepdim=True)
    expected = log_s.exp() * (log_s - log_t - kl) * case.mask.unsqueeze(-1)
    torch.testing.assert_close(grad, expected)


def test_mix_combines_pg_surrogate_and_gkd_term(case):
    x = case.inputs()
    logp = x.logprobs.detach().clone().requires_grad_(True)
    x.logprobs = logp
    mix = specs()["opd_mix"].fn
    value = mix(x, gkd="k3", pg_ratio=0.3, gkd_ratio=0.7)
    torch.testing.assert_close(value, 0.3 * terms.pg(x) + 0.7 * terms.k3(x))
    (grad,) = torch.autograd.grad(value.sum(), logp)
    d = terms.pg(x)
    expected = 0.3 * d + 0.7 * (1 - torch.exp(-d))
    torch.testing.assert_close(grad, expected * case.mask)


def test_mix_refuses_a_gkd_term_its_level_cannot_feed(case):
    with pytest.raises(ValueError, match="'gkd' must be one of"):
        specs()["opd_mix"].fn(case.inputs(), gkd="full_kl")
    with pytest.raises(ValueError, match="'gkd' must be one of"):
        specs()["opd_mix_topk"].fn(case.inputs(topk=3), gkd="jsd")
    with pytest.raises(TypeError, match="gkd_args"):
        specs()["opd_mix_logits"].fn(case.inputs(), gkd_args=[1])


# -- argument and input errors -----------------------------------------------------------------


def test_errors_name_the_bad_input(case):
    x = case.inputs(topk=4)
    with pytest.raises(ValueError, match="direction"):
        terms.full_kl(x, direction="sideways")
    with pytest.raises(ValueError, match="beta"):
        terms.jsd(x, beta=1.5)
    with pytest.raises(ValueError, match="'k'=5 exceeds the 4"):
        terms.topk_kl(x, k=5)
    with pytest.raises(ValueError, match="mode"):
        terms.topk_kl(x, mode="bucket")
    with pytest.raises(ValueError, match="ref_logits is not set"):
        terms.full_kl(case.inputs().__class__(logprobs=x.logprobs, ref_logprobs=x.ref_logprobs,
                                              response_mask=x.response_mask, logits=x.logits))
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        terms.k3(KLInputs(logprobs=x.logprobs, ref_logprobs=x.ref_logprobs[:, :2], response_mask=x.response_mask))
    with pytest.raises(TypeError, match="expected KLInputs"):
        terms.pg({"logprobs": x.logprobs})
    bad = case.inputs(topk=4)
    bad.ref_topk_ids = bad.ref_topk_ids.clone()
    bad.ref_topk_ids[0, 2, 0] = 999
    with pytest.raises(ValueError, match="ref_topk_ids on trained tokens must lie in"):
        terms.topk_kl(bad)


def test_vocab_size_compares_padded_vocabularies(case):
    x = case.inputs()
    extra = torch.full((3, 6, 5), -30.0, dtype=torch.float64)  # padding rows of a larger embedding table
    padded = KLInputs(logprobs=x.logprobs, ref_logprobs=x.ref_logprobs, response_mask=x.response_mask,
                      logits=x.logits, ref_logits=torch.cat([case.teacher_logits, extra], -1))
    with pytest.raises(ValueError, match="vocab_size"):
        terms.full_kl(padded)
    vocab = case.student_logits.shape[-1]
    torch.testing.assert_close(terms.full_kl(padded, vocab_size=vocab), terms.full_kl(x))
    torch.testing.assert_close(terms.jsd(padded, vocab_size=vocab), terms.jsd(x))


def test_float32_inputs_give_float32_values(case):
    x = case.inputs(topk=4)
    x32 = KLInputs(logprobs=x.logprobs.float(), ref_logprobs=x.ref_logprobs.float(), response_mask=x.response_mask,
                   logits=x.logits.float(), ref_logits=x.ref_logits.float(), ref_topk_ids=x.ref_topk_ids,
                   ref_topk_logprobs=x.ref_topk_logprobs.float())
    for fn in (terms.topk_kl, terms.full_kl, terms.jsd, terms.k3):
        out = fn(x32)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), fn(x).detach(), atol=1e-5, rtol=1e-4)
