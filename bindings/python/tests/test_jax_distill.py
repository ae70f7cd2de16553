"""fusedce.jax: class-probability targets in cross_entropy, distill and linear_distill, against
float64 references written in jax.numpy (values, and gradients by jax.grad of the reference),
under jax.jit, with zero rows and bad inputs. Each test runs on the CPU backend and on the CUDA
backend (the latter skipped where JAX has no GPU or libfusedce no CUDA backend).

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_jax_distill.py

Skipped as a whole when jax is not installed (fusedce.jax is optional).
"""


import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: fusedce.jax is optional")
import jax.numpy as jnp  # noqa: E402

if not hasattr(jax, "ffi") or not hasattr(jax.ffi, "ffi_call"):
    pytest.skip("fusedce.jax needs jax >= 0.4.35 (jax.ffi)", allow_module_level=True)

import fusedce  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_shim_cache")

from fusedce.jax import (cross_entropy, distill, linear_cross_entropy,  # noqa: E402
                         linear_distill)

REDUCTIONS = ["mean", "sum", "none"]
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]
N, V, D, TD = 12, 37, 16, 10


def _gpu_reason():
    try:
        if not jax.devices("gpu"):
            return "JAX has no GPU here"
    except RuntimeError:
        return "JAX has no GPU here (CPU-only jaxlib or no device)"
    if not fusedce.cuda_available():
        return "libfusedce has no CUDA backend (or sees no device)"
    return None


@pytest.fixture(params=["cpu", "cuda"])
def dev(request):
    """The device the inputs are put on (the custom call then runs on its platform)."""
    if request.param == "cpu":
        return jax.devices("cpu")[0]
    reason = _gpu_reason()
    if reason:
        pytest.skip(f"CUDA platform: {reason}")
    return jax.devices("gpu")[0]


def _tol(dev):
    return dict(rtol=2e-5, atol=2e-6) if dev.platform == "cpu" else dict(rtol=1e-4, atol=1e-5)


def _put(dev, *arrays):
    out = tuple(jax.device_put(jnp.asarray(a), dev) for a in arrays)
    return out if len(out) > 1 else out[0]


def _rand(shape, seed, scale=2.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _probs(shape, seed):
    x = np.random.default_rng(seed).uniform(0.0, 1.0, shape) ** 3
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def _close(got, want, dev, scale=1.0):
    tol = _tol(dev)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=tol["rtol"] * scale, atol=tol["atol"] * scale)


# ------------------------------------------------------------------ references ----
# float64, jax.numpy: their jax.grad is the reference gradient
def _transform(x, logit_scale, softcap):
    a = x * logit_scale
    return softcap * jnp.tanh(a / softcap) if softcap > 0 else a


def _reduce(rows, reduction, count):
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return jnp.where(count > 0, rows.sum() / jnp.maximum(count, 1), 0.0)


def ref_soft_ce(z, q, *, reduction="mean", class_weights=None, label_smoothing=0.0,
                z_loss=0.0, softcap=0.0, logit_scale=1.0):
    a = _transform(z, logit_scale, softcap)
    v = a.shape[-1]
    logp = jax.nn.log_softmax(a, axis=-1)
    w = jnp.ones(v, a.dtype) if class_weights is None else class_weights
    qq = (1 - label_smoothing) * q + label_smoothing / v
    rows = -(w * qq * logp).sum(-1)
    if z_loss:
        rows = rows + z_loss * jax.scipy.special.logsumexp(a, axis=-1) ** 2
    return _reduce(rows, reduction, rows.shape[0])


def _kl(p_log, q_log):
    """KL(P || Q) per row from log-probabilities."""
    return (jnp.exp(p_log) * (p_log - q_log)).sum(-1)


