"""fusedce.torch.cross_entropy and linear_cross_entropy with class-probability targets (a
floating target of the logits' shape) on the CPU backend, against torch's float64
``F.cross_entropy(input, probabilities)``: every reduction, label smoothing, class weights, the
z-loss, the gradient of the input, of hidden / weight / bias, and of the target itself;
gradcheck, torch.compile and the arguments refused.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_torch_prob_targets.py
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: fusedce.torch is optional")
import torch.nn.functional as F  # noqa: E402

from fusedce.torch import cross_entropy, linear_cross_entropy  # noqa: E402

REDUCTIONS = ["mean", "sum", "none"]
N, V, D = 10, 29, 8


def probs(*shape, dim=-1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(*shape, generator=g), dim)


def upstream(ref):
    """A non-trivial upstream gradient of the loss's shape."""
    return torch.linspace(0.5, 2.0, ref.numel(), dtype=torch.float64).reshape(ref.shape) \
        if ref.dim() else torch.tensor(0.75, dtype=torch.float64)


def assert_close(a, b, tol=2e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def leaves(*ts):
    """float32 leaves requiring grad, and float64 copies of them requiring grad."""
    f32 = [t.detach().float().requires_grad_() for t in ts]
    f64 = [t.detach().double().requires_grad_() for t in ts]
    return f32, f64


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_probabilities(reduction, smoothing, weighted):
    torch.manual_seed(1)
    w = torch.rand(V) + 0.3 if weighted else None
    (z, q), (z64, q64) = leaves(torch.randn(N, V) * 2, probs(N, V))
    loss = cross_entropy(z, q, w, reduction=reduction, label_smoothing=smoothing)
    ref = F.cross_entropy(z64, q64, w.double() if weighted else None, reduction=reduction,
                          label_smoothing=smoothing)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref)
    g = upstream(ref)
    (loss * g.float()).sum().backward()
    (ref * g).sum().backward()
    assert_close(z.grad, z64.grad)
    assert_close(q.grad, q64.grad)  # the target's own gradient


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_probabilities_shapes(reduction):
    """(C,) with (C,), and (N, C, d1, d2) with a target of that shape (the classes in dim 1)."""
    z = torch.randn(V, requires_grad=True)
    q = probs(V)
    assert_close(cross_entropy(z, q, reduction=reduction),
                 F.cross_entropy(z.double(), q.double(), reduction=reduction))
    z = torch.randn(2, V, 3, 4, requires_grad=True)
    q = probs(2, V, 3, 4, dim=1)
    loss = cross_entropy(z, q, reduction=reduction, label_smoothing=0.1)
    ref = F.cross_entropy(z.double(), q.double(), reduction=reduction, label_smoothing=0.1)
    assert loss.shape == ref.shape
    assert_close(loss, ref)
    (gz,) = torch.autograd.grad(loss.sum(), z)
    (rz,) = torch.autograd.grad(ref.sum(), z)
    assert_close(gz, rz)


def test_cross_entropy_probabilities_extras():
    """z-loss (and its per-row output), softcap, lse, entropy and the predicted tokens."""
    torch.manual_seed(2)
    z, q = torch.randn(N, V) * 3, probs(N, V)
    lam, cap = 1e-2, 4.0
    a = cap * torch.tanh(z.double() / cap)
    lse = torch.logsumexp(a, -1)
    ce = -(q.double() * torch.log_softmax(a, -1)).sum(-1)
    out = cross_entropy(z, q, reduction="none", z_loss=lam, softcap=cap, return_z_loss=True,
                        return_lse=True, return_predicted_tokens=True, return_entropy=True)
    assert_close(out.loss, ce + lam * lse ** 2)
    assert_close(out.z_loss, lam * lse ** 2)
    assert_close(out.lse, lse)
    assert torch.equal(out.predicted_tokens, z.argmax(-1))
    p = torch.softmax(a, -1)
    assert_close(out.entropy, lse - (p * a).sum(-1))
    mean = cross_entropy(z, q, z_loss=lam, softcap=cap, return_z_loss=True)
    assert_close(mean.loss, (ce + lam * lse ** 2).mean())
    assert_close(mean.z_loss, (lam * lse ** 2).mean())


def test_cross_entropy_one_hot_equals_indices():
    torch.manual_seed(3)
    z = torch.randn(N, V, requires_grad=True)
    y = torch.randint(0, V, (N,))
    q = F.one_hot(y, V).float()
    for reduction in ("sum", "none"):
        a = cross_entropy(z, q, reduction=reduction, label_smoothing=0.1)
        b = cross_entropy(z, y, reduction=reduction, label_smoothing=0.1)
        assert_close(a, b, 1e-6)


