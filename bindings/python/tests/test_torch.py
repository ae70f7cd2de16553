"""fusedce.torch: autograd, torch.compile, modules and autocast on the CPU backend (whenever torch
is installed), and on CUDA (torch, CuPy, DLPack, streams, CUDA graphs) when a device is there.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_torch.py

Every test skips with its reason where torch, CUDA or CuPy is missing.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: fusedce.torch is optional")
import torch.nn.functional as F  # noqa: E402

import fusedce  # noqa: E402
from fusedce import core  # noqa: E402
from fusedce.torch import (OUTPUT_FIELDS, CrossEntropyLoss, LinearCrossEntropyLoss,  # noqa: E402
                           cross_entropy, linear_cross_entropy)

HAS_CUDA = torch.cuda.is_available() and fusedce.cuda_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device, or libfusedce was built without the CUDA backend")
try:
    import cupy
except Exception:
    cupy = None
needs_cupy = pytest.mark.skipif(cupy is None or not HAS_CUDA, reason="CuPy or CUDA missing")

REDUCTIONS = ["mean", "sum", "none"]


# ---------------------------------------------------------------- float64 reference ----
def shifted_targets(y, ignore_index, t, k=0):
    """docs/semantics.md rule 1: row b*T+t against target b*T+t+k (k = 0 meaning 1), the last k
    positions of each sequence ignored."""
    if not t:
        return y
    k = max(k, 1)
    yy = torch.full_like(y, ignore_index)
    r = torch.arange(y.shape[0], device=y.device)
    keep = (r % t) < (t - k)
    yy[keep] = y[r[keep] + k]
    return yy


def reference(z, y, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=0.0, logit_scale=1.0, shift_seq_len=0, shift=0,
              use_token_scaling=False, extras=False):
    """docs/semantics.md built from torch float64 ops (F.cross_entropy for the CE part;
    Liger's token scaling: each row times its detached p_y; the mean's z-loss over the number
    of non-ignored rows). With extras=True: (loss, dict of z_loss, token_accuracy,
    predicted_tokens, lse, entropy), the extra outputs as fusedce.torch returns them."""
    a = z.double() * logit_scale
    if softcap:
        a = softcap * torch.tanh(a / softcap)
    yy = shifted_targets(y.reshape(-1).long(), ignore_index, shift_seq_len, shift)
    w = weight.double() if weight is not None else None
    ce = F.cross_entropy(a, yy, weight=w, ignore_index=ignore_index, reduction="none",
                         label_smoothing=label_smoothing)
    valid = yy != ignore_index
    lse = torch.logsumexp(a, 1)
    zl = z_loss * lse ** 2 * valid
    if use_token_scaling:
        p_y = torch.exp(a.gather(1, yy.clamp_min(0)[:, None])[:, 0] - lse).detach()
        p_y = torch.where(valid, p_y, torch.ones_like(p_y))
        ce, zl = ce * p_y, zl * p_y
    if reduction == "none":
        loss, z_total = ce + zl, zl
    elif reduction == "sum":
        loss, z_total = (ce + zl).sum(), zl.sum()
    else:
        denom = (w[yy[valid]].sum() if w is not None else valid.sum().double())
        count = valid.sum().double()
        loss = ((ce.sum() / denom if denom > 0 else ce.sum() * 0)
                + (zl.sum() / count if count > 0 else zl.sum() * 0))
        z_total = zl.sum() / count if count > 0 else zl.sum() * 0
    if not extras:
        return loss
    # argmax of the logits as the library forms them (float32), lowest index among equals
    a32 = z.float() * logit_scale
    if softcap:
        a32 = softcap * torch.tanh(a32 / softcap)
    pred = torch.where(valid, torch.argmax(a32, 1), torch.full_like(yy, -1))
    right = (valid & (pred == yy)).double()
    acc = right if reduction == "none" else (
        right.sum() / valid.sum() if valid.any() else right.sum() * 0)
    entropy = torch.distributions.Categorical(logits=a).entropy()
    return loss, dict(z_loss=z_total.detach(), token_accuracy=acc, predicted_tokens=pred,
                      lse=lse.detach(), entropy=entropy.detach())


def loss_and_grad(fn, z, *args, upstream=None, **kwargs):
    z = z.detach().clone().requires_grad_(True)
    loss = fn(z, *args, **kwargs)
    if upstream is None:
        upstream = torch.ones_like(loss)
    (g,) = torch.autograd.grad(loss, z, upstream.to(loss.dtype))
    return loss.detach(), g


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


OPTIONS = {
    "plain": {},
    "weight": {"weight": "w"},
    "ignore_index=3": {"ignore_index": 3},
    "label_smoothing": {"label_smoothing": 0.1},
    "smoothing+weight": {"label_smoothing": 0.2, "weight": "w"},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 12.0},
    "logit_scale": {"logit_scale": 0.5},
    "shift": {"shift_seq_len": 5},
    "everything": {"weight": "w", "label_smoothing": 0.1, "z_loss": 1e-4, "softcap": 20.0,
                   "logit_scale": 1.3, "shift_seq_len": 4, "ignore_index": 2},
}


def make(n=40, v=101, std=3.0, device="cpu", dtype=torch.float32, seed=0, ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=gen) * std).to(device=device, dtype=dtype)
    y = torch.randint(0, v, (n,), generator=gen)
    y[1::7] = ignore_index
    w = (torch.rand(v, generator=gen) + 0.3)
    return z, y.to(device), w.to(device)


def resolve(opts, w):
    return {k: (w if val == "w" else val) for k, val in opts.items()}


# ======================================================================== CPU ====
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(OPTIONS))
def test_cross_entropy_cpu_against_float64(case, reduction):
    z, y, w = make(ignore_index=OPTIONS[case].get("ignore_index", -100))
    opts = resolve(OPTIONS[case], w)
    up = torch.rand(z.shape[0]) + 0.5 if reduction == "none" else torch.tensor(0.7)
    loss, g = loss_and_grad(cross_entropy, z, y, reduction=reduction, upstream=up, **opts)
    rloss, rg = loss_and_grad(reference, z.double(), y, reduction=reduction,
                              upstream=up.double(), **opts)
    assert loss.dtype == torch.float32 and g.dtype == torch.float32
    assert rel_err(loss, rloss) <= 1e-5
    assert rel_err(g, rg) <= 1e-5


def test_torch_keywords_match_functional_cpu():
    z, y, w = make()
    for kw in ({}, {"weight": w}, {"ignore_index": 5}, {"label_smoothing": 0.3},
               {"weight": w, "label_smoothing": 0.1, "reduction": "sum"}):
        yk = torch.where(y == -100, kw.get("ignore_index", -100), y)
        a = cross_entropy(z, yk, **kw)
        b = F.cross_entropy(z.double(), yk, **{k: (v.double() if torch.is_tensor(v) else v)
                                               for k, v in kw.items()})
        assert rel_err(a, b) <= 1e-5, kw


def test_input_shapes_like_torch():
    z, y, w = make(n=6, v=9)
    # (C,) with a scalar target
    assert rel_err(cross_entropy(z[0], y[0].clone().fill_(3)),
                   F.cross_entropy(z[0].double(), torch.tensor(3))) <= 1e-5
    # (N, C, d1, d2)
    z4 = torch.randn(2, 9, 3, 4)
    y4 = torch.randint(0, 9, (2, 3, 4))
    for reduction in REDUCTIONS:
        a = cross_entropy(z4, y4, reduction=reduction)
        b = F.cross_entropy(z4.double(), y4, reduction=reduction)
        assert a.shape == b.shape and rel_err(a, b) <= 1e-5
    # padded logits: a row stride larger than C, used without a copy
    big = torch.randn(6, 16)
    assert rel_err(cross_entropy(big[:, :9], y.clamp_min(0)),
                   F.cross_entropy(big[:, :9].double(), y.clamp_min(0))) <= 1e-5


def test_gradcheck_float64_inputs_cpu():
    """gradcheck on float64 inputs cast to float32 by the caller (fusedce computes in float32 and
    refuses float64 itself: the cast is part of autograd), so finite differences use a large
    step and float32-sized tolerances."""
    z, y, w = make(n=6, v=7, std=2.0)
    z = z.double().requires_grad_(True)
    for reduction in REDUCTIONS:
        fn = lambda t: cross_entropy(t.float(), y, w, reduction=reduction,  # noqa: E731
                                     label_smoothing=0.1, z_loss=1e-2, softcap=4.0)
        assert torch.autograd.gradcheck(fn, (z,), eps=1e-3, atol=2e-3, rtol=2e-2)
    h = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    for reduction in REDUCTIONS:
        fn = lambda h, W, b: linear_cross_entropy(  # noqa: E731
            h.float(), W.float(), y, linear_bias=b.float(), weight=w, reduction=reduction,
            label_smoothing=0.1)
        assert torch.autograd.gradcheck(fn, (h, W, b), eps=1e-3, atol=2e-3, rtol=2e-2)


def test_float64_is_refused_clearly_cpu():
    """float64 is no dtype of the library: torch would compute in it, fusedce cannot, and it
    casts nothing behind the caller's back (under autocast too, which leaves float64 alone). The
    message names the function and the argument and says how to cast; NumPy's says the same."""
    z, y, w = make(n=6, v=7)
    h, W, b = torch.randn(6, 5), torch.randn(7, 5), torch.randn(7)
    msg = (" dtype float64 is not supported; supported: float32, float16, bfloat16 "
           "(cast with .float())")
    cases = [
        ("fusedce.torch.cross_entropy: input", lambda: cross_entropy(z.double(), y)),
        ("fusedce.torch.cross_entropy: input", lambda: CrossEntropyLoss()(z.double(), y)),
        ("fusedce.torch.linear_cross_entropy: input",
         lambda: linear_cross_entropy(h.double(), W.double(), y)),
        ("fusedce.torch.linear_cross_entropy: linear_weight",
         lambda: linear_cross_entropy(h, W.double(), y)),
        ("fusedce.torch.linear_cross_entropy: linear_bias",
         lambda: linear_cross_entropy(h, W, y, linear_bias=b.double())),
    ]
    for where, call in cases:
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value) == where + msg
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="linear_cross_entropy: input dtype float64"):
            linear_cross_entropy(h.double(), W, y)
    with pytest.raises(TypeError) as e:
        fusedce.forward(z.double(), y)
    assert str(e.value) == "fusedce.forward: logits" + msg


