"""fusedce.jax: the XLA FFI custom calls with jax.custom_vjp, against the independent float64
reference (fce_reference.py): values and gradients under jax.jit / jax.grad / jax.vjp /
jax.vmap, every option, the extra outputs, 16-bit inputs, a jitted training step. Runs on JAX's
default device: the CPU backend here, the CUDA backend where JAX has a GPU (and libfusedce its
CUDA backend). The shim (libfusedce_jax.so) is built on first use into a temporary cache unless
FUSEDCE_JAX_LIBRARY / FUSEDCE_JAX_CACHE_DIR say otherwise: it needs a C++ compiler.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_jax.py

Skipped as a whole when jax is not installed (CI has no jax: fusedce.jax is optional).
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: fusedce.jax is optional")
import jax.numpy as jnp  # noqa: E402

if not hasattr(jax, "ffi") or not hasattr(jax.ffi, "ffi_call"):
    pytest.skip("fusedce.jax needs jax >= 0.4.35 (jax.ffi)", allow_module_level=True)

import fce_reference as R  # noqa: E402
import fusedce  # noqa: E402
from fusedce import jax_ffi  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
if ON_GPU and not fusedce.cuda_available():
    pytest.skip("JAX runs on a GPU but libfusedce has no CUDA backend (or sees no device)",
                allow_module_level=True)


pytestmark = pytest.mark.usefixtures("jax_shim_cache")

from fusedce.jax import OUTPUT_FIELDS, cross_entropy, linear_cross_entropy  # noqa: E402

REDUCTIONS = ["mean", "sum", "none"]
N, V = 24, 97
RTOL = 2e-5 if ON_GPU else 1e-5


def _weights(v, seed=5):
    return np.random.default_rng(seed).uniform(0.2, 2.0, v).astype(np.float32)


# option sets in the reference's names (fce_reference.cross_entropy)
OPTION_SETS = {
    "plain": {},
    "class_weights": {"class_weights": _weights(V)},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss_scale": 1e-2},
    "softcap": {"softcap": 5.0},
    "logit_scale": {"logit_scale": 0.37},
    "ignore_index=3": {"ignore_index": 3},
    "shift": {"shift_seq_len": 6},
    "shift=3": {"shift_seq_len": 6, "shift": 3},
    "token_scaling+z_loss": {"token_scaling": True, "z_loss_scale": 1e-3},
    "everything": {"class_weights": _weights(V), "label_smoothing": 0.1, "z_loss_scale": 1e-3,
                   "softcap": 20.0, "logit_scale": -1.5, "ignore_index": 5,
                   "shift_seq_len": 8, "shift": 2, "token_scaling": True},
}


def jax_kwargs(opts):
    """The reference's option names -> fusedce.jax's."""
    names = {"z_loss_scale": "z_loss", "token_scaling": "use_token_scaling"}
    return {names.get(k, k): v for k, v in opts.items()}


def make_inputs(n=N, v=V, std=3.0, seed=0, ignore_index=-100):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((n, v)) * std).astype(np.float32)
    y = rng.integers(0, v, n).astype(np.int32)
    y[1::5] = ignore_index
    return z, y


def assert_close(actual, ref, rtol, what=""):
    """|a - r| <= rtol * (|r| + max|r|), as test_numpy.py."""
    actual = np.asarray(actual, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert actual.shape == ref.shape, (what, actual.shape, ref.shape)
    scale = np.max(np.abs(ref[np.isfinite(ref)])) if np.isfinite(ref).any() else 1.0
    np.testing.assert_allclose(actual, ref, rtol=rtol, atol=rtol * max(scale, 1e-30),
                               err_msg=what)


# ---------------------------------------------------------------------- import ----
def test_importing_fusedce_does_not_import_jax():
    code = ("import sys, fusedce, fusedce.core, fusedce.jax_ffi; "
            "assert 'jax' not in sys.modules, 'fusedce imported jax'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_shim_is_cached_and_registered():
    from fusedce import jax as fj
    path = fj.register()
    assert os.path.isfile(path) and fj.shim_path() == path
    if not os.environ.get("FUSEDCE_JAX_LIBRARY"):
        assert jax_ffi.build() == path  # the same build key: no rebuild


# -------------------------------------------------------------------- cross_entropy ----
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(OPTION_SETS))
def test_cross_entropy_values_and_grads(case, reduction):
    opts = OPTION_SETS[case]
    ignore = opts.get("ignore_index", -100)
    z, y = make_inputs(seed=len(case), ignore_index=ignore)
    kw = jax_kwargs(opts)
    if reduction == "none":
        ct = np.random.default_rng(1).uniform(-1, 1, N).astype(np.float32)
    else:  # an upstream that is neither 1 nor 2^k: fce_backward_rescale recomputes
        ct = np.float32(0.75 if "shift" in case else 1.3)
    ref = R.cross_entropy(z, y, reduction=reduction, grad_output=ct, **opts)

    @jax.jit
    def f(z, y, ct):
        loss, vjp = jax.vjp(lambda z: cross_entropy(z, y, reduction=reduction, **kw), z)
        return loss, vjp(ct)[0]

    loss, grad = f(z, y, ct)
    assert loss.dtype == jnp.float32 and loss.shape == (() if reduction != "none" else (N,))
    assert grad.dtype == jnp.float32 and grad.shape == z.shape
    assert_close(loss, ref["loss"], RTOL, "loss")
    assert_close(grad, ref["grad"], RTOL, "grad")


@pytest.mark.parametrize("upstream", [1.0, 2.0, -0.5, 0.0, 0.3])
def test_cross_entropy_rescale_paths(upstream):
    """jax.grad of c * loss: c = 1 (nothing to do), ±2^k and 0 (exact scale), other (the
    gradient recomputed from the logits)."""
    z, y = make_inputs(seed=3)
    ref = R.cross_entropy(z, y, grad_output=upstream, label_smoothing=0.05)
    g = jax.jit(jax.grad(lambda z: upstream * cross_entropy(z, y, label_smoothing=0.05)))(z)
    assert_close(g, ref["grad"], RTOL, "grad")


def test_cross_entropy_eager_grad_and_value_and_grad():
    """Without jit every primitive is compiled alone (the aliased residual is then copied by
    XLA): same results."""
    z, y = make_inputs(seed=4)
    ref = R.cross_entropy(z, y, reduction="sum", grad_output=0.6)
    loss, g = jax.value_and_grad(lambda z: 0.6 * cross_entropy(z, y, reduction="sum"))(
        jnp.asarray(z))
    assert_close(loss, 0.6 * ref["loss"], RTOL)
    assert_close(g, ref["grad"], RTOL)


def test_vjp_function_called_twice():
    """The residual gradient is aliased to the backward's output; a second call of the same
    vjp function must still see the forward's gradient (XLA copies what it cannot donate)."""
    z, y = make_inputs(seed=5)
    _, vjp = jax.vjp(lambda z: cross_entropy(z, y), jnp.asarray(z))
    g1 = vjp(jnp.float32(1.0))[0]
    g3 = vjp(jnp.float32(3.0))[0]
    g1b = vjp(jnp.float32(1.0))[0]
    ref = R.cross_entropy(z, y)["grad"]
    assert_close(g1, ref, RTOL)
    assert_close(g3, 3 * ref, RTOL)
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g1b))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_extra_outputs(reduction):
    opts = {"z_loss_scale": 1e-2, "token_scaling": True, "label_smoothing": 0.1}
    z, y = make_inputs(seed=6)
    ref = R.cross_entropy(z, y, reduction=reduction, **opts)
    out = jax.jit(lambda z, y: cross_entropy(
        z, y, reduction=reduction, return_z_loss=True, return_token_accuracy=True,
        return_predicted_tokens=True, return_lse=True, return_entropy=True,
        **jax_kwargs(opts)))(z, y)
    assert tuple(type(out)._fields) == OUTPUT_FIELDS
    assert_close(out.loss, ref["loss"], RTOL, "loss")
    assert_close(out.lse, ref["lse"], RTOL, "lse")
    z64 = z.astype(np.float64)
    p = np.exp(z64 - ref["lse"][:, None])
    assert_close(out.entropy, ref["lse"] - (p * z64).sum(1), RTOL, "entropy")
    np.testing.assert_array_equal(np.asarray(out.predicted_tokens), ref["argmax"])
    assert_close(out.token_accuracy, ref["accuracy"], 1e-6, "accuracy")
    if reduction == "none":  # per row, as Liger: lambda * lse^2 * p_y for the counted rows
        p_y = np.exp(z.astype(np.float64)[np.arange(N), np.where(y < 0, 0, y)] - ref["lse"])
        zl = np.where(y != -100, 1e-2 * ref["lse"] ** 2 * p_y, 0.0)
        assert_close(out.z_loss, zl, RTOL, "z_loss rows")
    else:
        assert_close(out.z_loss, ref["z_loss"], RTOL, "z_loss")
    # only the asked-for fields, in order; lse is differentiable (d lse / dz = softmax), the
    # other extras are constants for autodiff
    loss, lse = cross_entropy(z, y, return_lse=True)
    g = jax.grad(lambda z: cross_entropy(z, y, return_lse=True).lse.sum())(jnp.asarray(z))
    assert_close(g, p, RTOL, "d lse / dz")
    g = jax.grad(lambda z: cross_entropy(z, y, return_z_loss=True, return_token_accuracy=True,
                                         z_loss=1e-2).z_loss.sum())(jnp.asarray(z))
    assert not np.asarray(g).any()