def ref_distill(z, t, targets=None, *, divergence="forward_kl", beta=0.5, temperature=1.0,
                reduction="mean", ignore_index=-100, softcap=0.0, logit_scale=1.0):
    logp = jax.nn.log_softmax(_transform(z, logit_scale, softcap) / temperature, axis=-1)
    logq = jax.nn.log_softmax(_transform(t, logit_scale, softcap) / temperature, axis=-1)
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0):
        rows = _kl(logq, logp)
    elif divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0):
        rows = _kl(logp, logq)
    else:
        logm = jnp.log(beta * jnp.exp(logq) + (1 - beta) * jnp.exp(logp))
        rows = beta * _kl(logq, logm) + (1 - beta) * _kl(logp, logm)
    if targets is None:
        counted = jnp.ones(rows.shape, bool)
    else:
        counted = jnp.asarray(targets) != ignore_index
    rows = jnp.where(counted, rows, 0.0)
    return _reduce(rows, reduction, counted.sum())


def _ref_value_and_grad(fn, args, argnums, ct):
    """The reference's value and its VJP with cotangent ct, in float64."""
    with jax.enable_x64(True):
        a64 = [jnp.asarray(np.asarray(x), jnp.float64) if np.asarray(x).dtype.kind == "f"
               else jnp.asarray(np.asarray(x)) for x in args]
        val, vjp = jax.vjp(lambda *d: fn(*[d[argnums.index(i)] if i in argnums else a64[i]
                                           for i in range(len(a64))]),
                           *[a64[i] for i in argnums])
        grads = vjp(jnp.asarray(np.asarray(ct), jnp.float64))
        return np.asarray(val), [np.asarray(g) for g in grads]


def _cotangent(reduction, n, seed=3):
    if reduction == "none":
        return np.random.default_rng(seed).uniform(-1.5, 1.5, n).astype(np.float32)
    return np.float32(0.75)


def _check(fn, ref, args, argnums, reduction, dev, scale=1.0):
    """fn's value and VJP (cotangent: a random per-row vector, or 0.75) against ref's."""
    ct = _cotangent(reduction, args[0].shape[0])
    dargs = _put(dev, *args)
    val, vjp = jax.vjp(lambda *d: fn(*[d[argnums.index(i)] if i in argnums else dargs[i]
                                       for i in range(len(dargs))]),
                       *[dargs[i] for i in argnums])
    grads = vjp(_put(dev, ct))
    want, want_grads = _ref_value_and_grad(ref, args, argnums, ct)
    _close(val, want, dev, scale)
    for g, w in zip(grads, want_grads):
        assert g.dtype == dargs[argnums[0]].dtype
        _close(g, w, dev, scale)


# ------------------------------------------------- class-probability targets ----
SOFT_OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.2},
    "weights": {"class_weights": "w"},
    "z_loss": {"z_loss": 1e-3},
    "softcap_scale": {"softcap": 6.0, "logit_scale": 0.7},
}


def _opts_with_weights(opts, v):
    opts = dict(opts)
    if opts.get("class_weights") == "w":
        opts["class_weights"] = np.random.default_rng(9).uniform(0.2, 2.0, v).astype(np.float32)
    return opts


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(SOFT_OPTIONS))
def test_soft_targets(dev, reduction, case):
    opts = _opts_with_weights(SOFT_OPTIONS[case], V)
    z, q = _rand((N, V), 1), _probs((N, V), 2)
    cw = opts.pop("class_weights", None)

    def ours(zz, qq):
        return cross_entropy(zz, qq, reduction=reduction, class_weights=cw, **opts)

    def ref(zz, qq):
        w = None if cw is None else jnp.asarray(cw, zz.dtype)
        return ref_soft_ce(zz, qq, reduction=reduction, class_weights=w, **opts)
    _check(ours, ref, (z, q), (0,), reduction, dev)