def test_option_errors_name_the_call_cpu():
    """An option the workspace query (made first) finds wrong is reported under the C call the
    function runs, never the query's name."""
    z, y, w = make(n=6, v=7)
    for kw in ({}, {"reduction": "none"}):
        x = z.clone().requires_grad_(True)
        for t in (z, x):
            with pytest.raises(fusedce.InvalidArgumentError) as e:
                cross_entropy(t, y, label_smoothing=1.5, **kw)
            assert e.value.message.startswith("fce_forward: options->label_smoothing (1.5)")
    with pytest.raises(fusedce.InvalidArgumentError) as e:
        linear_cross_entropy(torch.randn(6, 5), torch.randn(7, 5), y, label_smoothing=1.5)
    assert e.value.message.startswith("fce_linear_ce: options->label_smoothing (1.5)")


def check_empty_batch(device):
    """Zero rows (docs/semantics.md "Zero rows"): the losses of an empty batch, 0 for mean and
    sum (torch: NaN for the mean, 0 for the sum) and empty for none, and the backward through
    every path: an empty logits gradient, zero linear weight and bias gradients."""
    v, d = 11, 5
    for reduction in REDUCTIONS:
        for kw in ({}, {"inplace_backward": True}, {"return_lse": True, "return_z_loss": True,
                                                     "return_token_accuracy": True,
                                                     "return_predicted_tokens": True}):
            if kw.get("inplace_backward") and reduction == "none":
                continue
            z = torch.randn(0, v, device=device, requires_grad=True)
            y = torch.zeros(0, dtype=torch.int64, device=device)
            out = cross_entropy(z, y, reduction=reduction, label_smoothing=0.1, z_loss=1e-3, **kw)
            loss = out.loss if isinstance(out, tuple) else out
            assert loss.dtype == torch.float32
            assert loss.shape == ((0,) if reduction == "none" else ())
            if reduction != "none":
                assert loss.item() == 0.0
            if isinstance(out, tuple):
                assert out.lse.shape == (0,) and out.predicted_tokens.shape == (0,)
                if reduction != "none":
                    assert out.z_loss.item() == 0.0 and out.token_accuracy.item() == 0.0
            (g,) = torch.autograd.grad(loss.sum(), z)
            assert g.shape == (0, v)
        h = torch.randn(0, d, device=device, requires_grad=True)
        W = torch.randn(v, d, device=device, requires_grad=True)
        b = torch.randn(v, device=device, requires_grad=True)
        y = torch.zeros(0, dtype=torch.int64, device=device)
        loss = linear_cross_entropy(h, W, y, linear_bias=b, reduction=reduction)
        gh, gw, gb = torch.autograd.grad(loss.sum(), (h, W, b))
        assert gh.shape == (0, d) and torch.all(gw == 0) and torch.all(gb == 0)
        if reduction != "none":
            assert loss.item() == 0.0
        with torch.no_grad():
            assert cross_entropy(z.detach(), y, reduction=reduction).numel() == (
                0 if reduction == "none" else 1)


def test_empty_batch_cpu():
    check_empty_batch("cpu")


