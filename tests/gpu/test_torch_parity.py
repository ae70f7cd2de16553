"""fusedce.torch on CUDA against torch eager, both measured against a float64 reference.

For every option torch's cross-entropy has (weight, ignore_index, reduction, label_smoothing),
float32/float16/bfloat16 inputs and logits of standard deviation 1 to 30:
  * fusedce is at least as close to float64 as torch computing the same thing in the same dtype
    (loss and gradient, normwise relative errors): err(fusedce) <= max(1.05 * err(torch), floor),
    where floor is docs/semantics.md's 1e-5 for float32 outputs and the error of merely rounding to the
    dtype for 16-bit gradients (ties at the rounding level count as ties);
  * float32: relative error <= 1e-5 (docs/semantics.md);
  * never NaN or inf where the reference is finite.
The same for linear_cross_entropy against F.cross_entropy(F.linear(h, W, b).float(), y).
Version 0.3's keywords (z_loss with its mean over the non-ignored rows, use_token_scaling, CCE's
shift, the return_* outputs) against the eager code a Liger / CCE user writes for the same thing
(Liger's z-loss and token scaling, slicing for the shift), in the same dtype and in float64; and
adversarial rows (the dtype's largest magnitudes, -inf entries and targets, NaN) against float64.

    make test-gpu        (or: PYTHONPATH=bindings/python FUSEDCE_LIBRARY=build/libfusedce.so \
                              python -m pytest -q tests/gpu/test_torch_parity.py)
Skips without CUDA.
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the torch parity tests run on a GPU machine (make test-gpu)",
                allow_module_level=True)

_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python")
if os.path.isdir(_PY) and _PY not in sys.path:
    sys.path.insert(0, os.path.abspath(_PY))

import torch.nn.functional as F  # noqa: E402

import fusedce  # noqa: E402

if not fusedce.cuda_available():
    pytest.skip("libfusedce was built without the CUDA backend (or sees no device)",
                allow_module_level=True)

from fusedce.torch import cross_entropy, linear_cross_entropy  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Below these errors fusedce passes whatever torch does: docs/semantics.md's float32 bound (1e-5) for
# float32 outputs (fusedce's losses are float32 for every input dtype), and the error of merely
# rounding to the dtype (half an ulp, relative) for 16-bit gradients.
LOSS_FLOOR = 1e-5
GRAD_FLOOR = {torch.float32: 1e-5, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
REDUCTIONS = ["mean", "sum", "none"]
OPTIONS = {
    "default": {},
    "weight": {"weight": True},
    "ignore_index=7": {"ignore_index": 7},
    "label_smoothing": {"label_smoothing": 0.1},
    "weight+smoothing+ignore": {"weight": True, "label_smoothing": 0.2, "ignore_index": 7},
}


def rel(x, ref):
    """Normwise relative error of x against the float64 reference."""
    x, ref = x.double(), ref.double()
    if ref.dim() == 0:
        return (abs(x - ref) / ref.abs().clamp_min(1e-300)).item()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_finite_where_reference_is(x, ref, what):
    bad = torch.isfinite(ref) & ~torch.isfinite(x.double())
    assert not bad.any(), f"{what}: {int(bad.sum())} NaN/inf values where the reference is finite"


def assert_as_close(ours, theirs, ref, floor, what, f32_bound=None):
    assert_finite_where_reference_is(ours, ref, what)
    e_ours, e_theirs = rel(ours, ref), rel(theirs, ref)
    assert e_ours <= max(1.05 * e_theirs, floor), (
        f"{what}: fusedce error {e_ours:.3e} > torch error {e_theirs:.3e} (floor {floor:.1e})")
    if f32_bound is not None:
        assert e_ours <= f32_bound, f"{what}: float32 error {e_ours:.3e} > {f32_bound}"


def inputs(n, v, std, dtype, ignore_index, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = (torch.randn(n, v, device="cuda", generator=g) * std).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[3::11] = ignore_index  # (with ignore_index=7 there is no -100: torch would reject it)
    return z, y, class_weights(v, g)


def class_weights(v, g):
    """Float32 class weights exactly representable in float16 and bfloat16 (torch wants them in
    the logits' dtype, fusedce in float32: the same values for both)."""
    return torch.randint(2, 17, (v,), device="cuda", generator=g).float() / 8


def grad_of(fn, x, up, *args, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    loss = fn(x, *args, **kwargs)
    (g,) = torch.autograd.grad(loss, x, up.to(loss.dtype))
    return loss.detach(), g


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("std", [1.0, 8.0, 30.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cross_entropy_parity(dtype, std, case, reduction):
    opt = OPTIONS[case]
    ignore_index = opt.get("ignore_index", -100)
    n, v = 257, 32003
    z, y, w = inputs(n, v, std, dtype, ignore_index, seed=int(std) * 31 + len(case))
    kw = dict(ignore_index=ignore_index, reduction=reduction,
              label_smoothing=opt.get("label_smoothing", 0.0))
    weight = w if opt.get("weight") else None
    up = (torch.rand(n, device="cuda") + 0.5) if reduction == "none" else torch.tensor(
        0.75, device="cuda")

    ref_loss, ref_grad = grad_of(F.cross_entropy, z.double(), up.double(), y,
                                 weight.double() if weight is not None else None, **kw)
    t_loss, t_grad = grad_of(F.cross_entropy, z, up, y,
                             weight.to(dtype) if weight is not None else None, **kw)
    f_loss, f_grad = grad_of(cross_entropy, z, up, y, weight, **kw)

    assert f_loss.dtype == torch.float32 and f_grad.dtype == dtype
    f32 = 1e-5 if dtype == torch.float32 else None
    assert_as_close(f_loss, t_loss, ref_loss, LOSS_FLOOR, "loss", f32)
    assert_as_close(f_grad, t_grad, ref_grad, GRAD_FLOOR[dtype], "grad", f32)


LINEAR_OPTIONS = {
    "default": {},
    "weight+ignore": {"weight": True, "ignore_index": 7},
    "label_smoothing": {"label_smoothing": 0.1},
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(LINEAR_OPTIONS))
@pytest.mark.parametrize("std", [1.0, 30.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_linear_cross_entropy_parity(dtype, std, case, reduction):
    opt = LINEAR_OPTIONS[case]
    ignore_index = opt.get("ignore_index", -100)
    n, d, v = 1024, 512, 32003
    g = torch.Generator(device="cuda").manual_seed(int(std) + len(case))
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    # logits of standard deviation ~std
    W = (torch.randn(v, d, device="cuda", generator=g) * (std / d ** 0.5)).to(dtype)
    b = (torch.randn(v, device="cuda", generator=g) * 0.1).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[3::11] = ignore_index
    weight = class_weights(v, g) if opt.get("weight") else None
    kw = dict(ignore_index=ignore_index, reduction=reduction,
              label_smoothing=opt.get("label_smoothing", 0.0))
    up = (torch.rand(n, device="cuda") + 0.5) if reduction == "none" else torch.tensor(
        0.75, device="cuda")

    def run(fn, cast):
        ps = [t.detach().clone().to(cast).requires_grad_(True) for t in (h, W, b)]
        loss = fn(*ps)
        grads = torch.autograd.grad(loss, ps, up.to(loss.dtype))
        return loss.detach(), grads

    ref_loss, ref_grads = run(lambda h_, W_, b_: F.cross_entropy(
        F.linear(h_, W_, b_), y, weight.double() if weight is not None else None, **kw),
        torch.float64)
    t_loss, t_grads = run(lambda h_, W_, b_: F.cross_entropy(
        F.linear(h_, W_, b_).float(), y, weight, **kw), dtype)
    f_loss, f_grads = run(lambda h_, W_, b_: linear_cross_entropy(
        h_, W_, y, linear_bias=b_, weight=weight, **kw), dtype)

    assert f_loss.dtype == torch.float32
    f32 = 1e-5 if dtype == torch.float32 else None
    assert_as_close(f_loss, t_loss, ref_loss, LOSS_FLOOR, "loss", f32)
    for name, fg, tg, rg in zip(("grad_hidden", "grad_weight", "grad_bias"), f_grads, t_grads,
                                ref_grads):
        assert fg.dtype == dtype, name
        assert_as_close(fg, tg, rg, GRAD_FLOOR[dtype], name, f32)


# ===================================== version 0.3: the keywords Liger's and CCE's users use ====
# The torch side is what a user writes in eager mode for the same thing (Liger's test reference:
# F.cross_entropy plus lambda * logsumexp^2, the token scaling by the detached p_y, the shift by
# slicing), run once in the inputs' dtype ("torch") and once in float64 (the reference).
def liger_style(z, y, weight, ignore_index, reduction, label_smoothing, z_loss, scaling):
    """loss, z_loss (the logged part), computed in z's dtype (float32 math for 16-bit logits, as
    F.cross_entropy on them): Liger's CrossEntropyWithZLoss, with token scaling."""
    a = z if z.dtype == torch.float64 else z.float()
    w = weight.to(a.dtype) if weight is not None else None
    ce = F.cross_entropy(a, y, weight=w, ignore_index=ignore_index, reduction="none",
                         label_smoothing=label_smoothing)
    valid = y != ignore_index
    lse = torch.logsumexp(a, -1)
    zl = z_loss * lse ** 2 * valid
    if scaling:
        p_y = torch.exp(a.gather(1, y.clamp_min(0)[:, None])[:, 0] - lse).detach()
        p_y = torch.where(valid, p_y, torch.ones_like(p_y))
        ce, zl = ce * p_y, zl * p_y
    if reduction == "none":
        return ce + zl, zl
    if reduction == "sum":
        return (ce + zl).sum(), zl.sum()
    denom = w[y[valid]].sum() if w is not None else valid.sum().to(a.dtype)
    count = valid.sum().to(a.dtype)
    return ce.sum() / denom + zl.sum() / count, zl.sum() / count


NEW_OPTIONS = {
    "z_loss+weight": dict(z_loss=1e-3, weight=True),
    "token_scaling": dict(use_token_scaling=True),
    "token_scaling+z_loss+smoothing+ignore": dict(use_token_scaling=True, z_loss=1e-4,
                                                  label_smoothing=0.1, ignore_index=7),
    "shift=3": dict(shift=3),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(NEW_OPTIONS))
@pytest.mark.parametrize("std", [1.0, 8.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_new_keywords_parity(dtype, std, case, reduction):
    """cross_entropy with z_loss, use_token_scaling, shift and every return_* flag on CUDA: the
    loss and gradient as close to float64 as the eager torch code computing the same thing in
    the same dtype; z_loss, lse within 1e-5 of float64; token accuracy and predicted tokens
    exactly torch.argmax's on the same logits."""
    opt = dict(NEW_OPTIONS[case])
    ignore_index = opt.pop("ignore_index", -100)
    weighted = opt.pop("weight", False)
    b, t, v = 4, 64, 32003
    z, y, w = inputs(b * t, v, std, dtype, ignore_index, seed=int(std) * 7 + len(case))
    weight = w if weighted else None
    k = opt.get("shift", 0)
    if k:  # CCE's spelling: targets [B, T], T their last dimension; torch: slicing
        zt, yt = z.view(b, t, v)[:, :t - k].reshape(-1, v), y.view(b, t)[:, k:].reshape(-1)
        target = y.view(b, t)
    else:
        zt, yt, target = z, y, y
    up_n = zt.shape[0] if reduction == "none" else None
    up = ((torch.rand(up_n, device="cuda") + 0.5) if up_n else torch.tensor(0.75, device="cuda"))
    lam, scaling = opt.get("z_loss", 0.0), opt.get("use_token_scaling", False)
    ls = opt.get("label_smoothing", 0.0)

    def run_ref(x, cast):
        xx = x.detach().clone().to(cast).requires_grad_(True)
        loss, zl = liger_style(xx, yt, weight.double() if (weight is not None and cast ==
                                                          torch.float64) else weight,
                               ignore_index, reduction, ls, lam, scaling)
        (g,) = torch.autograd.grad(loss, xx, up.to(loss.dtype))
        return loss.detach(), g, zl.detach()

    ref_loss, ref_grad, ref_zl = run_ref(zt, torch.float64)
    t_loss, t_grad, _ = run_ref(zt, dtype)

    x = z.detach().clone().requires_grad_(True)
    out = cross_entropy(x, target, weight, ignore_index=ignore_index, reduction=reduction,
                        return_z_loss=True, return_token_accuracy=True,
                        return_predicted_tokens=True, return_lse=True, **opt)
    f_loss = out.loss
    if k and reduction == "none":  # every position; CCE's (and the sliced torch) drop the last k
        f_loss = f_loss[:, :t - k].reshape(-1)
    (f_grad,) = torch.autograd.grad(f_loss, x, up)
    if k:
        assert torch.all(f_grad.view(b, t, v)[:, t - k:] == 0)
        f_grad = f_grad.view(b, t, v)[:, :t - k].reshape(-1, v)
    f32 = 1e-5 if dtype == torch.float32 else None
    assert f_loss.dtype == torch.float32 and f_grad.dtype == dtype
    assert_as_close(f_loss.detach(), t_loss.float(), ref_loss, LOSS_FLOOR, "loss", f32)
    assert_as_close(f_grad, t_grad, ref_grad, GRAD_FLOOR[dtype], "grad", f32)

    zl = out.z_loss
    if k and reduction == "none":
        zl = zl[:, :t - k].reshape(-1)
    assert rel(zl, ref_zl) <= 1e-5 or (lam == 0 and float(zl.abs().max()) == 0)
    lse_ref = torch.logsumexp(z.double(), -1)
    assert rel(out.lse.reshape(-1), lse_ref) <= 1e-6
    if k:  # the target each row is scored against, ignore_index for the last k positions
        yy = torch.full((b, t), ignore_index, dtype=y.dtype, device="cuda")
        yy[:, :t - k] = y.view(b, t)[:, k:]
        yy = yy.reshape(-1)
    else:
        yy = y
    valid = yy != ignore_index
    pred = torch.where(valid, z.argmax(-1), torch.full_like(yy, -1))  # same dtype, same ties
    assert torch.equal(out.predicted_tokens.reshape(-1), pred)
    right = (valid & (pred == yy)).float()
    acc = right if reduction == "none" else right.sum() / valid.sum()
    assert torch.allclose(out.token_accuracy.reshape(acc.shape), acc, rtol=1e-6, atol=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_linear_new_keywords_parity(dtype, reduction):
    """linear_cross_entropy with z_loss, use_token_scaling and CCE's shift on [B, T, D] against
    F.cross_entropy(F.linear(h, W, b).float()) sliced by hand, plus Liger's z-loss and token
    scaling; predicted tokens / accuracy against torch.argmax of the same logits."""
    b_, t, d, v, k = 8, 128, 512, 32003, 1
    g = torch.Generator(device="cuda").manual_seed(11)
    h = torch.randn(b_, t, d, device="cuda", generator=g).to(dtype)
    W = (torch.randn(v, d, device="cuda", generator=g) * (8.0 / d ** 0.5)).to(dtype)
    bias = (torch.randn(v, device="cuda", generator=g) * 0.1).to(dtype)
    y = torch.randint(0, v, (b_, t), device="cuda", generator=g)
    y[:, 5::11] = -100
    ys = y[:, k:].reshape(-1)
    up = ((torch.rand(b_ * (t - k), device="cuda") + 0.5) if reduction == "none"
          else torch.tensor(0.75, device="cuda"))

    def run_ref(cast):
        ps = [p.detach().clone().to(cast).requires_grad_(True) for p in (h, W, bias)]
        logits = F.linear(ps[0], ps[1], ps[2])[:, :t - k].reshape(-1, v)
        loss, _ = liger_style(logits, ys, None, -100, reduction, 0.0, 1e-4, True)
        return loss.detach(), torch.autograd.grad(loss, ps, up.to(loss.dtype))

    ref_loss, ref_grads = run_ref(torch.float64)
    t_loss, t_grads = run_ref(dtype)
    ps = [p.detach().clone().requires_grad_(True) for p in (h, W, bias)]
    out = linear_cross_entropy(ps[0], ps[1], y, linear_bias=ps[2], reduction=reduction,
                               z_loss=1e-4, use_token_scaling=True, shift=k,
                               return_predicted_tokens=True, return_token_accuracy=True)
    f_loss = out.loss[:, :t - k].reshape(-1) if reduction == "none" else out.loss
    f_grads = torch.autograd.grad(f_loss, ps, up)
    f32 = 1e-5 if dtype == torch.float32 else None
    assert_as_close(f_loss.detach(), t_loss.float(), ref_loss, LOSS_FLOOR, "loss", f32)
    for name, fg, tg, rg in zip(("grad_hidden", "grad_weight", "grad_bias"), f_grads, t_grads,
                                ref_grads):
        assert fg.dtype == dtype, name
        assert_as_close(fg, tg, rg, GRAD_FLOOR[dtype], name, f32)
    # predicted tokens: the library forms the logits with its own GEMM (16-bit: rounded to the
    # dtype), which may order near-ties differently from torch: each prediction must be a
    # maximum of the exact logits up to that rounding; -1 exactly for the rows not scored
    exact = F.linear(h.double(), W.double(), bias.double())
    pred = out.predicted_tokens
    scored = torch.zeros_like(y, dtype=torch.bool)
    scored[:, :t - k] = y[:, k:] != -100
    assert torch.all(pred[~scored] == -1) and torch.all(pred[scored] >= 0)
    top = exact.max(-1).values
    got = exact.gather(-1, pred.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    eps = {torch.float32: 1e-5, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}[dtype]
    slack = eps * exact.abs().amax(-1)
    assert torch.all((top - got)[scored] <= slack[scored]), float((top - got)[scored].max())
    right = ((pred == y.roll(-k, 1)) & scored).float()
    acc = out.token_accuracy
    if reduction == "none":
        assert torch.equal(acc, right)
    else:
        assert abs(acc.item() - (right.sum() / scored.sum()).item()) <= 1e-6


def adversarial_batch(dtype):
    big = {torch.float32: 1e30, torch.bfloat16: 3e38, torch.float16: 6e4}[dtype]
    v = 32003
    g = torch.Generator(device="cuda").manual_seed(3)
    z = torch.randn(16, v, device="cuda", generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (16,), device="cuda", generator=g)
    z[0], z[1] = -big, big
    z[2] = -big
    z[2, ::7] = -big * (1 - 2 ** -6)
    z[3, 1::3] = -float("inf")
    y[3] = 0
    z[4, y[4]] = -float("inf")  # loss +inf
    z[5, 17] += 80.0
    z[6] = big * (torch.rand(v, device="cuda", generator=g, dtype=torch.float64) - 0.5) / 4
    z[7, 5] = float("nan")
    z[8, (y[8] + 3) % v] = float("inf")  # a +inf: loss, lse and gradient NaN (as torch)
    z[9, ::11] = -float("inf")
    z[9, y[9]] = float("inf")
    z[9, 10] = float("inf")
    return z.to(dtype), y


def ref_lse(z):
    """torch.logsumexp, but NaN on a row holding a +inf (torch's log_softmax makes that row NaN;
    logsumexp alone gives +inf)."""
    lse = torch.logsumexp(z, -1)
    return torch.where(torch.isposinf(z).any(-1), torch.full_like(lse, float("nan")), lse)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_adversarial_rows_parity(dtype, reduction):
    """Rows no float32 lse survives (all at the dtype's largest magnitude, a huge offset with a
    spread), -inf entries, a -inf target logit, a NaN, +inf entries: NaN and inf exactly where
    float64 torch has them, everything else within the dtype's rounding of float64 — on the
    one-pass path (mean/sum), the fce_backward path ('none') and with return_lse (torch's
    logsumexp, NaN on the +inf rows: docs/semantics.md rule 10)."""
    z, y = adversarial_batch(dtype)
    up = ((torch.rand(z.shape[0], device="cuda") + 0.5) if reduction == "none"
          else torch.tensor(0.75, device="cuda"))
    ref_loss, ref_grad = grad_of(F.cross_entropy, z.double(), up.double(), y,
                                 reduction=reduction)
    x = z.detach().clone().requires_grad_(True)
    out = cross_entropy(x, y, reduction=reduction, return_lse=True)
    (f_grad,) = torch.autograd.grad(out.loss, x, up)
    for what, f, r, tol in (("loss", out.loss.detach(), ref_loss, 1e-5),
                            ("grad", f_grad, ref_grad, GRAD_FLOOR[dtype] * 2),
                            ("lse", out.lse, ref_lse(z.double()), 1e-6)):
        f, r = f.double(), r.double()
        assert torch.equal(torch.isnan(f), torch.isnan(r)), what
        inf = torch.isinf(r)
        assert torch.equal(f[inf], r[inf]) and not torch.isinf(f[~inf]).any(), what
        fin = torch.isfinite(r)
        if fin.any():
            err = ((f[fin] - r[fin]).abs().max() / r[fin].abs().max().clamp_min(1e-300)).item()
            assert err <= tol, f"{what}: {err:.3e} > {tol:.1e}"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_positive_infinity_parity(dtype, case, reduction):
    """+inf logits against float64 torch with every option set (docs/semantics.md rule 10): a
    scored row holding a +inf has a NaN loss and a NaN gradient row whatever the class weights
    and the label smoothing, the others are untouched. The one difference from torch: an
    ignored row holding a +inf keeps a zero gradient (torch's is NaN)."""
    opt = OPTIONS[case]
    ignore_index = opt.get("ignore_index", -100)
    z, y, w = inputs(64, 4099, 4.0, dtype, ignore_index, seed=21)
    y[5], y[6] = 100, 200  # scored rows (y[3] is ignored)
    z[5, 101] = float("inf")
    z[6, :50] = -float("inf")
    z[6, 200] = float("inf")
    z[3, 0] = float("inf")
    kw = {"weight": w if opt.get("weight") else None, "ignore_index": ignore_index,
          "label_smoothing": opt.get("label_smoothing", 0.0), "reduction": reduction}
    up = ((torch.rand(64, device="cuda") + 0.5) if reduction == "none"
          else torch.tensor(0.75, device="cuda"))
    ref_loss, ref_grad = grad_of(F.cross_entropy, z.double(), up.double(), y,
                                 **dict(kw, weight=None if kw["weight"] is None
                                        else kw["weight"].double()))
    loss, grad = grad_of(cross_entropy, z, up, y, **kw)
    assert torch.equal(torch.isnan(loss), torch.isnan(ref_loss))
    assert not torch.isinf(loss).any()
    nan_rows = torch.isnan(grad).all(1)
    assert nan_rows[5] and nan_rows[6] and int(nan_rows.sum()) == 2
    assert torch.isnan(ref_grad[3]).all() and torch.all(grad[3] == 0)  # the ignored row
    keep = torch.ones(64, dtype=torch.bool, device="cuda")
    keep[[3, 5, 6]] = False
    assert torch.equal(torch.isnan(ref_grad[keep]), torch.zeros_like(ref_grad[keep], dtype=torch.bool))
    if reduction == "none":
        assert rel(loss[keep], ref_loss[keep]) <= LOSS_FLOOR
    assert rel(grad[keep], ref_grad[keep]) <= GRAD_FLOOR[dtype] * 2


def test_check_targets_cuda():
    """check_targets=True: torch's IndexError wording after a host sync; off: NaN, no sync."""
    z, y, _ = inputs(64, 1000, 1.0, torch.float32, -100, seed=1)
    y[9] = 1234
    assert torch.isnan(cross_entropy(z, y))
    for x in (z, z.clone().requires_grad_(True)):
        with pytest.raises(IndexError, match="Target 1234 is out of bounds."):
            cross_entropy(x, y, check_targets=True)
    h, W = torch.randn(64, 32, device="cuda"), torch.randn(1000, 32, device="cuda")
    with pytest.raises(IndexError, match="Target 1234 is out of bounds."):
        linear_cross_entropy(h, W, y, check_targets=True)
