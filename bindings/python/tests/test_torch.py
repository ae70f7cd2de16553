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
from fusedce.torch import (CrossEntropyLoss, LinearCrossEntropyLoss, cross_entropy,  # noqa: E402
                           linear_cross_entropy)

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
def shifted_targets(y, ignore_index, t):
    if not t:
        return y
    yy = torch.full_like(y, ignore_index)
    r = torch.arange(y.shape[0], device=y.device)
    keep = (r % t) != (t - 1)
    yy[keep] = y[r[keep] + 1]
    return yy


def reference(z, y, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=0.0, logit_scale=1.0, shift_seq_len=0):
    """SPEC.md built from torch float64 ops (F.cross_entropy for the CE part)."""
    a = z.double() * logit_scale
    if softcap:
        a = softcap * torch.tanh(a / softcap)
    yy = shifted_targets(y.long(), ignore_index, shift_seq_len)
    w = weight.double() if weight is not None else None
    ce = F.cross_entropy(a, yy, weight=w, ignore_index=ignore_index, reduction="none",
                         label_smoothing=label_smoothing)
    valid = yy != ignore_index
    rows = ce + z_loss * torch.logsumexp(a, 1) ** 2 * valid
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    denom = (w[yy[valid]].sum() if w is not None else valid.sum().double())
    return rows.sum() / denom if denom > 0 else rows.sum() * 0


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
    """gradcheck on float64 inputs: fusedce computes in float32 (the cast is part of autograd),
    so finite differences use a large step and float32-sized tolerances."""
    z, y, w = make(n=6, v=7, std=2.0)
    z = z.double().requires_grad_(True)
    for reduction in REDUCTIONS:
        fn = lambda t: cross_entropy(t, y, w, reduction=reduction, label_smoothing=0.1,  # noqa
                                     z_loss=1e-2, softcap=4.0)
        assert torch.autograd.gradcheck(fn, (z,), eps=1e-3, atol=2e-3, rtol=2e-2)
    h = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    for reduction in REDUCTIONS:
        fn = lambda h, W, b: linear_cross_entropy(h, W, y, linear_bias=b, weight=w,  # noqa
                                                  reduction=reduction, label_smoothing=0.1)
        assert torch.autograd.gradcheck(fn, (h, W, b), eps=1e-3, atol=2e-3, rtol=2e-2)


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
    for red in (0, 1, 2):
        torch.library.opcheck(torch.ops.fusedce.ce_forward.default,
                              (z, y, w, -100, red, 0.1, 1e-3, 0.0, 1.0, 0))
        g = torch.rand(8) if red == 2 else torch.tensor(1.5)
        torch.library.opcheck(torch.ops.fusedce.ce_backward.default,
                              (g, z.detach(), y, torch.randn(8), w, -100, red, 0.1, 1e-3, 0.0,
                               1.0, 0))
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
                                  (h, W, b, y, w, None, -100, red, 0.0, 0.0, 0.0, 1.0, 0, 0,
                                   1 << 30) + need, **({"test_utils": utils} if utils else {}))
    for red in (0, 1):
        torch.library.opcheck(torch.ops.fusedce.ce_forward_grad.default,
                              (z.detach(), y, w, -100, red, 0.1, 1e-3, 0.0, 1.0, 0),
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
    assert rel_err(torch.as_tensor(cupy.asnumpy(r.grad_logits)), tg.cpu()) <= 1e-6
    h_t = torch.as_tensor(cupy.asnumpy(hb)).double().requires_grad_(True)
    W_t = torch.as_tensor(cupy.asnumpy(Wb)).double().requires_grad_(True)
    ref = F.cross_entropy(F.linear(h_t, W_t), y, reduction=reduction)
    assert rel_err(torch.as_tensor(cupy.asnumpy(rl.loss)), ref) <= 1e-5
    gref = torch.autograd.grad(ref, W_t, torch.ones_like(ref))[0]
    assert rel_err(torch.as_tensor(cupy.asnumpy(rl.grad_weight)), gref) <= 1e-5