def test_soft_targets_leading_dims_jit_and_outputs(dev):
    """[B, T, V] logits: the per-row outputs have the leading shape; jit; lse and entropy
    from the same call; q with one-hot rows equals the class-index loss."""
    z, q = _rand((3, 4, V), 4), _probs((3, 4, V), 5)
    zd, qd = _put(dev, z, q)
    f = jax.jit(lambda a, b: cross_entropy(a, b, reduction="none", return_lse=True,
                                           return_entropy=True))
    out = f(zd, qd)
    assert out.loss.shape == (3, 4) and out.lse.shape == (3, 4) and out.entropy.shape == (3, 4)
    with jax.enable_x64(True):
        a = jnp.asarray(z, jnp.float64)
        want = ref_soft_ce(a.reshape(-1, V), jnp.asarray(q, jnp.float64).reshape(-1, V),
                           reduction="none").reshape(3, 4)
        lse = jax.scipy.special.logsumexp(a, axis=-1)
        p = jax.nn.softmax(a, axis=-1)
        ent = lse - (p * a).sum(-1)
    _close(out.loss, want, dev)
    _close(out.lse, lse, dev)
    _close(out.entropy, ent, dev)
    y = np.random.default_rng(6).integers(0, V, (3, 4)).astype(np.int32)
    onehot = np.eye(V, dtype=np.float32)[y]
    _close(cross_entropy(zd, _put(dev, onehot)), cross_entropy(zd, _put(dev, y)), dev)
    g = jax.jit(jax.grad(lambda a: cross_entropy(a, qd)))(zd)
    _, (gw,) = _ref_value_and_grad(lambda a, b: ref_soft_ce(a.reshape(-1, V), b.reshape(-1, V)),
                                   (z, q), (0,), np.float32(1.0))
    _close(g, gw, dev)


def test_soft_targets_get_no_gradient(dev):
    z, q = _put(dev, _rand((N, V), 7), _probs((N, V), 8))
    gq = jax.grad(lambda b: cross_entropy(z, b), argnums=0)(q)
    assert not np.asarray(gq).any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_soft_targets_16bit(dev, dtype):
    z, q = _rand((N, V), 9), _probs((N, V), 10)
    zd, qd = _put(dev, z.astype(dtype), q.astype(dtype))
    loss, g = jax.value_and_grad(lambda a: cross_entropy(a, qd))(zd)
    assert loss.dtype == jnp.float32 and g.dtype == jnp.dtype(dtype)
    z32 = np.asarray(zd.astype(jnp.float32))
    q32 = np.asarray(qd.astype(jnp.float32))
    want, (gw,) = _ref_value_and_grad(lambda a, b: ref_soft_ce(a, b), (z32, q32), (0,),
                                      np.float32(1.0))
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-3)
    np.testing.assert_allclose(np.asarray(g, np.float32), gw, rtol=3e-2, atol=2e-3)


def test_soft_targets_zero_rows(dev):
    z, q = _put(dev, np.zeros((0, V), np.float32), np.zeros((0, V), np.float32))
    assert float(cross_entropy(z, q)) == 0.0
    assert cross_entropy(z, q, reduction="none").shape == (0,)
    g = jax.grad(lambda a: cross_entropy(a, q, reduction="sum"))(z)
    assert g.shape == (0, V)


def test_soft_targets_errors(dev):
    z, q = _put(dev, _rand((6, V), 11), _probs((6, V), 12))
    fn = "fusedce.jax.cross_entropy"
    with pytest.raises(ValueError, match=f"{fn}: targets of class probabilities must have"):
        cross_entropy(z, q[:, :5])
    with pytest.raises(TypeError, match=f"{fn}: targets .* have dtype bfloat16"):
        cross_entropy(z, q.astype(jnp.bfloat16))
    for kw, name in (({"use_token_scaling": True}, "use_token_scaling"),
                     ({"shift": 1}, "shift"),
                     ({"return_token_accuracy": True}, "return_token_accuracy")):
        with pytest.raises(ValueError, match=f"{fn}: {name}.* class-probability"):
            cross_entropy(z, q, **kw)
    with pytest.raises(ValueError, match="ignore_index"):
        cross_entropy(z, q, ignore_index=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        jax.block_until_ready(cross_entropy(z, q, label_smoothing=1.5))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1, 2)])
@pytest.mark.parametrize("case", ["plain", "smoothing", "z_loss"])
def test_linear_soft_targets(dev, reduction, argnums, case):
    """linear_cross_entropy against class probabilities: cross_entropy's loss of
    hidden @ weight.T + bias, gradients to hidden, weight and bias."""
    opts = SOFT_OPTIONS[case]
    h, w, b = _rand((N, D), 70, 1.0), _rand((V, D), 71, 0.4), _rand((V,), 72, 0.5)
    q = _probs((N, V), 73)
    _check(lambda hh, ww, bb, qq: linear_cross_entropy(hh, ww, qq, bb, reduction=reduction,
                                                       **opts),
           lambda hh, ww, bb, qq: ref_soft_ce(hh @ ww.T + bb, qq, reduction=reduction, **opts),
           (h, w, b, q), argnums, reduction, dev, scale=5.0)