@needs_cuda
def test_empty_batch_cuda():
    check_empty_batch("cuda")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_cross_entropy_cpu(reduction, bias):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(3, 8, 16, generator=gen)
    W = torch.randn(53, 16, generator=gen) / 4
    b = torch.randn(53, generator=gen) if bias else None
    y = torch.randint(0, 53, (3, 8), generator=gen)
    y[0, :3] = -100
    w = torch.rand(53, generator=gen) + 0.5
    kw = dict(weight=w, label_smoothing=0.1, z_loss=1e-3, shift_seq_len=8)
    ps = [t.clone().requires_grad_(True) for t in (h, W) + ((b,) if bias else ())]
    loss = linear_cross_entropy(ps[0], ps[1], y, linear_bias=ps[2] if bias else None,
                                reduction=reduction, **kw)
    rs = [t.double().clone().requires_grad_(True) for t in (h, W) + ((b,) if bias else ())]
    z = F.linear(rs[0], rs[1], rs[2] if bias else None).reshape(-1, 53)
    ref = reference(z, y.reshape(-1), reduction=reduction, **kw)
    if reduction == "none":
        ref = ref.reshape(3, 8)
    assert loss.shape == ref.shape and loss.dtype == torch.float32
    assert rel_err(loss, ref) <= 1e-5
    up = torch.rand_like(loss) + 0.5
    grads = torch.autograd.grad(loss, ps, up)
    rgrads = torch.autograd.grad(ref, rs, up.double())
    for a, r in zip(grads, rgrads):
        assert a.dtype == torch.float32 and rel_err(a, r) <= 1e-5


def test_linear_cross_entropy_frozen_weight_and_no_grad():
    h = torch.randn(10, 8, requires_grad=True)
    W = torch.randn(30, 8)  # frozen
    y = torch.randint(0, 30, (10,))
    loss = linear_cross_entropy(h, W, y)
    (gh,) = torch.autograd.grad(loss, h)
    (rgh,) = torch.autograd.grad(F.cross_entropy(F.linear(h.double(), W.double()), y),
                                 h)
    assert rel_err(gh, rgh) <= 1e-5
    with torch.no_grad():
        l2 = linear_cross_entropy(h, W, y)
    assert not l2.requires_grad and rel_err(l2, loss.detach()) == 0


def test_mean_over_ignored_rows_is_zero():
    z, y, _ = make(n=4, v=5)
    y[:] = -100
    loss, g = loss_and_grad(cross_entropy, z, y)
    assert loss.item() == 0.0 and torch.all(g == 0)  # torch would give NaN


def test_modules():
    z, y, w = make()
    m = CrossEntropyLoss(weight=w, label_smoothing=0.1, z_loss=1e-3)
    assert rel_err(m(z, y), cross_entropy(z, y, w, label_smoothing=0.1, z_loss=1e-3)) == 0
    assert "z_loss=0.001" in repr(m)
    h, W = torch.randn(40, 8), torch.randn(101, 8)
    lm = LinearCrossEntropyLoss(reduction="sum", softcap=5.0)
    assert rel_err(lm(h, W, y), linear_cross_entropy(h, W, y, reduction="sum",
                                                     softcap=5.0)) == 0
    with pytest.raises(ValueError, match="reduction"):
        CrossEntropyLoss(reduction="avg")