def test_shapes_and_shift_from_targets():
    """logits [B, T, V] with targets [B, T]; shift=1 alone takes T from targets."""
    b, t = 3, 8
    z, y = make_inputs(n=b * t, seed=7)
    y = np.where(y < 0, 1, y)
    ref = R.cross_entropy(z, y, reduction="none", shift_seq_len=t, shift=1)
    loss = cross_entropy(z.reshape(b, t, V), y.reshape(b, t), reduction="none", shift=1)
    assert loss.shape == (b, t)
    assert_close(loss.reshape(-1), ref["loss"], RTOL)
    # 1-D logits, a scalar target
    one = cross_entropy(z[0], y[0], reduction="none")
    assert one.shape == ()
    assert_close(one, R.cross_entropy(z[:1], y[:1], reduction="none")["loss"][0], RTOL)


def test_int64_targets_and_float64_logits_under_x64():
    code = r"""
import jax, numpy as np, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import fce_reference as R
from fusedce.jax import cross_entropy
rng = np.random.default_rng(0)
z = rng.standard_normal((10, 13)); y = rng.integers(0, 13, 10)  # float64, int64
l, g = jax.jit(jax.value_and_grad(lambda z: cross_entropy(z, y, label_smoothing=0.1)))(z)
assert g.dtype == jnp.float64 and l.dtype == jnp.float32, (g.dtype, l.dtype)
ref = R.cross_entropy(z.astype(np.float32), y, label_smoothing=0.1)
np.testing.assert_allclose(l, ref["loss"], rtol=1e-5)
np.testing.assert_allclose(g, ref["grad"], rtol=1e-5, atol=1e-7)
am = cross_entropy(z, y, return_predicted_tokens=True).predicted_tokens
np.testing.assert_array_equal(am, ref["argmax"])
print("ok")
"""
    # the parent's JAX holds most of a GPU's memory already: the child allocates on demand
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_16bit(dtype, reduction):
    z, y = make_inputs(seed=8)
    zq = jnp.asarray(z).astype(dtype)
    zr = np.asarray(zq.astype(jnp.float32))  # the reference sees the rounded logits
    ct = 1.0 if reduction == "mean" else np.linspace(-1, 1, N).astype(np.float32)
    ref = R.cross_entropy(zr, y, reduction=reduction, grad_output=ct, z_loss_scale=1e-3)
    loss, vjp = jax.vjp(lambda z: cross_entropy(z, y, reduction=reduction, z_loss=1e-3), zq)
    g = vjp(jnp.asarray(ct, jnp.float32))[0]
    assert g.dtype == zq.dtype
    assert_close(loss, ref["loss"], 1e-5, "loss")
    assert_close(np.asarray(g.astype(jnp.float32)), ref["grad"], 1e-2, "grad")


