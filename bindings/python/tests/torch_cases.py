"""What the torch layer's tests share: the float64 reference, the inputs, the option sets, the
checks run on the CPU and on CUDA (test_torch.py, test_torch_extras.py)."""

import pytest
import torch
import torch.nn.functional as F

import fusedce
from fusedce.torch import cross_entropy, linear_cross_entropy

HAS_CUDA = torch.cuda.is_available() and fusedce.cuda_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device, or libfusedce was built without the CUDA backend")
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


def linear_inputs(seed, bias):
    """hidden [3, 8, 16], weight [53, 16], bias or None, targets [3, 8] (three ignored) and class
    weights [53] for the linear CE tests."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 8, 16, generator=gen)
    W = torch.randn(53, 16, generator=gen) / 4
    b = torch.randn(53, generator=gen) if bias else None
    y = torch.randint(0, 53, (3, 8), generator=gen)
    y[0, :3] = -100
    w = torch.rand(53, generator=gen) + 0.5
    return h, W, b, y, w