def test_errors():
    z, y, w = make(n=4, v=5)
    with pytest.raises(TypeError, match="class-index"):
        cross_entropy(z, torch.rand(4, 5))
    with pytest.raises(ValueError, match="target has 3 elements"):
        cross_entropy(z, y[:3])
    with pytest.raises(ValueError, match="weight must have shape"):
        cross_entropy(z, y, torch.ones(4))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(z, y, reduction="avg")
    with pytest.raises(TypeError, match="must match outside autocast"):
        linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3, dtype=torch.float16), y)
    with pytest.raises(ValueError, match="linear_weight must be"):
        linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 4), y)
    with pytest.raises(fusedce.InvalidArgumentError, match="label_smoothing"):
        cross_entropy(z, y, label_smoothing=1.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_cpu(dtype):
    z, y, w = make(dtype=dtype, std=10.0)
    loss, g = loss_and_grad(cross_entropy, z, y, w, label_smoothing=0.1)
    rloss, rg = loss_and_grad(reference, z.double(), y, w, label_smoothing=0.1)
    assert g.dtype == dtype and loss.dtype == torch.float32
    assert rel_err(loss, rloss) <= 1e-5
    assert rel_err(g, rg) <= {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]


def test_autocast_bf16_cpu():
    h = torch.randn(16, 32, requires_grad=True)
    W = torch.randn(64, 32, requires_grad=True)
    y = torch.randint(0, 64, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, W, y)
        logits = h @ W.t()
        loss2 = cross_entropy(logits, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    gh, gW = torch.autograd.grad(loss, (h, W))
    assert gh.dtype == torch.float32 and gW.dtype == torch.float32
    hb, Wb = h.detach().bfloat16().double(), W.detach().bfloat16().double()
    ref = F.cross_entropy(hb @ Wb.t(), y)
    assert rel_err(loss, ref) <= 1e-4
    assert rel_err(loss2, F.cross_entropy(logits.detach().double(), y)) <= 1e-5
    hr, Wr = hb.clone().requires_grad_(True), Wb.clone().requires_grad_(True)
    rgh, rgW = torch.autograd.grad(F.cross_entropy(hr @ Wr.t(), y), (hr, Wr))
    assert rel_err(gh, rgh) <= 2 ** -7 and rel_err(gW, rgW) <= 1e-4  # gW is float32 directly


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", ["plain", "everything"])
def test_inplace_backward_cpu(case, reduction):
    """inplace_backward=True: the same gradient as float64, written over the logits' storage."""
    z, y, w = make(ignore_index=OPTIONS[case].get("ignore_index", -100))
    opts = resolve(OPTIONS[case], w)
    x = z.clone().requires_grad_(True)
    loss = cross_entropy(x, y, reduction=reduction, inplace_backward=True, **opts)
    loss.backward(torch.tensor(0.7))
    rloss, rg = loss_and_grad(reference, z.double(), y, reduction=reduction,
                              upstream=torch.tensor(0.7, dtype=torch.float64), **opts)
    assert rel_err(loss.detach(), rloss) <= 1e-5
    assert rel_err(x.grad, rg) <= 1e-5
    # the logits' own storage now holds the gradient (autograd then copies it into .grad of a
    # leaf; a non-leaf's producer receives the buffer itself)
    assert torch.equal(x.detach(), x.grad)


def test_second_backward():
    """A second backward through the same graph: cross_entropy recomputes (right values);
    with inplace_backward=True it raises a clear error; linear_cross_entropy recomputes."""
    z, y, w = make()
    for up1, up2 in ((1.0, 1.0), (0.5, 0.75), (0.3, 2.0)):
        x = z.clone().requires_grad_(True)
        loss = cross_entropy(x, y, label_smoothing=0.1)
        loss.backward(torch.tensor(up1), retain_graph=True)
        loss.backward(torch.tensor(up2))
        _, rg = loss_and_grad(reference, z.double(), y, reduction="mean", label_smoothing=0.1,
                              upstream=torch.tensor(up1 + up2, dtype=torch.float64))
        assert rel_err(x.grad, rg) <= 1e-5
    x = z.clone().requires_grad_(True)
    loss = cross_entropy(x, y, inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="handed to autograd once"):
        loss.backward()
    h = torch.randn(40, 16, requires_grad=True)
    W = torch.randn(101, 16, requires_grad=True)
    loss = linear_cross_entropy(h, W, y, reduction="sum")
    loss.backward(torch.tensor(0.5), retain_graph=True)
    g1 = (h.grad.clone(), W.grad.clone())
    loss.backward(torch.tensor(2.0))
    assert rel_err(h.grad, g1[0] * 5) <= 1e-5 and rel_err(W.grad, g1[1] * 5) <= 1e-5


def test_no_grad_computes_loss_only():
    z, y, w = make()
    x = z.clone().requires_grad_(True)
    with torch.no_grad():
        loss = cross_entropy(x, y)
    assert loss.grad_fn is None and rel_err(loss, F.cross_entropy(z.double(), y)) <= 1e-5


def test_workspace_budget_cpu():
    """Any workspace budget gives the loss and gradients of float64 (the budget only chooses
    the plan); FUSEDCE_WORKSPACE_BYTES is read when no budget is given."""
    import os
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(64, 16, generator=gen)
    W = torch.randn(301, 16, generator=gen) / 2
    y = torch.randint(0, 301, (64,), generator=gen)
    ref = [None]
    for budget in (None, 0, 1 << 20, 1 << 30, "env"):
        hh, WW = h.clone().requires_grad_(True), W.clone().requires_grad_(True)
        if budget == "env":
            os.environ["FUSEDCE_WORKSPACE_BYTES"] = "2M"
            try:
                loss = linear_cross_entropy(hh, WW, y)
            finally:
                del os.environ["FUSEDCE_WORKSPACE_BYTES"]
        else:
            loss = linear_cross_entropy(hh, WW, y, workspace_bytes=budget)
        loss.backward()
        r = F.cross_entropy(F.linear(h.double(), W.double()), y)
        assert rel_err(loss.detach(), r) <= 1e-5
        if ref[0] is None:
            ref[0] = (hh.grad, WW.grad)
        assert rel_err(hh.grad, ref[0][0]) <= 1e-5 and rel_err(WW.grad, ref[0][1]) <= 1e-5
    with pytest.raises(ValueError):
        linear_cross_entropy(h, W, y, workspace_bytes=-1)


def test_opcheck_custom_ops():
    z, y, w = make(n=8, v=11)
    z.requires_grad_(True)
    # the options after class_weights: ignore_index, reduction, label_smoothing, z_loss, softcap,
    # logit_scale, shift_seq_len, shift, token_scaling, batch_invariant; then extras (bitmask),
    # check_targets
    every = 7  # z_loss | accuracy | argmax
    cases = [(0, 0, False, 0), (0, 0, False, every), (4, 2, True, every), (0, 0, False, 16)]
    for red in (0, 1, 2):
        for t, k, scaling, extras in cases:
            torch.library.opcheck(torch.ops.fusedce.ce_forward.default,
                                  (z, y, w, -100, red, 0.1, 1e-3, 0.0, 1.0, t, k, scaling,
                                   False, extras, False))
        g = torch.rand(8) if red == 2 else torch.tensor(1.5)
        torch.library.opcheck(torch.ops.fusedce.ce_backward.default,
                              (g, z.detach(), y, torch.randn(8), w, -100, red, 0.1, 1e-3, 0.0,
                               1.0, 0, 0, False, False))
    h = torch.randn(8, 6, requires_grad=True)
    W = torch.randn(11, 6, requires_grad=True)
    b = torch.randn(11, requires_grad=True)
    # The gradients linear_ce (mean/sum) and ce_forward_grad return are scaled IN PLACE by their
    # backward (no second [V, D] or [N, V] buffer): opcheck's AOT test returns those outputs to
    # the caller too and rejects a backward that mutates them. What users run is the loss
    # alone, which test_torch_compile_fullgraph_* compiles (fullgraph) and differentiates.
    in_place_outputs = ("test_schema", "test_autograd_registration", "test_faketensor")
    for red in (0, 2):
        for need in ((True, True, True), (False, False, False)):
            utils = in_place_outputs if red == 0 and need[0] else None
            torch.library.opcheck(torch.ops.fusedce.linear_ce.default,
                                  (h, W, b, y, w, None, None, None, -100, red, 0.0, 0.0, 0.0,
                                   1.0, 0, 0, False, False, 0, 1 << 30) + need
                                  + (every | 16, False),
                                  **({"test_utils": utils} if utils else {}))
    for red in (0, 1):
        torch.library.opcheck(torch.ops.fusedce.ce_forward_grad.default,
                              (z.detach(), y, w, -100, red, 0.1, 1e-3, 0.0, 1.0, 0, 0, False,
                               False, every, False),
                              test_utils=in_place_outputs)
    torch.library.opcheck(torch.ops.fusedce.scale_.default, (torch.randn(8, 11), torch.tensor(1.5)))


def _compile_check(device):
    torch._dynamo.reset()
    z, y, w = make(device=device)
    h = torch.randn(40, 16, device=device)
    W = torch.randn(101, 16, device=device)

    def step(z, h, W):
        a = cross_entropy(z * 1.0, y, w, label_smoothing=0.1, z_loss=1e-4)
        b = linear_cross_entropy(h, W, y, reduction="sum", softcap=10.0)
        c = linear_cross_entropy(h, W, y, reduction="none").sum()
        return a + b / 40 + c / 40

    compiled = torch.compile(step, fullgraph=True)
    outs = []
    for fn in (step, compiled):
        zz, hh, WW = (t.clone().requires_grad_(True) for t in (z, h, W))
        loss = fn(zz, hh, WW)
        grads = torch.autograd.grad(loss, (zz, hh, WW))
        outs.append((loss.detach(),) + grads)
    for a, b in zip(*outs):
        assert rel_err(a, b) <= 1e-5


def test_torch_compile_fullgraph_cpu():
    _compile_check("cpu")


def _compile_extras_check(device):
    """The 0.3 keywords under torch.compile(fullgraph=True): the same outputs and gradients as
    eager, and check_targets raising from inside the compiled graph."""
    from torch.utils._pytree import tree_leaves
    torch._dynamo.reset()
    z, y, w = make(device=device)
    h = torch.randn(40, 16, device=device)
    W = torch.randn(101, 16, device=device)

    def step(z, h, W):
        a = cross_entropy(z * 1.0, y, w, z_loss=1e-3, shift_seq_len=8, shift=3,
                          use_token_scaling=True, **ALL_EXTRAS)
        b = linear_cross_entropy(h, W, y, reduction="none", z_loss=1e-3, shift=2,
                                 use_token_scaling=True, **ALL_EXTRAS)
        c = cross_entropy(z * 1.0, y, reduction="none", return_lse=True,
                          return_predicted_tokens=True)
        with torch.no_grad():
            d = cross_entropy(z, y, return_token_accuracy=True)
        return a.loss + b.loss.sum() / 40 + c.loss.sum() / 40, (a, b, c, d)

    compiled = torch.compile(step, fullgraph=True)
    outs = []
    for fn in (step, compiled):
        zz, hh, WW = (t.clone().requires_grad_(True) for t in (z, h, W))
        loss, extras = fn(zz, hh, WW)
        grads = torch.autograd.grad(loss, (zz, hh, WW))
        outs.append([loss.detach(), *tree_leaves(extras), *grads])
        assert type(extras[0]).__name__ == "CrossEntropyOutput"
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_err(a.detach(), b.detach()) <= 1e-5
    bad = y.clone()
    bad[5] = 400
    for requires_grad in (False, True):
        f = torch.compile(lambda t: cross_entropy(t, bad, check_targets=True), fullgraph=True)
        with pytest.raises(IndexError, match="Target 400 is out of bounds."):
            f(z.clone().requires_grad_(requires_grad))


def test_torch_compile_extras_cpu():
    _compile_extras_check("cpu")


# ============================================== 0.3: extras, token scaling, shift k ====
NEW_OPTIONS = {
    "z_loss+weight": {"z_loss": 1e-3, "weight": "w"},  # the mean's z-loss over the row count
    "token_scaling": {"use_token_scaling": True},
    "token_scaling+z_loss+weight+smoothing": {"use_token_scaling": True, "z_loss": 1e-3,
                                              "weight": "w", "label_smoothing": 0.1},
    "shift=2": {"shift_seq_len": 5, "shift": 2},
    "everything-0.3": {"weight": "w", "label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 20.0,
                       "logit_scale": -1.3, "shift_seq_len": 8, "shift": 3, "ignore_index": 2,
                       "use_token_scaling": True},
}
ALL_EXTRAS = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
                  return_lse=True, return_entropy=True)


def check_extras(out, ref_extras, reduction, shape=None):
    """Every extra of a CrossEntropyOutput against the float64 reference's (lse and the entropy
    may carry a gradient, the others never)."""
    assert out.predicted_tokens.dtype == torch.int64
    assert all(getattr(out, f).dtype == torch.float32
               for f in ("z_loss", "token_accuracy", "lse", "entropy"))
    for f in ("z_loss", "token_accuracy", "predicted_tokens", "lse", "entropy"):
        t = getattr(out, f)
        if f in ("lse", "entropy"):
            t = t.detach()
        assert not t.requires_grad and t.grad_fn is None, f
        r = ref_extras[f]
        if shape is not None and (f in ("predicted_tokens", "lse", "entropy")
                                  or reduction == "none"):
            r = r.reshape(shape)
        assert t.shape == r.shape, (f, t.shape, r.shape)
        if f == "predicted_tokens":
            assert torch.equal(t.cpu(), r.cpu()), f
        else:
            assert rel_err(t.cpu(), r.cpu()) <= 1e-5, (f, rel_err(t.cpu(), r.cpu()))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(NEW_OPTIONS))