def test_vmap():
    z, y = make_inputs(n=3 * 10, seed=9)
    zb, yb = z.reshape(3, 10, V), y.reshape(3, 10)
    f = jax.jit(jax.vmap(jax.value_and_grad(lambda z, y: cross_entropy(z, y, z_loss=1e-3))))
    loss, g = f(zb, yb)
    for i in range(3):
        ref = R.cross_entropy(zb[i], yb[i], z_loss_scale=1e-3)
        assert_close(loss[i], ref["loss"], RTOL)
        assert_close(g[i], ref["grad"], RTOL)


def test_mean_over_no_rows_and_empty_input():
    z, _ = make_inputs(n=4, seed=10)
    y = np.full(4, -100, np.int32)
    loss, g = jax.value_and_grad(lambda z: cross_entropy(z, y))(jnp.asarray(z))
    assert float(loss) == 0.0 and not np.asarray(g).any()
    empty = cross_entropy(jnp.zeros((0, V)), jnp.zeros((0,), jnp.int32), reduction="none")
    assert empty.shape == (0,)


def test_out_of_range_target_is_nan():
    z, y = make_inputs(n=6, seed=11)
    y[0] = V + 3
    loss = cross_entropy(z, y, reduction="none")
    assert np.isnan(np.asarray(loss)[0]) and np.isfinite(np.asarray(loss)[2:]).all()


