"""fusedce.torch's outputs beyond the loss (z-loss, accuracy, predicted tokens), the shift and
target checks, adversarial rows, and the CUDA paths (streams, graphs, CuPy, DLPack, autocast).

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_torch_extras.py

Every test skips with its reason where torch, CUDA or CuPy is missing.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: fusedce.torch is optional")
import torch.nn.functional as F  # noqa: E402

import fusedce  # noqa: E402
from fusedce import core  # noqa: E402
from fusedce.torch import OUTPUT_FIELDS, CrossEntropyLoss, cross_entropy, linear_cross_entropy  # noqa: E402
from torch_cases import (  # noqa: E402
    linear_inputs,
    adversarial_check, ALL_EXTRAS, check_extras, _compile_check, _compile_extras_check, HAS_CUDA,
    loss_and_grad, make, needs_cuda, NEW_OPTIONS, OPTIONS, REDUCTIONS, reference, rel_err, resolve)

try:
    import cupy
except Exception:
    cupy = None
needs_cupy = pytest.mark.skipif(cupy is None or not HAS_CUDA, reason="CuPy or CUDA missing")


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
    h, W, b, y, w = linear_inputs(5, bias)
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