def test_new_keywords_cpu_against_float64(case, reduction):
    """loss, gradient and every extra output against the float64 torch reference, through the
    eager one-pass path (mean/sum), the 'none' path, the no-grad path and inplace_backward."""
    z, y, w = make(ignore_index=NEW_OPTIONS[case].get("ignore_index", -100))
    opts = resolve(NEW_OPTIONS[case], w)
    up = torch.rand(z.shape[0]) + 0.5 if reduction == "none" else torch.tensor(0.7)
    x = z.clone().requires_grad_(True)
    out = cross_entropy(x, y, reduction=reduction, **ALL_EXTRAS, **opts)
    assert type(out).__name__ == "CrossEntropyOutput" and out._fields == OUTPUT_FIELDS
    (g,) = torch.autograd.grad(out.loss, x, up)
    xr = z.double().requires_grad_(True)
    rloss, rex = reference(xr, y, reduction=reduction, extras=True, **opts)
    (rg,) = torch.autograd.grad(rloss, xr, up.double())
    assert rel_err(out.loss.detach(), rloss) <= 1e-5
    assert rel_err(g, rg) <= 1e-5
    check_extras(out, rex, reduction)
    # evaluation (no grad): the same values
    with torch.no_grad():
        ev = cross_entropy(z, y, reduction=reduction, **ALL_EXTRAS, **opts)
    for a, b in zip(ev, out):
        assert rel_err(a, b.detach()) <= 1e-6
    if reduction != "none":  # the gradient over the logits: the same extras, the same gradient
        xi = z.clone().requires_grad_(True)
        oi = cross_entropy(xi, y, reduction=reduction, inplace_backward=True, **ALL_EXTRAS,
                           **opts)
        for a, b in zip(oi, out):
            assert rel_err(a.detach(), b.detach()) <= 1e-6
        oi.loss.backward(up)
        assert rel_err(xi.grad, rg) <= 1e-5


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_new_keywords_cpu(reduction, bias):
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(3, 8, 16, generator=gen)
    W = torch.randn(53, 16, generator=gen) / 4
    b = torch.randn(53, generator=gen) if bias else None
    y = torch.randint(0, 53, (3, 8), generator=gen)
    y[0, :3] = -100
    w = torch.rand(53, generator=gen) + 0.5
    kw = dict(weight=w, label_smoothing=0.1, z_loss=1e-3, softcap=9.0, shift=2,
              use_token_scaling=True)  # shift alone: T = target.shape[-1] = 8
    ps = [t.clone().requires_grad_(True) for t in (h, W) + ((b,) if bias else ())]
    out = linear_cross_entropy(ps[0], ps[1], y, linear_bias=ps[2] if bias else None,
                               reduction=reduction, **ALL_EXTRAS, **kw)
    rs = [t.double().clone().requires_grad_(True) for t in (h, W) + ((b,) if bias else ())]
    zr = F.linear(rs[0], rs[1], rs[2] if bias else None).reshape(-1, 53)
    kw.pop("shift")
    rloss, rex = reference(zr, y.reshape(-1), reduction=reduction, shift_seq_len=8, shift=2,
                           extras=True, **kw)
    if reduction == "none":
        rloss = rloss.reshape(3, 8)
    assert out.loss.shape == rloss.shape and rel_err(out.loss.detach(), rloss) <= 1e-5
    check_extras(out, rex, reduction, shape=(3, 8))
    up = torch.rand_like(out.loss) + 0.5
    grads = torch.autograd.grad(out.loss, ps, up)
    rgrads = torch.autograd.grad(rloss, rs, up.double())
    for a, r in zip(grads, rgrads):
        assert rel_err(a, r) <= 1e-5