def test_validation_errors():
    z, y = make_inputs(n=6, seed=12)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(z, y, reduction="avg")
    with pytest.raises(ValueError, match="targets has"):
        cross_entropy(z, y[:5])
    with pytest.raises(ValueError, match="shape of the logits"):
        cross_entropy(z, y.astype(np.float32))  # float: class probabilities, [N, V]
    with pytest.raises(TypeError, match="class indices"):
        cross_entropy(z, y.astype(np.bool_))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        cross_entropy(z.astype(np.int32), y)
    with pytest.raises(ValueError, match="class_weights"):
        cross_entropy(z, y, class_weights=np.ones(V + 1, np.float32))
    with pytest.raises(ValueError, match="shift"):
        cross_entropy(z, y, shift=6)
    # rows that are no whole number of sequences: the library's message, at trace time
    with pytest.raises(ValueError, match=r"is not a multiple of options->shift_seq_len \(4\)"):
        cross_entropy(z, y, shift_seq_len=4)
    h = np.ones((6, 8), np.float32)
    with pytest.raises(TypeError, match="dtype"):
        linear_cross_entropy(h, np.ones((V, 8), jnp.bfloat16), y)
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(h, np.ones((V, 9), np.float32), y)
    # the library's own checks come back as errors from the custom call
    with pytest.raises(Exception, match="label_smoothing"):
        jax.block_until_ready(cross_entropy(z, y, label_smoothing=1.5))


# -------------------------------------------------------------- linear_cross_entropy ----
LN, LD, LV = 20, 24, 67

LINEAR_OPTIONS = {
    "plain": {},
    "weights+smoothing": {"class_weights": _weights(LV), "label_smoothing": 0.1},
    "z_loss+softcap+scale": {"z_loss_scale": 1e-3, "softcap": 5.0, "logit_scale": 2.0},
    "shift=2+token_scaling": {"shift_seq_len": 10, "shift": 2, "token_scaling": True,
                              "z_loss_scale": 1e-3, "ignore_index": 4},
}


