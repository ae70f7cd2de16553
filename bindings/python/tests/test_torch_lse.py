"""fusedce.torch: the differentiable lse and entropy outputs (return_lse, return_entropy) of
cross_entropy and linear_cross_entropy, against torch's own definitions in float64
(torch.logsumexp, torch.distributions.Categorical(logits=...).entropy()) on the CPU backend:
values, gradients of functions combining the loss, lse and the entropy (eager, torch.compile,
finite differences), with temperature (logit_scale), softcap and ignored rows."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from fusedce.torch import (CrossEntropyLoss, cross_entropy,  # noqa: E402
                           linear_cross_entropy)

REDUCTIONS = ["mean", "sum", "none"]
# (logit_scale, softcap): plain, a temperature, a softcap, both
TRANSFORMS = {"plain": (1.0, 0.0), "temperature": (1 / 0.7, 0.0), "softcap": (1.0, 5.0),
              "both": (0.8, 4.0)}


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def transform(z, s, c):
    """The scaled, capped logits a = c * tanh(s * z / c) in float64."""
    a = z.double() * s
    return c * torch.tanh(a / c) if c else a


def reference(z, y, reduction, s, c, weight=None):
    """(loss, lse, entropy) from torch's float64 definitions (differentiable in z)."""
    a = transform(z, s, c)
    loss = F.cross_entropy(a, y, reduction=reduction,
                           weight=weight.double() if weight is not None else None)
    return loss, torch.logsumexp(a, -1), torch.distributions.Categorical(logits=a).entropy()


def combine(loss, lse, entropy):
    """A scalar from the three outputs, each with its own upstream gradient."""
    return loss.sum() + 0.1 * lse.pow(2).sum() - 0.01 * entropy.sum() * 3


def make(n=12, v=37, seed=0, std=3.0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen) * std
    y = torch.randint(0, v, (n,), generator=gen)
    y[1] = y[n - 2] = -100  # ignored rows: their lse and entropy terms still flow
    return z, y


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(TRANSFORMS))
def test_values_match_torch_float64(case, reduction):
    s, c = TRANSFORMS[case]
    z, y = make()
    out = cross_entropy(z, y, reduction=reduction, logit_scale=s, softcap=c, return_lse=True,
                        return_entropy=True)
    assert out._fields == ("loss", "lse", "entropy")
    loss, lse, ent = reference(z, y, reduction, s, c)
    assert out.lse.dtype == out.entropy.dtype == torch.float32
    assert out.lse.shape == out.entropy.shape == (12,)
    assert rel_err(out.loss, loss) <= 1e-5
    assert rel_err(out.lse, lse) <= 1e-5
    assert (out.entropy.double() - ent).abs().max() <= 1e-5 * ent.abs().max()
    assert bool((out.entropy >= 0).all())
    # without a gradient (no_grad, or input not requiring one): the same values
    with torch.no_grad():
        ev = cross_entropy(z, y, reduction=reduction, logit_scale=s, softcap=c,
                           return_entropy=True)
    assert ev._fields == ("loss", "entropy") and torch.equal(ev.entropy, out.entropy)