def test_return_convention():
    """No return_* flag: the loss tensor. Otherwise the CrossEntropyOutput named tuple of the
    loss and the outputs asked for, in the order (loss, z_loss, token_accuracy,
    predicted_tokens, lse, entropy): CCE's (loss, lse) and Liger's (loss, z_loss, token_accuracy,
    predicted_tokens) unpack as they do there."""
    z, y, w = make(n=12, v=9)
    assert torch.is_tensor(cross_entropy(z, y))
    loss, lse = cross_entropy(z, y, return_lse=True)
    assert lse.shape == (12,) and torch.equal(loss, cross_entropy(z, y))
    loss, z_loss, acc, pred = cross_entropy(z, y, z_loss=1e-2, return_z_loss=True,
                                            return_token_accuracy=True,
                                            return_predicted_tokens=True)
    assert z_loss.shape == () and acc.shape == () and pred.shape == (12,)
    o = cross_entropy(z, y, return_predicted_tokens=True, return_z_loss=True)
    assert o._fields == ("loss", "z_loss", "predicted_tokens")
    assert OUTPUT_FIELDS == ("loss", "z_loss", "token_accuracy", "predicted_tokens", "lse",
                             "entropy")
    # shapes follow the 'none' loss: (N, C, d1, d2) input, (C,) input
    z4, y4 = torch.randn(2, 9, 3, 4), torch.randint(0, 9, (2, 3, 4))
    for reduction in REDUCTIONS:
        o = cross_entropy(z4, y4, reduction=reduction, z_loss=1e-2, **ALL_EXTRAS)
        per_row = (2, 3, 4)
        assert o.predicted_tokens.shape == per_row and o.lse.shape == per_row
        scalar = () if reduction != "none" else per_row
        assert o.loss.shape == scalar and o.z_loss.shape == scalar
        assert o.token_accuracy.shape == scalar
        a = z4.movedim(1, -1).double()
        assert torch.equal(o.predicted_tokens, a.argmax(-1))
        assert rel_err(o.lse, torch.logsumexp(a, -1)) <= 1e-6
    o = cross_entropy(z[0], y[0].clone().fill_(3), **ALL_EXTRAS)
    assert all(t.shape == () for t in o)
    # modules carry the flags
    m = CrossEntropyLoss(return_lse=True, shift=1)
    assert "return_lse=True" in repr(m) and "shift=1" in repr(m)
    assert len(m(z, y)) == 2


def test_shift_spellings():
    """shift_seq_len=T alone (k = 1), shift=k alone (T = target.shape[-1], CCE's), both; all
    equal to slicing the logits and targets by hand."""
    b, t, v = 3, 7, 11
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(b * t, v, generator=gen)
    y = torch.randint(0, v, (b, t), generator=gen)
    y[0, 4] = -100
    for k in (1, 2, 6):
        zs = z.view(b, t, v)[:, :t - k].reshape(-1, v)
        ys = y[:, k:].reshape(-1)
        ref = F.cross_entropy(zs.double(), ys)
        spellings = [dict(shift=k), dict(shift_seq_len=t, shift=k)]
        if k == 1:
            spellings += [dict(shift_seq_len=t), dict(shift=True)]
        for kw in spellings:
            target = y if "shift_seq_len" not in kw else y.reshape(-1)
            assert rel_err(cross_entropy(z, target, **kw), ref) <= 1e-5, kw
            none = cross_entropy(z, target, reduction="none", **kw)
            # the 'none' loss keeps every position, the last k of each sequence 0; CCE's is
            # none[..., :-k]
            assert none.shape == target.shape
            rows = none.reshape(b, t)
            assert torch.all(rows[:, t - k:] == 0)
            assert rel_err(rows[:, :t - k].reshape(-1),
                           F.cross_entropy(zs.double(), ys, reduction="none")) <= 1e-5
        h = torch.randn(b, t, 5, generator=gen)
        W = torch.randn(v, 5, generator=gen)
        lin = F.cross_entropy(F.linear(h.double(), W.double())[:, :t - k].reshape(-1, v), ys)
        assert rel_err(linear_cross_entropy(h, W, y, shift=k), lin) <= 1e-5
    with pytest.raises(ValueError, match=r"shift must be in \[0, 7\)"):
        cross_entropy(z, y, shift=7)
    # negative values and rows that are no whole number of sequences: the library's message
    with pytest.raises(fusedce.InvalidArgumentError, match=r"options->shift \(-1\) must be >= 0"):
        cross_entropy(z, y, shift=-1)
    with pytest.raises(fusedce.InvalidArgumentError,
                       match=r"rows \(\d+\) is not a multiple of options->shift_seq_len \(5\)"):
        cross_entropy(z, y.reshape(-1), shift_seq_len=5)
    with pytest.raises(fusedce.InvalidArgumentError, match=r"options->shift_seq_len \(-2\)"):
        linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3),
                             torch.zeros(4, dtype=torch.long), shift_seq_len=-2)


def test_check_targets():
    """check_targets=True raises as torch does (IndexError "Target X is out of bounds."), naming
    the target the row is scored against (after the shift); by default: NaN, no error."""
    z, y, w = make(n=12, v=9)
    bad = y.clone()
    bad[5] = 40
    with pytest.raises(IndexError) as torch_error:
        F.cross_entropy(z, bad)
    for fn in (lambda **kw: cross_entropy(z, bad, **kw),
               lambda **kw: cross_entropy(z.clone().requires_grad_(True), bad, **kw),
               lambda **kw: cross_entropy(z.clone().requires_grad_(True), bad,
                                          reduction="none", **kw),
               lambda **kw: linear_cross_entropy(torch.randn(12, 4), torch.randn(9, 4), bad,
                                                 **kw)):
        assert torch.isnan(fn()).any()  # default: NaN, no sync
        with pytest.raises(IndexError) as e:
            fn(check_targets=True)
        assert str(e.value) == str(torch_error.value) == "Target 40 is out of bounds."
    bad[5] = -3
    with pytest.raises(IndexError, match="Target -3 is out of bounds."):
        cross_entropy(z, bad, check_targets=True)
    # with a shift, the last position of a sequence is never read
    y2 = y.clone()
    y2[0] = 99  # read by no row when shift=1 and T = 6
    cross_entropy(z, y2, shift_seq_len=6, check_targets=True)
    y2[1] = 77
    with pytest.raises(IndexError, match="Target 77 is out of bounds."):
        cross_entropy(z, y2, shift_seq_len=6, check_targets=True)
    cross_entropy(z, y, check_targets=True)  # fine


def test_extras_buffers_are_per_call():
    """The cached fce_options of an option set carry the argmax / accuracy pointers of one call
    only: a later call without them must not write into an earlier call's outputs."""
    z, y, w = make(n=16, v=13)
    first = cross_entropy(z, y, return_predicted_tokens=True, return_token_accuracy=True)
    kept = [t.clone() for t in first]
    z2, y2, _ = make(n=16, v=13, seed=5)
    for grad in (False, True):
        cross_entropy(z2.clone().requires_grad_(grad), y2)  # the same option set, no extras
        h = torch.randn(16, 4)
        linear_cross_entropy(h, torch.randn(13, 4), y2)
    for a, b in zip(first, kept):
        assert torch.equal(a, b)