def test_linear_soft_targets_errors_and_zero_rows(dev):
    h, w = _put(dev, _rand((6, D), 74), _rand((V, D), 75))
    q = _put(dev, _probs((6, V), 76))
    fn = "fusedce.jax.linear_cross_entropy"
    with pytest.raises(ValueError, match=f"{fn}: targets of class probabilities must have"):
        linear_cross_entropy(h, w, q[:, :4])
    with pytest.raises(ValueError, match=f"{fn}: use_token_scaling"):
        linear_cross_entropy(h, w, q, use_token_scaling=True)
    h0, q0 = _put(dev, np.zeros((0, D), np.float32), np.zeros((0, V), np.float32))
    assert float(linear_cross_entropy(h0, w, q0)) == 0.0


# ------------------------------------------------------------------- distill ----
DISTILL_OPTIONS = {
    "plain": {},
    "temperature": {"temperature": 2.5},
    "beta": {"beta": 0.3, "temperature": 0.7},
    "softcap_scale": {"softcap": 5.0, "logit_scale": 1.3},
}


def _targets_with_ignored(n, seed=13, ignore_index=-100):
    y = np.random.default_rng(seed).integers(0, V, n).astype(np.int32)
    y[::4] = ignore_index
    return y


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("case", list(DISTILL_OPTIONS))
def test_distill(dev, reduction, divergence, case):
    opts = dict(DISTILL_OPTIONS[case], divergence=divergence, reduction=reduction)
    z, t = _rand((N, V), 14), _rand((N, V), 15)
    y = _targets_with_ignored(N) if case != "plain" else None
    yd = None if y is None else _put(dev, y)

    def ours(a, b):
        return distill(a, b, yd, **opts)

    def ref(a, b):
        return ref_distill(a, b, y, **opts)
    _check(ours, ref, (z, t), (0,), reduction, dev)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_distill_jsd_ends(dev, beta):
    """Liger's ends: JSD(0) is KL(q || p), JSD(1) is KL(p || q)."""
    z, t = _rand((N, V), 16), _rand((N, V), 17)
    _check(lambda a, b: distill(a, b, divergence="jsd", beta=beta),
           lambda a, b: ref_distill(a, b, divergence="jsd", beta=beta), (z, t), (0,), "mean",
           dev)


def test_distill_jit_leading_dims_and_teacher_constant(dev):
    z, t = _rand((2, 5, V), 18), _rand((2, 5, V), 19)
    y = _targets_with_ignored(10).reshape(2, 5)
    zd, td, yd = _put(dev, z, t, y)
    f = jax.jit(lambda a, b, c: distill(a, b, c, divergence="reverse_kl", reduction="none"))
    loss = f(zd, td, yd)
    assert loss.shape == (2, 5)
    assert not np.asarray(loss)[y == -100].any()
    with jax.enable_x64(True):
        want = ref_distill(jnp.asarray(z, jnp.float64).reshape(-1, V),
                           jnp.asarray(t, jnp.float64).reshape(-1, V), y.reshape(-1),
                           divergence="reverse_kl", reduction="none").reshape(2, 5)
    _close(loss, want, dev)
    g = jax.jit(jax.grad(lambda a: distill(a, td, yd)))(zd)
    assert not np.asarray(g)[y == -100].any() and np.asarray(g).any()
    gt = jax.grad(lambda b: distill(zd, b), argnums=0)(td)
    assert not np.asarray(gt).any()


def test_distill_vmap(dev):
    """jax.vmap runs the calls one batch element after another: the same as a loop."""
    z, t = _put(dev, _rand((3, N, V), 26), _rand((3, N, V), 27))
    f = jax.vmap(jax.value_and_grad(lambda a, b: distill(a, b, divergence="jsd")))
    losses, grads = f(z, t)
    for i in range(3):
        loss, g = jax.value_and_grad(lambda a: distill(a, t[i], divergence="jsd"))(z[i])
        np.testing.assert_array_equal(np.asarray(losses[i]), np.asarray(loss))
        np.testing.assert_array_equal(np.asarray(grads[i]), np.asarray(g))


