"""fusedce.torch.distill and linear_distill on the CPU backend, against float64 torch
definitions: ``F.kl_div(log_p, log_q, log_target=True)`` for the forward and the reverse KL,
the generalised JSD(β) written out, the temperature, ignored rows, every reduction; gradcheck,
torch.compile, and the arguments refused.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_torch_distill.py
"""

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: fusedce.torch is optional")
import torch.nn.functional as F  # noqa: E402

import fusedce  # noqa: E402
from fusedce.torch import distill, linear_distill  # noqa: E402

REDUCTIONS = ["mean", "sum", "none"]
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]
N, V, D, TD = 12, 31, 8, 11


# ---------------------------------------------------------------- float64 reference ----
def reference(z, t, divergence="forward_kl", beta=0.5, temperature=1.0, target=None,
              ignore_index=-100, reduction="mean"):
    """The divergence of float64 logits [..., V] (docs/semantics.md rule 20): the teacher
    detached, rows whose target is ignore_index not counted."""
    log_p = F.log_softmax(z / temperature, -1)
    log_q = F.log_softmax(t.detach() / temperature, -1)
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
        rows = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1)
    elif divergence == "reverse_kl" or (divergence == "jsd" and beta == 1):
        rows = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    else:
        log_m = torch.logaddexp(log_q + math.log(beta), log_p + math.log(1 - beta))
        rows = (beta * (log_q.exp() * (log_q - log_m)).sum(-1)
                + (1 - beta) * (log_p.exp() * (log_p - log_m)).sum(-1))
    counted = (torch.ones_like(rows, dtype=torch.bool) if target is None
               else target != ignore_index)
    rows = torch.where(counted, rows, torch.zeros_like(rows))
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / counted.sum().clamp(min=1)


def assert_close(a, b, tol=2e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def upstream(ref):
    return (torch.linspace(0.5, 2.0, ref.numel(), dtype=torch.float64).reshape(ref.shape)
            if ref.dim() else torch.tensor(1.5, dtype=torch.float64))


def make(seed=0, lead=(N,)):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*lead, V, generator=g) * 2
    t = torch.randn(*lead, V, generator=g) * 2
    y = torch.randint(0, V, lead, generator=g)
    y.view(-1)[1::4] = -100
    return z, t, y


# ==================================================================== distill ====
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_distill(divergence, reduction):
    z, t, y = make(lead=(3, 4))
    z = z.requires_grad_()
    z64 = z.detach().double().requires_grad_()
    loss = distill(z, t, divergence=divergence, beta=0.3, temperature=1.7, target=y,
                   reduction=reduction)
    ref = reference(z64, t.double(), divergence, 0.3, 1.7, y, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref)
    g = upstream(ref)
    (got,) = torch.autograd.grad((loss * g.float()).sum(), z)
    assert_close(got, torch.autograd.grad((ref * g).sum(), z64)[0])


@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_distill_jsd_beta(beta):
    z, t, _ = make(seed=1)
    z = z.requires_grad_()
    z64 = z.detach().double().requires_grad_()
    loss = distill(z, t, divergence="jsd", beta=beta)
    ref = reference(z64, t.double(), "jsd", beta)
    assert_close(loss, ref)
    loss.backward()
    ref.backward()
    assert_close(z.grad, z64.grad)


def test_distill_options():
    """ignore_index, a strided student, a teacher of another dtype, logit_scale and softcap on
    both sides, the temperature, no T² factor, a second backward through the graph."""
    z, t, y = make(seed=2)
    y[::3] = 7
    wide = torch.randn(N, V + 9)
    wide[:, :V] = z
    wide.requires_grad_()
    student = wide[:, :V]  # row stride V + 9: used without a copy
    loss = distill(student, t.to(torch.bfloat16), target=y, ignore_index=7, temperature=3.0)
    z64 = z.double().requires_grad_()
    ref = reference(z64, t.to(torch.bfloat16).double(), temperature=3.0, target=y,
                    ignore_index=7)
    assert_close(loss, ref)
    loss.backward(retain_graph=True)
    ref.backward()
    first = wide.grad.clone()
    assert_close(first[:, :V], z64.grad)
    assert not first[:, V:].any()
    loss.backward()  # a second backward recomputes
    assert_close(wide.grad, 2 * first, 1e-6)
    s, c = 0.8, 4.0
    loss = distill(z, t, logit_scale=s, softcap=c, divergence="reverse_kl")
    ref = reference(c * torch.tanh(s * z.double() / c), c * torch.tanh(s * t.double() / c),
                    "reverse_kl")
    assert_close(loss, ref)


