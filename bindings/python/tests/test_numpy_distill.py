"""fusedce.core's class-probability targets (forward, backward, linear_ce with q [rows, vocab]) and
its distillation calls (distill, linear_distill) on the CPU backend, with NumPy, against float64
NumPy definitions written here (docs/semantics.md rules 19 and 20). Runs in CI: no torch.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_numpy_distill.py
"""

import numpy as np
import pytest

import fusedce
from fusedce import core

V, N = 37, 12
REDUCTIONS = ["mean", "sum", "none"]
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]


# ------------------------------------------------------------ float64 definitions ----
def log_softmax(a):
    a = np.asarray(a, np.float64)
    m = a.max(-1, keepdims=True)
    return a - m - np.log(np.exp(a - m).sum(-1, keepdims=True))


def reduce(rows, reduction, count):
    if reduction == "none":
        return rows
    return rows.sum() / (max(count, 1) if reduction == "mean" else 1)


def soft_ce(z, q, reduction="mean", label_smoothing=0.0, class_weights=None, grad_output=1.0):
    """torch's F.cross_entropy(z, q) with probabilities q: (loss, dloss/dz)."""
    n, v = z.shape
    lp = log_softmax(z)
    qq = (1 - label_smoothing) * q.astype(np.float64) + label_smoothing / v
    w = np.ones(v) if class_weights is None else class_weights.astype(np.float64)
    rows = -(w * qq * lp).sum(-1)
    wq = w * qq
    grad = wq.sum(-1, keepdims=True) * np.exp(lp) - wq
    g = np.broadcast_to(np.asarray(grad_output, np.float64), (n,) if reduction == "none" else ())
    grad = grad * (g[:, None] if reduction == "none" else g / (n if reduction == "mean" else 1))
    return reduce(rows, reduction, n), grad


def divergence_rows(z, t, divergence, beta, temperature):
    """Per-row divergence and its gradient with respect to z (rule 20)."""
    lp, lq = log_softmax(z / temperature), log_softmax(t / temperature)
    p, q = np.exp(lp), np.exp(lq)
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
        rows = (q * (lq - lp)).sum(-1)
        du = p - q
    elif divergence == "reverse_kl" or (divergence == "jsd" and beta == 1):
        rows = (p * (lp - lq)).sum(-1)
        du = p * ((lp - lq) - rows[:, None])
    else:
        lm = np.logaddexp(np.log(beta) + lq, np.log(1 - beta) + lp)
        k = (p * (lp - lm)).sum(-1)
        rows = beta * (q * (lq - lm)).sum(-1) + (1 - beta) * k
        du = (1 - beta) * p * ((lp - lm) - k[:, None])
    return rows, du / temperature


def distill_ref(z, t, targets=None, divergence="forward_kl", beta=0.5, temperature=1.0,
                reduction="mean", ignore_index=-100, grad_output=1.0):
    rows, grad = divergence_rows(z, t, divergence, beta, temperature)
    counted = (np.ones(len(z), bool) if targets is None else targets != ignore_index)
    rows, grad = np.where(counted, rows, 0.0), np.where(counted[:, None], grad, 0.0)
    n = int(counted.sum())
    g = np.broadcast_to(np.asarray(grad_output, np.float64), (len(z),) if reduction == "none"
                        else ())
    grad = grad * (g[:, None] if reduction == "none" else g / (max(n, 1) if reduction == "mean"
                                                               else 1))
    return reduce(rows, reduction, n), grad


def make(n=N, v=V, seed=0):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    t = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    q = rng.random((n, v)).astype(np.float32) ** 3
    q /= q.sum(-1, keepdims=True)
    y = rng.integers(0, v, n).astype(np.int64)
    y[1::4] = -100
    return z, t, q, y