def make_linear(seed=0, dtype=np.float32, bias=True, ignore_index=-100):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((LN, LD)) * 3).astype(dtype)
    W = (rng.standard_normal((LV, LD)) / np.sqrt(LD)).astype(dtype)
    b = (rng.standard_normal(LV) * 0.1).astype(dtype) if bias else None
    y = rng.integers(0, LV, LN).astype(np.int32)
    y[2::7] = ignore_index
    return h, W, b, y


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(LINEAR_OPTIONS))
def test_linear_values_and_grads(case, reduction, bias):
    opts = LINEAR_OPTIONS[case]
    h, W, b, y = make_linear(seed=len(case), bias=bias,
                             ignore_index=opts.get("ignore_index", -100))
    ct = (np.random.default_rng(2).uniform(-1, 1, LN).astype(np.float32)
          if reduction == "none" else np.float32(1.5))
    ref = R.linear_cross_entropy(h, W, y, b, grad_output=ct, reduction=reduction, **opts)
    kw = jax_kwargs(opts)
    args = (h, W, b) if bias else (h, W)

    @jax.jit
    def f(args, ct):
        fn = lambda *a: linear_cross_entropy(a[0], a[1], y, a[2] if bias else None,  # noqa
                                             reduction=reduction, **kw)
        loss, vjp = jax.vjp(fn, *args)
        return loss, vjp(ct)

    loss, grads = f(args, ct)
    assert_close(loss, ref["loss"], RTOL, "loss")
    assert_close(grads[0], ref["grad_hidden"], RTOL, "grad_hidden")
    assert_close(grads[1], ref["grad_weight"], RTOL, "grad_weight")
    if bias:
        assert_close(grads[2], ref["grad_bias"], RTOL, "grad_bias")


@pytest.mark.parametrize("upstream", [1.0, 4.0, 0.3])
@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1), (1, 2)])
def test_linear_gradient_subsets(argnums, upstream):
    """Only the gradients being differentiated are computed (custom_vjp symbolic zeros);
    a bias among them takes the recompute path."""
    h, W, b, y = make_linear(seed=13)
    ref = R.linear_cross_entropy(h, W, y, b, grad_output=upstream, z_loss_scale=1e-3)
    names = ("grad_hidden", "grad_weight", "grad_bias")
    f = jax.jit(jax.grad(lambda h, W, b: upstream * linear_cross_entropy(h, W, y, b, z_loss=1e-3),
                         argnums=argnums))
    grads = f(h, W, b)
    for i, g in zip(argnums, grads):
        assert_close(g, ref[names[i]], RTOL, names[i])


def test_linear_extras_and_batched_shapes():
    h, W, b, y = make_linear(seed=14)
    ref = R.linear_cross_entropy(h, W, y, b, reduction="none", z_loss_scale=1e-2)
    out = linear_cross_entropy(h.reshape(4, 5, LD), W, y.reshape(4, 5), b, reduction="none",
                               z_loss=1e-2, return_z_loss=True, return_token_accuracy=True,
                               return_predicted_tokens=True, return_lse=True)
    assert out.loss.shape == (4, 5) and out.lse.shape == (4, 5)
    assert_close(out.loss.reshape(-1), ref["loss"], RTOL, "loss")
    assert_close(out.lse.reshape(-1), ref["lse"], RTOL, "lse")
    np.testing.assert_array_equal(np.asarray(out.predicted_tokens).reshape(-1), ref["argmax"])
    assert_close(out.token_accuracy.reshape(-1), ref["accuracy"], 1e-6, "accuracy")
    zl = np.where(y != -100, 1e-2 * ref["lse"] ** 2, 0.0)
    assert_close(out.z_loss.reshape(-1), zl, RTOL, "z_loss rows")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_linear_16bit(dtype):
    h, W, b, y = make_linear(seed=15, bias=False)
    hq, Wq = jnp.asarray(h).astype(dtype), jnp.asarray(W).astype(dtype)
    ref = R.linear_cross_entropy(np.asarray(hq.astype(jnp.float32)),
                                 np.asarray(Wq.astype(jnp.float32)), y)
    loss, (gh, gw) = jax.jit(jax.value_and_grad(
        lambda h, W: linear_cross_entropy(h, W, y), argnums=(0, 1)))(hq, Wq)
    assert gh.dtype == hq.dtype and gw.dtype == Wq.dtype
    assert_close(loss, ref["loss"], 1e-2, "loss")
    assert_close(np.asarray(gh.astype(jnp.float32)), ref["grad_hidden"], 2e-2, "grad_hidden")
    assert_close(np.asarray(gw.astype(jnp.float32)), ref["grad_weight"], 2e-2, "grad_weight")


def test_linear_small_workspace_budget():
    h, W, b, y = make_linear(seed=16)
    ref = R.linear_cross_entropy(h, W, y, b)
    loss, g = jax.value_and_grad(lambda W: linear_cross_entropy(h, W, y, b, workspace_bytes=0))(
        jnp.asarray(W))
    assert_close(loss, ref["loss"], RTOL)
    assert_close(g, ref["grad_weight"], RTOL)