def test_gradcheck_shift_and_z_loss_cpu():
    """gradcheck (finite differences, float64 inputs cast to float32) through shift=k and
    the z-loss, every reduction (token scaling is left out: its p_y is a constant on purpose)."""
    z, y, w = make(n=6, v=7, std=2.0)
    z = z.double().requires_grad_(True)
    for reduction in REDUCTIONS:
        fn = lambda t: cross_entropy(t.float(), y, w, reduction=reduction,  # noqa: E731
                                     z_loss=1e-2, shift_seq_len=3, shift=2, label_smoothing=0.1)
        assert torch.autograd.gradcheck(fn, (z,), eps=1e-3, atol=2e-3, rtol=2e-2)
    h = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    for reduction in REDUCTIONS:
        fn = lambda h, W: linear_cross_entropy(h.float(), W.float(), y.view(2, 3),  # noqa
                                               reduction=reduction, z_loss=1e-2, shift=1)
        assert torch.autograd.gradcheck(fn, (h, W), eps=1e-3, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_adversarial_rows_cpu(dtype, reduction):
    adversarial_check("cpu", dtype, reduction)


def adversarial_rows(dtype, device):
    """Logits no float32 lse can round-trip: rows sharing a huge offset (the largest magnitude
    of the dtype), -inf entries, a -inf target logit (loss +inf), a 1e4 spread, a NaN row, and
    rows holding a +inf (elsewhere, at the target: NaN loss and gradient, as torch's)."""
    big = {torch.float32: 1e30, torch.bfloat16: 3e38, torch.float16: 6e4}[dtype]
    v = 37
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(12, v, generator=gen, dtype=torch.float64)
    y = torch.randint(0, v, (12,), generator=gen)
    z[0] = -big
    z[1] = big
    z[2] = -big
    z[2, 5] = -big * (1 - 2 ** -7)  # a huge offset and a spread of a few ulps
    z[3, [1, 4, 9]] = -float("inf")
    z[4] = z[4] * 1e4 if dtype != torch.float16 else z[4] * 1e3
    z[5, y[5]] = -float("inf")  # loss +inf
    z[6, 0] = z[6, 0] + 80.0
    z[7] = big * (torch.rand(v, generator=gen, dtype=torch.float64) - 0.5) / 4
    z[8, 3] = float("nan")
    y[3] = 2
    z[10, (y[10] + 1) % v] = float("inf")
    z[11, y[11]] = float("inf")
    z[11, (y[11] + 5) % v] = -float("inf")
    return z.to(dtype).to(device), y.to(device)


def torch_lse(z):
    """The lse fusedce writes: torch.logsumexp's, but NaN on a row holding a +inf, where
    torch.logsumexp gives +inf and log_softmax NaN (docs/semantics.md rule 10)."""
    lse = torch.logsumexp(z, 1)
    return torch.where(torch.isposinf(z).any(1), torch.full_like(lse, float("nan")), lse)


def adversarial_check(device, dtype, reduction):
    z, y = adversarial_rows(dtype, device)
    up = (torch.rand(z.shape[0], device=device) + 0.5 if reduction == "none"
          else torch.tensor(0.75, device=device))
    for kw in ({}, {"return_lse": True}):
        x = z.clone().requires_grad_(True)
        out = cross_entropy(x, y, reduction=reduction, **kw)
        loss = out.loss if kw else out
        (g,) = torch.autograd.grad(loss, x, up)
        xr = z.double().requires_grad_(True)
        rloss = F.cross_entropy(xr, y, reduction=reduction)
        (rg,) = torch.autograd.grad(rloss, xr, up.double())
        assert_matches_with_nonfinite(loss.detach(), rloss.detach(), 1e-5, "loss")
        tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
        assert_matches_with_nonfinite(g, rg, tol, "grad")
        if kw:
            assert_matches_with_nonfinite(out.lse, torch_lse(z.double()), 1e-6, "lse")


def assert_matches_with_nonfinite(x, ref, tol, what):
    """NaN and ±inf exactly where the reference has them, elsewhere within tol * max|ref|."""
    x, ref = x.double().cpu(), ref.double().cpu()
    assert torch.equal(torch.isnan(x), torch.isnan(ref)), what
    inf = torch.isinf(ref)
    assert torch.equal(x[inf], ref[inf]) and not torch.isinf(x[~inf]).any(), what
    fin = torch.isfinite(ref)
    if fin.any():
        scale = ref[fin].abs().max().clamp_min(1e-30)
        err = ((x[fin] - ref[fin]).abs() / scale).max().item()
        assert err <= tol, f"{what}: {err:.3e} > {tol:.1e}"


# ======================================================================= CUDA ====
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "smoothing+weight", "everything"])
def test_cuda_matches_cpu_backend_and_float64(case, dtype):
    z, y, w = make(n=256, v=3001, std=10.0, dtype=dtype,
                   ignore_index=OPTIONS[case].get("ignore_index", -100))
    opts = resolve(OPTIONS[case], w)
    for reduction in REDUCTIONS:
        up = (torch.rand(z.shape[0]) + 0.5) if reduction == "none" else torch.tensor(0.7)
        lc, gc = loss_and_grad(cross_entropy, z.cuda(), y.cuda(), reduction=reduction,
                               upstream=up.cuda(), **resolve(OPTIONS[case], w.cuda()))
        lh, gh = loss_and_grad(cross_entropy, z, y, reduction=reduction, upstream=up, **opts)
        rl, rg = loss_and_grad(reference, z.double(), y, reduction=reduction,
                               upstream=up.double(), **opts)
        tol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        assert rel_err(lc.cpu(), rl) <= 1e-5
        assert rel_err(gc.cpu(), rg) <= tol
        assert rel_err(lc.cpu(), lh) <= 1e-5


