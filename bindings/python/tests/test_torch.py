"""fusedce.torch: autograd, torch.compile, modules and autocast on the CPU backend (whenever torch
is installed), and on CUDA (torch, CuPy, DLPack, streams, CUDA graphs) when a device is there.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_torch.py

Every test skips with its reason where torch, CUDA or CuPy is missing.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: fusedce.torch is optional")
import torch.nn.functional as F  # noqa: E402

import fusedce  # noqa: E402
from fusedce.torch import (CrossEntropyLoss, LinearCrossEntropyLoss,  # noqa: E402
                           cross_entropy, linear_cross_entropy)
from torch_cases import (  # noqa: E402
    linear_inputs,
    check_empty_batch, _compile_check, _compile_extras_check, loss_and_grad, make,
    needs_cuda, OPTIONS, REDUCTIONS, reference, rel_err, resolve)


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


def test_empty_batch_cpu():
    check_empty_batch("cpu")


@needs_cuda
def test_empty_batch_cuda():
    check_empty_batch("cuda")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_cross_entropy_cpu(reduction, bias):
    h, W, b, y, w = linear_inputs(1, bias)
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
    with pytest.raises(ValueError, match="target of class probabilities must have the shape"):
        cross_entropy(z, torch.rand(4, 6))
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


def test_torch_compile_fullgraph_cpu():
    _compile_check("cpu")


def test_torch_compile_extras_cpu():
    _compile_extras_check("cpu")