def test_linear_vmap():
    h, W, b, y = make_linear(seed=17, bias=False)
    hb, yb = h.reshape(2, 10, LD), y.reshape(2, 10)
    f = jax.jit(jax.vmap(jax.grad(lambda h, W, y: linear_cross_entropy(h, W, y),
                                  argnums=(0, 1)), in_axes=(0, None, 0)))
    gh, gw = f(hb, W, yb)
    for i in range(2):
        ref = R.linear_cross_entropy(hb[i], W, yb[i])
        assert_close(gh[i], ref["grad_hidden"], RTOL)
        assert_close(gw[i], ref["grad_weight"], RTOL)


def test_training_step_matches_reference():
    """A jitted SGD step of a small head (hidden -> Dense -> linear CE, and -> logits -> CE)
    follows the step of plain jax.numpy code (optax-style) within float32 rounding."""
    rng = np.random.default_rng(18)
    d_in, d, v, n = 16, 24, 53, 32
    params = {"proj": jnp.asarray(rng.standard_normal((d_in, d)) / 4, jnp.float32),
              "head": jnp.asarray(rng.standard_normal((v, d)) / 5, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((n, d_in)), jnp.float32)
    y = jnp.asarray(rng.integers(0, v, n), jnp.int32).at[::6].set(-100)

    def ref_loss(p):
        logits = jnp.tanh(x @ p["proj"]) @ p["head"].T
        lse = jax.nn.logsumexp(logits, -1)
        m = y != -100
        zy = jnp.take_along_axis(logits, jnp.where(m, y, 0)[:, None], 1)[:, 0]
        return jnp.sum(jnp.where(m, lse - zy + 1e-3 * lse ** 2, 0.0)) / m.sum()

    def fused_linear(p):
        return linear_cross_entropy(jnp.tanh(x @ p["proj"]), p["head"], y, z_loss=1e-3)

    def fused_ce(p):
        return cross_entropy(jnp.tanh(x @ p["proj"]) @ p["head"].T, y, z_loss=1e-3)

    def make_step(loss_fn):
        @jax.jit
        def step(p):
            loss, g = jax.value_and_grad(loss_fn)(p)
            return loss, jax.tree_util.tree_map(lambda a, b: a - 0.5 * b, p, g)
        return step

    steps = {name: make_step(fn) for name, fn in
             (("ref", ref_loss), ("linear", fused_linear), ("ce", fused_ce))}
    state = {name: params for name in steps}
    history = {name: [] for name in steps}
    # float32 products everywhere (JAX's default on a GPU may round matmul inputs to TF32;
    # fusedce's float32 GEMMs do not), so that the trajectories can agree to 1e-5
    with jax.default_matmul_precision("highest"):
        for _ in range(5):
            for name, step in steps.items():
                loss, state[name] = step(state[name])
                history[name].append(float(loss))
    assert history["ref"][-1] < history["ref"][0]
    for name in ("linear", "ce"):
        np.testing.assert_allclose(history[name], history["ref"], rtol=1e-5, err_msg=name)
        for k in params:
            np.testing.assert_allclose(state[name][k], state["ref"][k], rtol=1e-4, atol=1e-5,
                                       err_msg=f"{name}: {k}")


# ------------------------------------------------------------------------ workspaces ----
# The library's workspace is the custom calls' last result, uint8 [bytes] sized at trace time
# with the library's queries (per platform: lax.platform_dependent when the CPU and CUDA sizes
# differ) and dropped: an XLA temporary, never an output, never stacked by vmap.
PLATFORM = "cuda" if ON_GPU else "cpu"


def _ui8_sizes(text):
    """The sizes of the uint8 vectors (workspaces) in a lowered module; batched ones fail."""
    shapes = set(re.findall(r"tensor<([0-9x]*)xui8>", text))
    assert all("x" not in sh for sh in shapes), f"a stacked workspace: {shapes}"
    return sorted(int(sh) for sh in shapes)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_workspace_sizes_are_the_librarys_queries(reduction):
    """Sized with fce_*_workspace_size for the options the handler builds, on every backend
    the library can answer for (the CUDA one where it sees a device)."""
    from fusedce import jax as fj
    from fusedce._options import CEOptions
    red = {"mean": 0, "sum": 1, "none": 2}[reduction]
    opts = CEOptions(reduction=red, z_loss=1e-3, label_smoothing=0.1)
    z = jax.ShapeDtypeStruct((N, V), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((N,), jnp.int32)
    w = jax.ShapeDtypeStruct((V,), jnp.float32)
    kw = dict(dtype="bfloat16", target_dtype="int32", reduction=reduction,
              class_weights=_weights(V), label_smoothing=0.1, z_loss_scale=1e-3)
    fwd = fj._ce_workspace("fce_forward_workspace_size", opts, z, y, w)
    bwd = fj._ce_workspace("fce_backward_workspace_size", opts, z, y, w)
    h = jax.ShapeDtypeStruct((LN, LD), jnp.bfloat16)
    wt = jax.ShapeDtypeStruct((LV, LD), jnp.bfloat16)
    wl = jax.ShapeDtypeStruct((LV,), jnp.float32)
    lin = fj._linear_workspace(opts, fj.DEFAULT_WORKSPACE_BYTES, h, wt, y, wl, with_grad=True)
    lin0 = fj._linear_workspace(opts, 0, h, wt, y, wl, with_grad=False)
    lkw = dict(kw, class_weights=_weights(LV))
    backends = ["cpu"] + (["cuda"] if fusedce.cuda_available() else [])
    for i, backend in enumerate(backends):
        assert fwd[i] == fusedce.forward_workspace_size(N, V, backend=backend, **kw)
        assert bwd[i] == fusedce.backward_workspace_size(N, V, backend=backend, **kw)
        lo, hi = fusedce.linear_ce_workspace_size(LN, LD, LV, backend=backend, **lkw)
        assert lin[i] == (lo if backend == "cpu" else
                          hi if hi < fj.DEFAULT_WORKSPACE_BYTES else fj.DEFAULT_WORKSPACE_BYTES)
        lo0, _ = fusedce.linear_ce_workspace_size(LN, LD, LV, backend=backend, with_grad=False,
                                                  **lkw)
        assert lin0[i] == lo0  # a budget of 0: the minimum


def test_workspace_is_a_dropped_temporary():
    """The lowered module holds the workspace result of the platform it is lowered for, and
    under vmap the workspaces are not stacked (sequential_vmap around the call and the drop)."""
    from fusedce import jax as fj
    h, W, b, y = make_linear(seed=20)
    lo, hi = fusedce.linear_ce_workspace_size(LN, LD, LV, backend=PLATFORM, target_dtype="int32",
                                              z_loss_scale=1e-3)
    budget = fj._default_workspace_bytes()
    want = lo if not ON_GPU else (hi if hi < budget else max(budget, lo))
    f = jax.jit(jax.value_and_grad(lambda h, W: linear_cross_entropy(h, W, y, z_loss=1e-3),
                                   argnums=(0, 1)))
    assert _ui8_sizes(f.lower(h, W).as_text()) == [want]
    loss, (gh, gw) = f(h, W)
    ref = R.linear_cross_entropy(h, W, y, z_loss_scale=1e-3)
    assert_close(loss, ref["loss"], RTOL)
    assert_close(gw, ref["grad_weight"], RTOL)
    hb, yb = h.reshape(4, 5, LD), y.reshape(4, 5)
    g = jax.jit(jax.vmap(jax.grad(lambda h, W, y: linear_cross_entropy(h, W, y).sum(),
                                  argnums=(0, 1)), in_axes=(0, None, 0)))
    _ui8_sizes(g.lower(hb, W, yb).as_text())
    zb, ybb = make_inputs(n=4 * 6, seed=21)
    c = jax.jit(jax.vmap(jax.grad(lambda z, y: cross_entropy(z, y, z_loss=1e-3))))
    _ui8_sizes(c.lower(zb.reshape(4, 6, V), ybb.reshape(4, 6)).as_text())


def test_workspace_staged_per_platform(monkeypatch):
    """CPU and CUDA sizes that differ are staged with lax.platform_dependent: a module exported
    for both platforms holds both, one for a single platform only its own, and the call runs
    with its platform's."""
    export = pytest.importorskip("jax.export")
    from fusedce import _jax_calls
    from fusedce import jax as fj
    real = _jax_calls._per_platform

    def sizes(query):
        cpu, cuda = real(query)
        return cpu + 16, max(cuda, cpu + 16) + 4096  # both enough, and different

    monkeypatch.setattr(_jax_calls, "_per_platform", sizes)  # where the workspaces are sized
    jax.clear_caches()  # the jitted calls hold their workspace sizes
    try:
        z, y = make_inputs(n=18, seed=22)
        ref = R.cross_entropy(z, y, grad_output=1.3, softcap=7.0)
        f = jax.jit(jax.value_and_grad(lambda z: 1.3 * cross_entropy(z, y, softcap=7.0)))
        fwd = sizes(lambda backend: fusedce.forward_workspace_size(
            18, V, backend=backend, target_dtype="int32", softcap=7.0))
        checks = [export.DisabledSafetyCheck.custom_call(t) for t in fj._TARGETS]
        both = export.export(f, platforms=("cpu", "cuda"), disabled_checks=checks)(z)
        assert set(fwd) <= set(_ui8_sizes(both.mlir_module()))
        one = export.export(f, platforms=(PLATFORM,), disabled_checks=checks)(z)
        assert fwd[1 if ON_GPU else 0] in _ui8_sizes(one.mlir_module())
        assert fwd[0 if ON_GPU else 1] not in _ui8_sizes(one.mlir_module())
        loss, g = f(z)
        assert_close(loss, 1.3 * ref["loss"], RTOL)
        assert_close(g, ref["grad"], RTOL)
        loss, g = both.call(z)
        assert_close(g, ref["grad"], RTOL)
    finally:
        jax.clear_caches()


def test_too_small_workspace_is_a_clear_error(monkeypatch):
    """A workspace result below what the library asks for (traced for another backend or
    library) is refused with the library's message, naming workspace_bytes, and the handler's
    hint at the trace-time sizing: never computed with."""
    from fusedce import _jax_calls
    monkeypatch.setattr(_jax_calls, "_per_platform", lambda query: (0, 0))
    jax.clear_caches()
    try:
        h, W, b, y = make_linear(seed=23)
        with pytest.raises(Exception, match=r"fce_linear_ce: workspace_bytes \(0\) is less than "
                                            r"the \d+ bytes .*sized by fusedce/jax.py"):
            jax.block_until_ready(linear_cross_entropy(h, W, y, label_smoothing=0.2))
    finally:
        jax.clear_caches()


def test_options_reach_the_shim_by_name():
    """The options travel as one CEOptions down to the custom calls and are flattened in one
    place (CEOptions.as_ffi_attrs, in the order the shim reads them); the outputs as one
    Want."""
    from fusedce import _jax_calls
    from fusedce._options import FFI_FLOAT_NAMES, FFI_INT_NAMES, CEOptions
    opts = CEOptions(reduction=2, ignore_index=7, label_smoothing=0.25, z_loss=1e-3,
                     softcap=3.0, logit_scale=0.5, shift_seq_len=6, shift=2, token_scaling=True)
    attrs = _jax_calls._attrs(opts, workspace_bytes=1 << 20, rescale=True)
    assert attrs["iopts"].dtype == np.int64 and attrs["fopts"].dtype == np.float32
    values = dict(workspace_bytes=1 << 20, rescale=1, reserved=0)
    assert list(attrs["iopts"]) == [int(values.get(n, getattr(opts, n, None)))
                                    for n in FFI_INT_NAMES]
    assert list(attrs["fopts"]) == [np.float32(getattr(opts, n)) for n in FFI_FLOAT_NAMES]
    out = cross_entropy(*make_inputs(n=6, seed=30), return_lse=True, return_z_loss=True,
                        z_loss=1e-3)
    assert type(out).__name__ == "CrossEntropyOutput" and out._fields == ("loss", "z_loss",
                                                                         "lse")
