"""LAMB and LARS (`autopar.optim`): the published update rules, and the same updates when
tensor parallelism or ZeRO cuts each parameter into pieces (the trust ratio takes the
norms of the whole parameter, summed over the ranks that hold its pieces)."""

import functools
import math

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import assert_equal, compare

from autopar.optim import LAMB, LARS

pool2 = dist_pool_fixture(2)
pool4 = dist_pool_fixture(4)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"


def _lamb_by_hand(w, grads, lr, b1, b2, eps, wd):
    """You et al. 2019, Algorithm 2, one tensor, written out element by element."""
    w = [float(x) for x in w]
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    for t, g in enumerate(grads, start=1):
        g = [float(x) for x in g]
        m = [b1 * a + (1 - b1) * b for a, b in zip(m, g)]
        v = [b2 * a + (1 - b2) * b * b for a, b in zip(v, g)]
        r = [(a / (1 - b1 ** t)) / (math.sqrt(b / (1 - b2 ** t)) + eps) for a, b in zip(m, v)]
        u = [a + wd * x for a, x in zip(r, w)]
        w_norm = math.sqrt(sum(x * x for x in w))
        u_norm = math.sqrt(sum(x * x for x in u))
        trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        w = [x - lr * trust * a for x, a in zip(w, u)]
    return w


def _lars_by_hand(w, grads, lr, momentum, wd, eta):
    """You, Gitman and Ginsburg 2017, Algorithm 1, one tensor, element by element."""
    w = [float(x) for x in w]
    buf = [0.0] * len(w)
    for g in grads:
        g = [float(x) for x in g]
        w_norm = math.sqrt(sum(x * x for x in w))
        g_norm = math.sqrt(sum(x * x for x in g))
        local = eta * w_norm / (g_norm + wd * w_norm) if w_norm > 0 and g_norm > 0 else 1.0
        buf = [momentum * b + lr * local * (a + wd * x) for b, a, x in zip(buf, g, w)]
        w = [x - b for x, b in zip(w, buf)]
    return w


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_updates_follow_the_published_rules(kind):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(12, generator=gen, dtype=torch.float64)
    grads = [torch.randn(12, generator=gen, dtype=torch.float64) for _ in range(4)]
    p = torch.nn.Parameter(w0.clone())
    if kind == "lamb":
        opt = LAMB([p], lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
        want = _lamb_by_hand(w0, grads, 0.01, 0.9, 0.99, 1e-6, 0.1)
    else:
        opt = LARS([p], lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02)
        want = _lars_by_hand(w0, grads, 0.5, 0.9, 0.01, 0.02)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert torch.allclose(p.detach(), torch.tensor(want, dtype=torch.float64), rtol=1e-12,
                          atol=1e-12)


def test_zero_norms_take_a_ratio_of_one():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    LAMB([p], lr=0.1).step()  # ||w|| = 0: plain Adam direction
    assert torch.allclose(p.detach(), torch.full((4,), -0.1), atol=1e-5)


LAMB_F = functools.partial(LAMB, lr=1e-2, weight_decay=0.01)
LARS_F = functools.partial(LARS, lr=0.5, momentum=0.9, weight_decay=1e-4)


@pytest.mark.parametrize("factory", [LAMB_F, LARS_F], ids=["lamb", "lars"])
@pytest.mark.parametrize("plan", [
    {"tensor": {"size": 2, "mode": "1d"}},
    {"data": 2, "zero": {"stage": 1}},
    {"data": 2, "zero": {"stage": 3}},
    {"pipeline": {"size": 2, "microbatches": 2}},
], ids=["tp2", "zero1", "zero3", "pp2"])
def test_sharded_equals_one_device(pool2, factory, plan):
    assert_equal(pool2.run(compare, GPT, plan, 3, 8, None, None, factory))


@pytest.mark.parametrize("factory", [LAMB_F, LARS_F], ids=["lamb", "lars"])
def test_sharded_over_a_2d_grid_and_zero2_with_tp(pool4, factory):
    assert_equal(pool4.run(compare, GPT, {"tensor": {"size": 4, "mode": "2d"}}, 3, 8, None,
                           None, factory))
    assert_equal(pool4.run(compare, GPT, {"data": 2, "tensor": {"size": 2, "mode": "1d"},
                                          "zero": {"stage": 2}}, 3, 8, None, None, factory))