def _ce_grad(z, y, reduction, s, c, compiled=False, weight=None):
    x = z.clone().requires_grad_(True)

    def f(x):
        o = cross_entropy(x, y, weight, reduction=reduction, logit_scale=s, softcap=c,
                          return_lse=True, return_entropy=True)
        return combine(o.loss, o.lse, o.entropy)

    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    value = fn(x)
    (g,) = torch.autograd.grad(value, x)
    return value.detach(), g


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["plain", "both"])
def test_cross_entropy_gradient_vs_float64(case, reduction, compiled):
    """loss + 0.1 * sum lse^2 - 0.03 * sum entropy: value and gradient against the float64
    reference, eager and under torch.compile (aot_eager, fullgraph)."""
    torch._dynamo.reset()
    s, c = TRANSFORMS[case]
    z, y = make()
    w = torch.rand(37, generator=torch.Generator().manual_seed(3)) + 0.5
    value, g = _ce_grad(z, y, reduction, s, c, compiled, weight=w)
    zr = z.double().requires_grad_(True)
    rvalue = combine(*reference(zr, y, reduction, s, c, weight=w))
    (rg,) = torch.autograd.grad(rvalue, zr)
    assert rel_err(value, rvalue) <= 1e-5
    assert rel_err(g, rg) <= 1e-5
    # ignored rows: no loss term, but lse's and the entropy's gradients
    assert bool((g[1] != 0).any())


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_compiled_matches_eager(reduction):
    torch._dynamo.reset()
    s, c = TRANSFORMS["both"]
    z, y = make(seed=4)
    ve, ge = _ce_grad(z, y, reduction, s, c, compiled=False)
    vc, gc = _ce_grad(z, y, reduction, s, c, compiled=True)
    assert rel_err(vc, ve) <= 1e-6 and rel_err(gc, ge) <= 1e-6


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("which", ["lse", "entropy", "loss"])
def test_each_output_alone(which, reduction):
    """A gradient from one output alone (the others get none): lse alone takes fce_backward
    with grad_lse, the entropy fce_forward, the loss its usual path."""
    s, c = TRANSFORMS["softcap"]
    z, y = make(seed=2)
    x = z.clone().requires_grad_(True)
    o = cross_entropy(x, y, reduction=reduction, logit_scale=s, softcap=c, return_lse=True,
                      return_entropy=True)
    getattr(o, which).sum().backward()
    zr = z.double().requires_grad_(True)
    loss, lse, ent = reference(zr, y, reduction, s, c)
    dict(loss=loss, lse=lse, entropy=ent)[which].sum().backward()
    assert rel_err(x.grad, zr.grad) <= 1e-5
    if which == "loss":  # the fast path: the same gradient as without the extra outputs
        x2 = z.clone().requires_grad_(True)
        cross_entropy(x2, y, reduction=reduction, logit_scale=s, softcap=c).sum().backward()
        assert torch.equal(x.grad, x2.grad)


def _gradcheck_f32(fn, *inputs, eps=1e-2, atol=2e-3, rtol=1e-2):
    """torch.autograd.gradcheck of ``fn`` over float32 inputs: the function computes in float32
    (the library's dtypes), the check differentiates in float64 around it (central differences
    with a step suited to float32)."""
    def wrapped(*xs):
        out = fn(*(x.float() for x in xs))
        return out.double()
    xs = [t.double().requires_grad_(True) for t in inputs]
    return torch.autograd.gradcheck(wrapped, xs, eps=eps, atol=atol, rtol=rtol)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck_cross_entropy(reduction):
    s, c = TRANSFORMS["both"]
    z, y = make(n=5, v=7, std=1.0, seed=5)
    y[1] = -100

    def f(x):
        o = cross_entropy(x, y, reduction=reduction, logit_scale=s, softcap=c, return_lse=True,
                          return_entropy=True)
        return combine(o.loss, o.lse, o.entropy)

    assert _gradcheck_f32(f, z)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck_linear_cross_entropy(reduction):
    gen = torch.Generator().manual_seed(6)
    h, W, b = torch.randn(5, 4, generator=gen), torch.randn(7, 4, generator=gen) / 2, \
        torch.randn(7, generator=gen)
    y = torch.randint(0, 7, (5,), generator=gen)
    y[2] = -100

    def f(h, W, b):
        o = linear_cross_entropy(h, W, y, linear_bias=b, reduction=reduction, softcap=4.0,
                                 logit_scale=1.2, return_lse=True, return_entropy=True)
        return combine(o.loss, o.lse, o.entropy)

    assert _gradcheck_f32(f, h, W, b)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradient_vs_float64(bias, reduction, compiled):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(2, 6, 16, generator=gen)
    W = torch.randn(53, 16, generator=gen) / 4
    b = torch.randn(53, generator=gen) if bias else None
    y = torch.randint(0, 53, (2, 6), generator=gen)
    y[0, :2] = -100
    s, c = TRANSFORMS["both"]
    ps = [t.clone().requires_grad_(True) for t in (h, W) + ((b,) if bias else ())]

    def f(*ps):
        o = linear_cross_entropy(ps[0], ps[1], y, linear_bias=ps[2] if bias else None,
                                 reduction=reduction, logit_scale=s, softcap=c,
                                 return_lse=True, return_entropy=True)
        assert o.lse.shape == o.entropy.shape == (2, 6)
        return combine(o.loss, o.lse, o.entropy)

    fn = torch.compile(f, backend="aot_eager") if compiled else f
    value = fn(*ps)
    grads = torch.autograd.grad(value, ps)
    rs = [t.double().clone().requires_grad_(True) for t in (h, W) + ((b,) if bias else ())]
    zr = F.linear(rs[0], rs[1], rs[2] if bias else None).reshape(-1, 53)
    rvalue = combine(*reference(zr, y.reshape(-1), reduction, s, c))
    rgrads = torch.autograd.grad(rvalue, rs)
    assert rel_err(value, rvalue) <= 1e-5
    for a, r in zip(grads, rgrads):
        assert rel_err(a, r) <= 1e-5


