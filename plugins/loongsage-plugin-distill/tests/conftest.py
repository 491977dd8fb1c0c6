"""Shared builders for the distillation tests: random student/teacher distributions and
independent pure-Python float64 reference formulas (no torch in the references)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from loongsage_hookspecs import KLInputs


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(x - top) for x in row]
    s = sum(e)
    return [x / s for x in e]


def kl(p: list[float], q: list[float]) -> float:
    """KL(p || q) with the 0 log 0 = 0 convention."""
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def jsd(student: list[float], teacher: list[float], beta: float) -> float:
    m = [beta * q + (1 - beta) * p for p, q in zip(student, teacher)]
    return beta * kl(teacher, m) + (1 - beta) * kl(student, m)


def topk_buckets(dist: list[float], support: list[int], mode: str) -> list[float]:
    """``dist`` coarse-grained onto ``support`` (+ one tail bucket) or renormalised on it."""
    inside = [dist[i] for i in support]
    if mode == "renorm":
        s = sum(inside)
        return [x / s for x in inside]
    return inside + [max(0.0, 1.0 - sum(inside))]


@dataclass
class Case:
    student_logits: torch.Tensor  # [B, T, V] float64, requires grad
    teacher_logits: torch.Tensor  # [B, T, V] float64
    tokens: torch.Tensor  # [B, T] sampled ids
    mask: torch.Tensor  # [B, T] float 0/1

    def inputs(self, *, topk: int | None = None) -> KLInputs:
        log_s = torch.log_softmax(self.student_logits, -1)
        log_t = torch.log_softmax(self.teacher_logits, -1)
        ids = self.tokens.unsqueeze(-1)
        x = KLInputs(logprobs=log_s.gather(-1, ids).squeeze(-1), ref_logprobs=log_t.gather(-1, ids).squeeze(-1),
                     response_mask=self.mask, logits=self.student_logits, ref_logits=self.teacher_logits)
        if topk is not None:
            values, index = log_t.topk(topk, dim=-1)
            x.ref_topk_ids, x.ref_topk_logprobs = index, values
        return x

    def student(self, b: int, t: int) -> list[float]:
        return softmax(self.student_logits[b, t].tolist())

    def teacher(self, b: int, t: int) -> list[float]:
        return softmax(self.teacher_logits[b, t].tolist())

    def positions(self) -> list[tuple[int, int]]:
        return [(b, t) for b in range(self.mask.shape[0]) for t in range(self.mask.shape[1]) if self.mask[b, t]]


def make_case(seed: int = 0, rows: int = 3, width: int = 6, vocab: int = 11, scale: float = 2.0) -> Case:
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(rows, width, vocab, generator=g, dtype=torch.float64) * scale).requires_grad_(True)
    teacher = torch.randn(rows, width, vocab, generator=g, dtype=torch.float64) * scale
    tokens = torch.multinomial(torch.softmax(student.detach().reshape(-1, vocab), -1), 1, generator=g).view(rows, width)
    mask = torch.zeros(rows, width, dtype=torch.float64)
    mask[0, 1:] = 1  # full row
    mask[1, 2:4] = 1  # a response in the middle, padding after
    mask[2, 1:3] = 1
    return Case(student, teacher, tokens, mask)


@pytest.fixture
def case() -> Case:
    return make_case()


@pytest.fixture
def ref() -> SimpleNamespace:
    """The reference formulas and builders of this file (test modules cannot import conftest)."""
    return SimpleNamespace(softmax=softmax, kl=kl, entropy=entropy, jsd=jsd, topk_buckets=topk_buckets,
                           make_case=make_case)