def test_distill_teacher_gets_no_gradient():
    z, t, _ = make(seed=3)
    z, t = z.requires_grad_(), t.requires_grad_()
    distill(z, t).backward()
    assert z.grad is not None and t.grad is None


def test_distill_all_ignored_and_no_grad():
    z, t, _ = make(seed=4)
    z = z.requires_grad_()
    loss = distill(z, t, target=torch.full((N,), -100))
    assert loss.item() == 0.0
    loss.backward()
    assert not z.grad.any()
    with torch.no_grad():
        assert_close(distill(z, t), reference(z.double(), t.double()))


def test_distill_16bit():
    z, t, _ = make(seed=5)
    zb = z.to(torch.bfloat16).requires_grad_()
    loss = distill(zb, t.to(torch.bfloat16), divergence="jsd")
    assert_close(loss, reference(zb.double(), t.to(torch.bfloat16).double(), "jsd"), 1e-4)
    loss.backward()
    assert zb.grad.dtype == torch.bfloat16


# ============================================================= linear_distill ====
def linear_inputs(seed=6, lead=(N,)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, D, generator=g)
    W = torch.randn(V, D, generator=g) * 0.5
    th = torch.randn(*lead, TD, generator=g)
    tW = torch.randn(V, TD, generator=g) * 0.5
    return h, W, th, tW


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_distill(divergence, reduction):
    """Against the unfused torch computation: both heads' logits whole, then the divergence."""
    h, W, th, tW = linear_inputs(lead=(2, 6))
    _, _, y = make(lead=(2, 6))
    h, W = h.requires_grad_(), W.requires_grad_()
    h64, W64 = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    loss = linear_distill(h, W, th, tW, divergence=divergence, beta=0.4, temperature=2.0,
                          target=y, reduction=reduction)
    ref = reference(h64 @ W64.T, th.double() @ tW.double().T, divergence, 0.4, 2.0, y,
                    reduction=reduction)
    assert loss.shape == ref.shape
    assert_close(loss, ref)
    g = upstream(ref)
    got = torch.autograd.grad((loss * g.float()).sum(), (h, W))
    want = torch.autograd.grad((ref * g).sum(), (h64, W64))
    for a, e in zip(got, want):
        assert_close(a, e)


def test_linear_distill_small_workspace_and_partial_grads():
    h, W, th, tW = linear_inputs(seed=7, lead=(64,))
    W = W.requires_grad_()
    ref = linear_distill(h, W, th, tW, divergence="jsd")
    (gw,) = torch.autograd.grad(ref, W)
    small = linear_distill(h, W, th, tW, divergence="jsd", workspace_bytes=0)
    (gw2,) = torch.autograd.grad(small, W)
    assert_close(small, ref, 1e-6)
    assert_close(gw2, gw, 1e-6)
    h = h.requires_grad_()
    loss = linear_distill(h, W.detach(), th, tW)
    loss.backward()
    assert h.grad is not None
    th.requires_grad_()
    tW.requires_grad_()
    linear_distill(h, W, th, tW).backward()
    assert th.grad is None and tW.grad is None


def test_linear_distill_autocast():
    """Under CPU autocast (bfloat16) the matmuls run in bfloat16; a float32 weight gets a
    float32 gradient."""
    h, W, th, tW = linear_inputs(seed=8)
    W = W.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_distill(h, W, th, tW)
    ref = reference(h.bfloat16().double() @ W.bfloat16().double().T,
                    th.bfloat16().double() @ tW.bfloat16().double().T)
    assert_close(loss, ref, 1e-3)
    loss.backward()
    assert W.grad.dtype == torch.float32