def test_distill_every_row_ignored(dev):
    z, t = _put(dev, _rand((6, V), 20), _rand((6, V), 21))
    y = _put(dev, np.full(6, -1, np.int32))
    loss, g = jax.value_and_grad(lambda a: distill(a, t, y, ignore_index=-1))(z)
    assert float(loss) == 0.0 and not np.asarray(g).any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_distill_16bit(dev, dtype):
    zd, td = _put(dev, _rand((N, V), 22).astype(dtype), _rand((N, V), 23).astype(dtype))
    loss, g = jax.value_and_grad(lambda a: distill(a, td, divergence="jsd"))(zd)
    assert loss.dtype == jnp.float32 and g.dtype == jnp.dtype(dtype)
    z32, t32 = np.asarray(zd.astype(jnp.float32)), np.asarray(td.astype(jnp.float32))
    want, (gw,) = _ref_value_and_grad(lambda a, b: ref_distill(a, b, divergence="jsd"),
                                      (z32, t32), (0,), np.float32(1.0))
    np.testing.assert_allclose(float(loss), float(want), rtol=5e-3, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g, np.float32), gw, rtol=3e-2, atol=1e-3)


def test_distill_zero_rows(dev):
    z = _put(dev, np.zeros((0, V), np.float32))
    assert float(distill(z, z)) == 0.0
    assert distill(z, z, reduction="none").shape == (0,)
    g = jax.grad(lambda a: distill(a, z, reduction="sum"))(z)
    assert g.shape == (0, V)


def test_distill_errors(dev):
    z, t = _put(dev, _rand((6, V), 24), _rand((6, V), 25))
    fn = "fusedce.jax.distill"
    with pytest.raises(ValueError, match=f"{fn}: divergence must be"):
        distill(z, t, divergence="kl")
    with pytest.raises(ValueError, match=f"{fn}: reduction must be"):
        distill(z, t, reduction="avg")
    with pytest.raises(ValueError, match=f"{fn}: teacher_logits must have the shape"):
        distill(z, t[:, :5])
    with pytest.raises(TypeError, match=f"{fn}: targets must hold integers"):
        distill(z, t, jnp.zeros(6, jnp.float32))
    with pytest.raises(ValueError, match=f"{fn}: targets must have the shape"):
        distill(z, t, jnp.zeros(5, jnp.int32))
    with pytest.raises(TypeError, match=f"{fn}: student_logits must be float32"):
        distill(z.astype(jnp.int32), t)
    # the library's range checks, at trace time
    with pytest.raises(ValueError, match="beta"):
        distill(z, t, divergence="jsd", beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        distill(z, t, temperature=0.0)


def test_distill_without_library_support(dev, monkeypatch):
    """A libfusedce without the distillation calls: distill says so, naming itself."""
    from fusedce import _jax_calls, _lib
    z = _put(dev, _rand((4, V), 28))
    _jax_calls.register()
    monkeypatch.setattr(_lib, "_LIB_MISSING", _lib._LIB_MISSING | {"fce_distill"})
    with pytest.raises(RuntimeError, match="fusedce.jax.distill: .* lacks fce_distill"):
        distill(z, z)


# ------------------------------------------------------------ linear_distill ----
def _linear_inputs(seed=30, lead=(N,)):
    return (_rand(lead + (D,), seed, 1.0), _rand((V, D), seed + 1, 0.4),
            _rand(lead + (TD,), seed + 2, 1.0), _rand((V, TD), seed + 3, 0.5))


def _ref_linear(h, w, th, tw, y=None, **opts):
    return ref_distill(h @ w.T, th @ tw.T, y, **opts)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1)])
def test_linear_distill(dev, reduction, divergence, argnums):
    opts = dict(divergence=divergence, reduction=reduction, temperature=1.5)
    args = _linear_inputs()
    y = _targets_with_ignored(N, seed=31)
    yd = _put(dev, y)
    _check(lambda h, w, th, tw: linear_distill(h, w, th, tw, yd, **opts),
           lambda h, w, th, tw: _ref_linear(h, w, th, tw, y, **opts), args, argnums, reduction,
           dev, scale=5.0)