@pytest.mark.parametrize("which", ["lse", "entropy"])
def test_linear_frozen_weight_and_one_output(which):
    """Only hidden requires grad, only lse (or the entropy) gets a gradient, reduction mean:
    the recompute with grad_output 0 and grad_lse (grad_entropy)."""
    gen = torch.Generator().manual_seed(8)
    h, W = torch.randn(9, 8, generator=gen), torch.randn(21, 8, generator=gen)
    y = torch.randint(0, 21, (9,), generator=gen)
    x = h.clone().requires_grad_(True)
    o = linear_cross_entropy(x, W, y, return_lse=True, return_entropy=True)
    getattr(o, which).pow(2).sum().backward()
    xr = h.double().requires_grad_(True)
    _, lse, ent = reference(xr @ W.double().T, y, "mean", 1.0, 0.0)
    dict(lse=lse, entropy=ent)[which].pow(2).sum().backward()
    assert rel_err(x.grad, xr.grad) <= 1e-5


def test_z_loss_from_returned_lse():
    """CCE's z-loss built by the caller from the returned lse backpropagates (here against the
    library's own z_loss option, which adds lambda * lse^2 per non-ignored row to the mean)."""
    z, y = make(seed=9)
    lam = 1e-2
    x = z.clone().requires_grad_(True)
    loss, lse = cross_entropy(x, y, return_lse=True)
    valid = y != -100
    (loss + lam * (lse[valid] ** 2).mean()).backward()
    x2 = z.clone().requires_grad_(True)
    cross_entropy(x2, y, z_loss=lam).backward()
    assert rel_err(x.grad, x2.grad) <= 1e-5


def test_second_backward_and_retain_graph():
    z, y = make(seed=10)
    x = z.clone().requires_grad_(True)
    o = cross_entropy(x, y, return_lse=True, return_entropy=True)
    v = combine(o.loss, o.lse, o.entropy)
    (g1,) = torch.autograd.grad(v, x, retain_graph=True)
    (g2,) = torch.autograd.grad(v, x)
    assert torch.equal(g1, g2)


def test_inplace_backward_refuses_lse_gradient():
    z, y = make(seed=11)
    x = z.clone().requires_grad_(True)
    o = cross_entropy(x * 1.0, y, return_lse=True, inplace_backward=True)
    o.loss.backward(retain_graph=True)  # the loss alone: fine
    x.grad = None
    o = cross_entropy(x * 1.0, y, return_lse=True, inplace_backward=True)
    with pytest.raises(RuntimeError, match="inplace_backward"):
        (o.loss + o.lse.sum()).backward()


def test_module_and_shapes():
    z4 = torch.randn(2, 9, 3, 4)
    y4 = torch.randint(0, 9, (2, 3, 4))
    m = CrossEntropyLoss(reduction="none", return_entropy=True)
    assert "return_entropy=True" in repr(m)
    loss, ent = m(z4.requires_grad_(True), y4)
    assert loss.shape == ent.shape == (2, 3, 4)
    ref = torch.distributions.Categorical(logits=z4.detach().double().movedim(1, -1)).entropy()
    assert rel_err(ent, ref) <= 1e-5
    ent.sum().backward()
    zr = z4.detach().double().requires_grad_(True)
    torch.distributions.Categorical(logits=zr.movedim(1, -1)).entropy().sum().backward()
    assert rel_err(z4.grad, zr.grad) <= 1e-5