# =================================================================== gradcheck ====
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_gradcheck(divergence):
    """gradcheck in float64 (cast to float32 inside: the library computes in it); the teacher
    a constant."""
    g = torch.Generator().manual_seed(9)
    z = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, 7, generator=g)
    y = torch.tensor([1, -100, 2, 3, 4])
    for reduction in REDUCTIONS:
        def fn(z):
            return distill(z.float(), t, divergence=divergence, beta=0.3, temperature=1.5,
                           target=y, reduction=reduction)
        assert torch.autograd.gradcheck(fn, (z,), eps=1e-3, atol=2e-3, rtol=1e-2)
    h = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    th, tW = torch.randn(5, 4, generator=g), torch.randn(7, 4, generator=g)

    def lin(h, W):
        return linear_distill(h.float(), W.float(), th, tW, divergence=divergence,
                              reduction="none")
    assert torch.autograd.gradcheck(lin, (h, W), eps=1e-3, atol=2e-3, rtol=1e-2)


# ============================================================== torch.compile ====
def test_compile_fullgraph():
    z, t, y = make(seed=10)
    h, W, th, tW = linear_inputs(seed=10)
    z, h, W = z.requires_grad_(), h.requires_grad_(), W.requires_grad_()

    def step(z, t, h, W, th, tW, y):
        a = distill(z, t, divergence="jsd", beta=0.2, temperature=2.0, target=y)
        b = linear_distill(h, W, th, tW, divergence="reverse_kl", reduction="none").sum()
        return a + 0.5 * b

    compiled = torch.compile(step, fullgraph=True)
    eager = step(z, t, h, W, th, tW, y)
    ge = torch.autograd.grad(eager, (z, h, W))
    got = compiled(z, t, h, W, th, tW, y)
    gc = torch.autograd.grad(got, (z, h, W))
    assert_close(got, eager, 1e-6)
    for a, e in zip(gc, ge):
        assert_close(a, e, 1e-6)


# ===================================================================== errors ====
def test_errors():
    z, t, y = make()
    with pytest.raises(ValueError, match="divergence"):
        distill(z, t, divergence="kl")
    with pytest.raises(ValueError, match="teacher_logits must have the shape"):
        distill(z, t[:, :-1])
    with pytest.raises(TypeError, match="student_logits dtype float64"):
        distill(z.double(), t)
    with pytest.raises(TypeError, match="teacher_logits dtype float64"):
        distill(z, t.double())
    with pytest.raises(ValueError, match="target must have the shape"):
        distill(z, t, target=y[:-1])
    with pytest.raises(TypeError, match="target must hold integers"):
        distill(z, t, target=y.float())
    with pytest.raises(ValueError, match="reduction"):
        distill(z, t, reduction="batchmean")
    with pytest.raises(fusedce.InvalidArgumentError, match="beta"):
        distill(z, t, divergence="jsd", beta=2.0)
    with pytest.raises(fusedce.InvalidArgumentError, match="temperature"):
        distill(z, t, temperature=-1.0)
    with pytest.raises(TypeError, match="temperature must be a real number"):
        distill(z, t, temperature="hot")
    h, W, th, tW = linear_inputs()
    with pytest.raises(ValueError, match="weight must be"):
        linear_distill(h, W[:, :-1], th, tW)
    with pytest.raises(ValueError, match="teacher_hidden must be"):
        linear_distill(h, W, th[:-1], tW)
    with pytest.raises(ValueError, match="teacher_weight must be"):
        linear_distill(h, W, th, tW[:-1])
    with pytest.raises(TypeError, match="must match outside autocast"):
        linear_distill(h, W.half(), th, tW)
    with pytest.raises(ValueError, match="workspace_bytes"):
        linear_distill(h, W, th, tW, workspace_bytes=-1)