def close(a, b, tol=2e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


# ================================================================ probabilities ====
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_backward_probabilities(reduction, smoothing, weighted):
    z, _, q, _ = make()
    w = np.random.default_rng(3).uniform(0.3, 2, V).astype(np.float32) if weighted else None
    go = np.linspace(0.5, 2, N).astype(np.float32) if reduction == "none" else 0.75
    loss, grad = soft_ce(z, q, reduction, smoothing, w, go)
    r = core.forward(z, q, reduction=reduction, label_smoothing=smoothing, class_weights=w,
                     return_grad=True, return_lse=True, grad_output=go)
    close(r.loss, loss)
    close(r.grad_logits, grad)
    close(r.lse, np.log(np.exp(z.astype(np.float64)).sum(-1)))
    g2 = core.backward(z, q, r.lse, go, reduction=reduction, label_smoothing=smoothing,
                       class_weights=w)
    close(g2, grad)


def test_one_hot_probabilities_equal_indices():
    z, _, _, y = make()
    y = np.abs(y) % V
    q = np.eye(V, dtype=np.float32)[y]
    for reduction in REDUCTIONS:
        a = core.forward(z, q, reduction=reduction, label_smoothing=0.1, return_grad=True)
        b = core.forward(z, y, reduction=reduction, label_smoothing=0.1, return_grad=True)
        close(a.loss, b.loss, 1e-6)
        close(a.grad_logits, b.grad_logits, 1e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_ce_probabilities(reduction):
    rng = np.random.default_rng(7)
    h = rng.standard_normal((N, 8)).astype(np.float32)
    W = rng.standard_normal((V, 8)).astype(np.float32) * 0.5
    b = rng.standard_normal(V).astype(np.float32) * 0.1
    _, _, q, _ = make()
    z = h.astype(np.float64) @ W.T.astype(np.float64) + b
    loss, gz = soft_ce(z, q, reduction, 0.1, None)
    r = core.linear_ce(h, W, q, b, reduction=reduction, label_smoothing=0.1, return_grad=True,
                       z_loss_scale=0.0)
    close(r.loss, loss)
    close(r.grad_hidden, gz @ W.astype(np.float64))
    close(r.grad_weight, gz.T @ h.astype(np.float64))
    close(r.grad_bias, gz.sum(0))


def test_probability_errors():
    z, _, q, _ = make()
    with pytest.raises(ValueError, match="targets has 36 columns"):
        core.forward(z, q[:, :-1])
    with pytest.raises(TypeError, match="the logits' dtype"):
        core.forward(z, q.astype(np.float16))
    with pytest.raises(ValueError, match="must be dense"):
        core.forward(z, np.zeros((N, 2 * V), np.float32)[:, :V])
    with pytest.raises(fusedce.InvalidArgumentError, match="token_scaling"):
        core.forward(z, q, token_scaling=True)
    with pytest.raises(fusedce.InvalidArgumentError, match="accuracy"):
        core.forward(z, q, return_accuracy=True)
    with pytest.raises(fusedce.UnsupportedError, match="shift_seq_len"):
        core.forward(z, q, shift_seq_len=4)
    with pytest.raises(TypeError, match="int32 or int64"):
        core.forward(z, q[:, 0])


def test_probability_workspace_queries():
    assert core.forward_workspace_size(N, V, target_dtype="float32") >= 0
    assert core.backward_workspace_size(N, V, target_dtype="float32") >= 0
    lo, hi = core.linear_ce_workspace_size(N, 8, V, target_dtype="float32")
    assert 0 <= lo <= hi


# ================================================================= distillation ====
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_distill(divergence, reduction):
    z, t, _, y = make(seed=1)
    go = np.linspace(0.5, 2, N).astype(np.float32) if reduction == "none" else 1.5
    loss, grad = distill_ref(z, t, y, divergence, 0.3, 1.7, reduction, grad_output=go)
    r = core.distill(z, t, y, divergence=divergence, beta=0.3, temperature=1.7,
                     reduction=reduction, return_grad=True, return_lse=True, grad_output=go)
    close(r.loss, loss)
    close(r.grad_logits, grad)
    close(r.lse, np.log(np.exp(z.astype(np.float64) / 1.7).sum(-1)))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distill_jsd_ends(beta):
    z, t, _, _ = make(seed=2)
    loss, grad = distill_ref(z, t, None, "jsd", beta)
    r = core.distill(z, t, divergence="jsd", beta=beta, return_grad=True)
    close(r.loss, loss)
    close(r.grad_logits, grad)


def test_distill_options():
    """ignore_index other than -100, no targets, strided student and teacher, in place, the
    divergence by its code, logit_scale and softcap applied to both sides."""
    z, t, _, y = make(seed=3)
    y[::3] = 5
    r = core.distill(z, t, y, ignore_index=5, return_grad=True)
    loss, grad = distill_ref(z, t, y, ignore_index=5)
    close(r.loss, loss)
    close(r.grad_logits, grad)
    wide = np.zeros((N, V + 5), np.float32)
    wide[:, :V] = t
    zz = z.copy()
    r = core.distill(zz, wide[:, :V], divergence=1, in_place=True)
    loss, grad = distill_ref(z, t, divergence="reverse_kl")
    close(r.loss, loss)
    close(zz, grad)
    s, c = 0.7, 3.0
    r = core.distill(z, t, logit_scale=s, softcap=c, return_grad=True)
    loss, _ = distill_ref(c * np.tanh(s * z.astype(np.float64) / c),
                          c * np.tanh(s * t.astype(np.float64) / c))
    close(r.loss, loss)


def test_distill_all_rows_ignored():
    z, t, _, _ = make()
    r = core.distill(z, t, np.full(N, -100), return_grad=True)
    assert float(r.loss) == 0.0 and not r.grad_logits.any()


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_distill(divergence, reduction):
    rng = np.random.default_rng(4)
    h = rng.standard_normal((N, 8)).astype(np.float32)
    W = (rng.standard_normal((V, 8)) * 0.5).astype(np.float32)
    th = rng.standard_normal((N, 5)).astype(np.float32)
    tW = (rng.standard_normal((V, 5)) * 0.5).astype(np.float32)
    _, _, _, y = make()
    z = h.astype(np.float64) @ W.T.astype(np.float64)
    t = th.astype(np.float64) @ tW.T.astype(np.float64)
    go = np.linspace(0.5, 2, N).astype(np.float32) if reduction == "none" else 0.5
    loss, gz = distill_ref(z, t, y, divergence, 0.25, 2.0, reduction, grad_output=go)
    r = core.linear_distill(h, W, th, tW, y, divergence=divergence, beta=0.25, temperature=2.0,
                            reduction=reduction, return_grad=True, grad_output=go,
                            return_lse=True)
    close(r.loss, loss)
    close(r.grad_hidden, gz @ W.astype(np.float64))
    close(r.grad_weight, gz.T @ h.astype(np.float64))
    close(r.lse, np.log(np.exp(z / 2.0).sum(-1)))
    # the smallest workspace gives the same result; weight only; accumulate
    r2 = core.linear_distill(h, W, th, tW, y, divergence=divergence, beta=0.25,
                             temperature=2.0, reduction=reduction, return_grad="weight",
                             grad_output=go, workspace_size="min")
    assert r2.grad_hidden is None
    close(r2.grad_weight, r.grad_weight)
    acc = np.ones_like(W)
    core.linear_distill(h, W, th, tW, y, divergence=divergence, beta=0.25, temperature=2.0,
                        reduction=reduction, grad_weight=acc, accumulate=True, grad_output=go)
    close(acc, r.grad_weight + 1)


def test_distill_workspace_queries():
    assert core.distill_workspace_size(N, V, divergence="jsd") >= 0
    lo, hi = core.linear_distill_workspace_size(N, 8, V, 5)
    assert 0 < lo <= hi
    assert fusedce.distill is core.distill and fusedce.linear_distill is core.linear_distill


def test_distill_errors():
    z, t, q, y = make()
    with pytest.raises(ValueError, match="divergence"):
        core.distill(z, t, divergence="kl")
    with pytest.raises(ValueError, match="teacher_logits has 11 rows"):
        core.distill(z, t[:11])
    with pytest.raises(TypeError, match="teacher_logits has dtype float16"):
        core.distill(z, t.astype(np.float16))
    with pytest.raises(TypeError, match="class indices"):
        core.distill(z, t, q)
    with pytest.raises(TypeError, match="beta must be a real number"):
        core.distill(z, t, beta="half")
    with pytest.raises(fusedce.InvalidArgumentError, match="teacher->beta"):
        core.distill(z, t, divergence="jsd", beta=1.5)
    with pytest.raises(fusedce.InvalidArgumentError, match="teacher->temperature"):
        core.distill(z, t, temperature=0.0)
    h, W = np.ones((N, 4), np.float32), np.ones((V, 4), np.float32)
    with pytest.raises(ValueError, match="teacher_weight has 3 columns"):
        core.linear_distill(h, W, np.ones((N, 5), np.float32), np.ones((V, 3), np.float32))
    with pytest.raises(ValueError, match="teacher_hidden has 11 rows"):
        core.linear_distill(h, W, np.ones((N - 1, 5), np.float32), np.ones((V, 5), np.float32))
    with pytest.raises(ValueError, match="return_grad asks for the bias"):
        core.linear_distill(h, W, h, W, return_grad="bias")