def test_linear_distill_jit_and_options(dev):
    h, w, th, tw = _linear_inputs(seed=40, lead=(2, 6))
    hd, wd, thd, twd = _put(dev, h, w, th, tw)
    opts = dict(divergence="jsd", beta=0.25, softcap=4.0, logit_scale=0.9)
    f = jax.jit(jax.value_and_grad(
        lambda a, b: linear_distill(a, b, thd, twd, **opts), argnums=(0, 1)))
    loss, (gh, gw) = f(hd, wd)
    assert gh.shape == h.shape and gw.shape == w.shape
    want, (wh, ww) = _ref_value_and_grad(
        lambda a, b, c, d: _ref_linear(a.reshape(-1, D), b, c.reshape(-1, TD), d, **opts),
        (h, w, th, tw), (0, 1), np.float32(1.0))
    _close(loss, want, dev, 5.0)
    _close(gh, wh, dev, 5.0)
    _close(gw, ww, dev, 5.0)
    # the teacher's inputs are constants
    gt = jax.grad(lambda c: linear_distill(hd, wd, c, twd))(thd)
    assert not np.asarray(gt).any()


@pytest.mark.parametrize("fp32", [False, True])
def test_linear_distill_16bit(dev, fp32, monkeypatch):
    """bfloat16 student and teacher; fp32: the grad_weight accumulated in float32 and rounded
    once (what a CUDA budget below the token-chunk plan's workspace gets), forced here."""
    from fusedce import _jax_distill
    asked = []
    if fp32:
        monkeypatch.setattr(_jax_distill, "_grad_weight_fp32", lambda *a: asked.append(a) or True)
    _jax_distill._linear_distill_call.clear_cache()  # trace again, with the patch
    args = [a.astype(jnp.bfloat16) for a in _put(dev, *_linear_inputs(seed=45))]
    f = jax.jit(jax.value_and_grad(lambda h, w: linear_distill(h, w, *args[2:], reduction="sum"),
                                   argnums=(0, 1)))
    loss, (gh, gw) = f(*args[:2])
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    assert bool(asked) == fp32
    _jax_distill._linear_distill_call.clear_cache()
    a32 = [np.asarray(a.astype(jnp.float32)) for a in args]
    want, (wh, ww) = _ref_value_and_grad(lambda *a: _ref_linear(*a, reduction="sum"), a32,
                                         (0, 1), np.float32(1.0))
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-2)
    for g, w in ((gh, wh), (gw, ww)):
        err = np.abs(np.asarray(g, np.float64) - w).max()
        assert err <= 3e-2 * np.abs(w).max() + 1e-3, err


def test_linear_distill_zero_rows(dev):
    h, th = _put(dev, np.zeros((0, D), np.float32), np.zeros((0, TD), np.float32))
    w, tw = _put(dev, _rand((V, D), 50), _rand((V, TD), 51))
    assert float(linear_distill(h, w, th, tw)) == 0.0
    assert linear_distill(h, w, th, tw, reduction="none").shape == (0,)
    gh, gw = jax.grad(lambda a, b: linear_distill(a, b, th, tw), argnums=(0, 1))(h, w)
    assert gh.shape == (0, D) and not np.asarray(gw).any()


def test_linear_distill_errors(dev):
    h, w, th, tw = _put(dev, *_linear_inputs(seed=60, lead=(6,)))
    fn = "fusedce.jax.linear_distill"
    with pytest.raises(ValueError, match=f"{fn}: weight must be"):
        linear_distill(h, w[:, :3], th, tw)
    with pytest.raises(TypeError, match=f"{fn}: weight has dtype bfloat16"):
        linear_distill(h, w.astype(jnp.bfloat16), th, tw)
    with pytest.raises(ValueError, match=f"{fn}: teacher_hidden must be"):
        linear_distill(h, w, th[:5], tw)
    with pytest.raises(ValueError, match=f"{fn}: teacher_weight must be"):
        linear_distill(h, w, th, tw[:5])
    with pytest.raises(ValueError, match=f"{fn}: workspace_bytes"):
        linear_distill(h, w, th, tw, workspace_bytes=-1)
    with pytest.raises(ValueError, match="temperature"):
        linear_distill(h, w, th, tw, temperature=-1.0)