@needs_cuda
def test_cuda_linear_cross_entropy_autocast_bf16():
    h = torch.randn(512, 256, device="cuda", requires_grad=True)
    W = (torch.randn(4099, 256, device="cuda") / 16).requires_grad_(True)
    b = torch.randn(4099, device="cuda", requires_grad=True)
    y = torch.randint(0, 4099, (512,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, W, y, linear_bias=b, label_smoothing=0.1)
    grads = torch.autograd.grad(loss, (h, W, b))
    assert all(g.dtype == torch.float32 for g in grads)
    hb, Wb, bb = (t.detach().bfloat16().double().requires_grad_(True) for t in (h, W, b))
    ref = F.cross_entropy(F.linear(hb, Wb, bb), y, label_smoothing=0.1)
    rgrads = torch.autograd.grad(ref, (hb, Wb, bb))
    assert rel_err(loss, ref) <= 1e-4
    for g, r in zip(grads, rgrads):
        assert rel_err(g, r) <= 2 ** -6


@needs_cuda
def test_cuda_current_stream_and_graph_capture():
    """The op runs on torch.cuda.current_stream(): inside CUDA-graph capture on a side stream a
    launch on any other stream would fail the capture."""
    z, y, w = make(n=128, v=2048, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up (allocator, cuBLASLt handle) on the capture stream
            cross_entropy(z, y, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = cross_entropy(z, y, w, label_smoothing=0.1)
    z2, _, _ = make(n=128, v=2048, device="cuda", seed=7)
    z.copy_(z2)
    graph.replay()
    torch.cuda.synchronize()
    eager = cross_entropy(z2, y, w, label_smoothing=0.1)
    assert rel_err(static_loss, eager) == 0
    # a side stream: results equal the default-stream ones
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side, gside = loss_and_grad(cross_entropy, z2, y, w)
    torch.cuda.current_stream().wait_stream(s)
    main, gmain = loss_and_grad(cross_entropy, z2, y, w)
    assert rel_err(side, main) == 0 and rel_err(gside, gmain) == 0


@needs_cuda
def test_torch_compile_fullgraph_cuda():
    _compile_check("cuda")


@needs_cuda
def test_core_with_torch_cuda_and_dlpack():
    z, y, w = make(n=64, v=999, device="cuda")
    r = core.forward(z, y, return_grad=True, return_lse=True, class_weights=w)
    assert r.loss.is_cuda and r.grad_logits.dtype == z.dtype
    rl, rg = loss_and_grad(reference, z.double(), y, w)
    assert rel_err(r.loss, rl) <= 1e-5 and rel_err(r.grad_logits, rg) <= 1e-5

    class DLPackOnly:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    loss = torch.empty((), device="cuda")
    core.forward(DLPackOnly(z), DLPackOnly(y), loss=DLPackOnly(loss),
                 class_weights=DLPackOnly(w), workspace=torch.empty(1 << 20, dtype=torch.uint8,
                                                                    device="cuda"),
                 stream=torch.cuda.current_stream().cuda_stream, error_flags=False)
    torch.cuda.synchronize()
    assert rel_err(loss, rl) <= 1e-5
    with pytest.raises(TypeError, match="must be passed"):
        core.forward(DLPackOnly(z), DLPackOnly(y))


@needs_cupy
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cupy_parity(reduction):
    z, y, w = make(n=100, v=5003, std=8.0)
    zc, yc, wc = cupy.asarray(z.numpy()), cupy.asarray(y.numpy()), cupy.asarray(w.numpy())
    cupy.cuda.Device().synchronize()  # the copies above ran on the null stream
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        r = core.forward(zc, yc, reduction=reduction, class_weights=wc, label_smoothing=0.1,
                         return_grad=True, return_lse=True)
        hb = cupy.asarray(np.random.default_rng(0).standard_normal((100, 64)), cupy.float32)
        Wb = cupy.asarray(np.random.default_rng(1).standard_normal((5003, 64)) / 8, cupy.float32)
        rl = core.linear_ce(hb, Wb, yc, reduction=reduction, return_grad=True)
    s.synchronize()
    assert isinstance(r.loss, cupy.ndarray) and isinstance(r.grad_logits, cupy.ndarray)
    up = torch.ones(100) if reduction == "none" else torch.tensor(1.0)
    tl, tg = loss_and_grad(cross_entropy, z.cuda(), y.cuda(), w.cuda(), reduction=reduction,
                           label_smoothing=0.1, upstream=up.cuda())
    assert rel_err(torch.as_tensor(cupy.asnumpy(r.loss)), tl.cpu()) <= 1e-6
    # (reduction 'none': the torch layer's gradient comes from fce_backward and the saved
    # float32 lse, the core's from fce_forward's one pass: equal to the rounding of lse)
    assert rel_err(torch.as_tensor(cupy.asnumpy(r.grad_logits)), tg.cpu()) <= (
        1e-5 if reduction == "none" else 1e-6)
    h_t = torch.as_tensor(cupy.asnumpy(hb)).double().requires_grad_(True)
    W_t = torch.as_tensor(cupy.asnumpy(Wb)).double().requires_grad_(True)
    ref = F.cross_entropy(F.linear(h_t, W_t), y, reduction=reduction)
    assert rel_err(torch.as_tensor(cupy.asnumpy(rl.loss)), ref) <= 1e-5
    gref = torch.autograd.grad(ref, W_t, torch.ones_like(ref))[0]
    assert rel_err(torch.as_tensor(cupy.asnumpy(rl.grad_weight)), gref) <= 1e-5


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_adversarial_rows_cuda(dtype, reduction):
    adversarial_check("cuda", dtype, reduction)


@needs_cuda
def test_torch_compile_extras_cuda():
    _compile_extras_check("cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", list(NEW_OPTIONS))
def test_cuda_new_keywords_against_float64(case, dtype):
    """The 0.3 keywords on the CUDA backend: loss, gradient and extras against the float64
    reference (float32: 1e-5; bfloat16: the gradient within its rounding), the predicted
    tokens equal to the CPU backend's."""
    z, y, w = make(n=240, v=3001, std=6.0, dtype=dtype,  # 240 rows: sequences of 5 and 8
                   ignore_index=NEW_OPTIONS[case].get("ignore_index", -100))
    for reduction in REDUCTIONS:
        up = (torch.rand(z.shape[0]) + 0.5) if reduction == "none" else torch.tensor(0.7)
        x = z.cuda().requires_grad_(True)
        out = cross_entropy(x, y.cuda(), reduction=reduction, **ALL_EXTRAS,
                            **resolve(NEW_OPTIONS[case], w.cuda()))
        (g,) = torch.autograd.grad(out.loss, x, up.cuda())
        opts = resolve(NEW_OPTIONS[case], w)
        xr = z.double().requires_grad_(True)
        rloss, rex = reference(xr, y, reduction=reduction, extras=True, **opts)
        (rg,) = torch.autograd.grad(rloss, xr, up.double())
        assert rel_err(out.loss.detach().cpu(), rloss) <= 1e-5
        tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}[dtype]
        assert rel_err(g.cpu(), rg) <= tol
        host = cross_entropy(z, y, reduction=reduction, **ALL_EXTRAS, **opts)
        assert torch.equal(out.predicted_tokens.cpu(), host.predicted_tokens)
        if dtype == torch.float32:
            check_extras(out, rex, reduction)


def test_package_layout():
    """fusedce.torch is a package, fusedce.torch.distributed a module of it (no sys.modules
    alias); the options and outputs cross a custom op by name, through one pair of functions."""
    import os
    import sys

    import fusedce.torch.distributed as d
    from fusedce._options import N_OP_ARGS, OP_ARG_NAMES, CEOptions, Want
    assert fusedce.torch.__file__.endswith(os.path.join("torch", "__init__.py"))
    assert d.__file__.endswith(os.path.join("torch", "distributed.py"))
    assert sys.modules["fusedce.torch.distributed"] is d is fusedce.torch.distributed
    opts = CEOptions(reduction=2, ignore_index=7, label_smoothing=0.25, z_loss=1e-3, softcap=3.0,
                     logit_scale=0.5, shift_seq_len=4, shift=2, token_scaling=True)
    args = opts.as_op_args()
    assert len(args) == N_OP_ARGS
    assert dict(zip(OP_ARG_NAMES, args))["label_smoothing"] == 0.25
    assert CEOptions.from_op_args(*args) == opts and hash(CEOptions()) == hash(CEOptions())
    assert isinstance(CEOptions(ignore_index=True).ignore_index, int)
    for bits in range(32):
        assert Want.from_op_arg(bits).as_op_arg() == bits
    w = Want(z_loss=True, lse=True)
    assert w.fields() == ("z_loss", "lse") and not Want()
    assert w.from_library(2) == Want(lse=True)
    assert w.from_library(0) == Want(z_loss=True, lse=True)