def test_cross_entropy_probabilities_16bit():
    z = torch.randn(N, V).to(torch.bfloat16).requires_grad_()
    q = probs(N, V).to(torch.bfloat16)
    loss = cross_entropy(z, q)
    ref = F.cross_entropy(z.double(), q.double())
    assert_close(loss, ref, 1e-4)
    loss.backward()
    assert z.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_probabilities(reduction):
    torch.manual_seed(4)
    (h, W, b, q), (h64, W64, b64, q64) = leaves(torch.randn(2, 5, D), torch.randn(V, D) * 0.5,
                                                torch.randn(V) * 0.1, probs(2, 5, V))
    w = torch.rand(V) + 0.5
    loss = linear_cross_entropy(h, W, q, linear_bias=b, weight=w, reduction=reduction,
                                label_smoothing=0.1)
    ref = F.cross_entropy(F.linear(h64, W64, b64).reshape(-1, V), q64.reshape(-1, V),
                          w.double(), reduction=reduction, label_smoothing=0.1)
    ref = ref.reshape(2, 5) if reduction == "none" else ref
    assert loss.shape == ref.shape
    assert_close(loss, ref)
    g = upstream(ref)
    got = torch.autograd.grad((loss * g.float()).sum(), (h, W, b, q))
    want = torch.autograd.grad((ref * g).sum(), (h64, W64, b64, q64))
    for a, e in zip(got, want):
        assert_close(a, e)


def test_linear_cross_entropy_probabilities_no_bias_grad_in_forward():
    """No bias: the gradients come from the forward's call, scaled in the backward."""
    (h, W), (h64, W64) = leaves(torch.randn(N, D), torch.randn(V, D))
    q = probs(N, V)
    loss = linear_cross_entropy(h, W, q, z_loss=1e-3)
    z = h64 @ W64.T
    ref = F.cross_entropy(z, q.double()) + 1e-3 * (torch.logsumexp(z, -1) ** 2).mean()
    assert_close(loss, ref)
    (3 * loss).backward()
    (3 * ref).backward()
    assert_close(h.grad, h64.grad)
    assert_close(W.grad, W64.grad)


def test_gradcheck_probabilities():
    """gradcheck in float64 (the inputs cast to float32 inside: the library computes in it),
    the input's and the target's gradients."""
    torch.manual_seed(5)
    z = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    q = probs(4, 7).double().requires_grad_()
    w = torch.rand(7) + 0.5
    for reduction in REDUCTIONS:
        def fn(z, q):
            return cross_entropy(z.float(), q.float(), w, reduction=reduction,
                                 label_smoothing=0.1, softcap=5.0)
        assert torch.autograd.gradcheck(fn, (z, q), eps=1e-3, atol=2e-3, rtol=1e-2)
    h = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)

    def lin(h, W, q):
        return linear_cross_entropy(h.float(), W.float(), q.float(), reduction="sum")
    assert torch.autograd.gradcheck(lin, (h, W, q), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_compile_probabilities():
    torch.manual_seed(6)
    z = torch.randn(N, V, requires_grad=True)
    q = probs(N, V).requires_grad_()
    h = torch.randn(N, D, requires_grad=True)
    W = torch.randn(V, D, requires_grad=True)

    def step(z, q, h, W):
        return (cross_entropy(z, q, label_smoothing=0.1)
                + linear_cross_entropy(h, W, q, reduction="none").sum())

    compiled = torch.compile(step, fullgraph=True)
    eager = step(z, q, h, W)
    ge = torch.autograd.grad(eager, (z, q, h, W))
    got = compiled(z, q, h, W)
    gc = torch.autograd.grad(got, (z, q, h, W))
    assert_close(got, eager, 1e-6)
    for a, e in zip(gc, ge):
        assert_close(a, e, 1e-6)


def test_probabilities_refused():
    z, q = torch.randn(4, 5), probs(4, 5)
    for kwargs, name in (({"use_token_scaling": True}, "use_token_scaling"),
                         ({"shift": 1}, "shift"), ({"shift_seq_len": 2}, "shift"),
                         ({"return_token_accuracy": True}, "return_token_accuracy"),
                         ({"check_targets": True}, "check_targets"),
                         ({"ignore_index": 0}, "ignore_index")):
        with pytest.raises(ValueError, match=name):
            cross_entropy(z, q, **kwargs)
        with pytest.raises(ValueError, match=name):
            linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), q, **kwargs)
    with pytest.raises(ValueError, match="must have the shape of the logits"):
        cross_entropy(z, q[:, :4])
    with pytest.raises(TypeError, match="target .class probabilities. has dtype"):
        cross_entropy(z, q.double())
    with pytest.raises(ValueError, match="must have the shape of the logits"):
        linear_cross_entropy(torch.randn(4, 3), torch.randn(6, 3), q)
    with pytest.raises(ValueError, match="inplace_backward"):
        cross_entropy(torch.randn(4, 5, requires_grad=True).clone(), q.clone().requires_grad_(),
                      inplace_backward=True)


def test_inplace_backward_probabilities():
    z = torch.randn(N, V, requires_grad=True)
    q = probs(N, V)
    (want,) = torch.autograd.grad(cross_entropy(z, q, label_smoothing=0.1), z)
    (got,) = torch.autograd.grad(cross_entropy(z.clone(), q, label_smoothing=0.1,
                                               inplace_backward=True), z)
    assert_close(got, want, 1e-6)
