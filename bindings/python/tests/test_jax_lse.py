"""fusedce.jax: the differentiable lse and entropy outputs (return_lse, return_entropy) of
cross_entropy and linear_cross_entropy: jax.grad of functions combining the loss, lse and the
entropy against a jax.numpy reference of the same definitions (float32 inputs: the library's
dtypes; float32 tolerances), with temperature, softcap and ignored rows."""

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: fusedce.jax is optional")
import jax.numpy as jnp  # noqa: E402

from fusedce.jax import cross_entropy, linear_cross_entropy  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_shim_cache")

REDUCTIONS = ["mean", "sum", "none"]
S, C = 0.8, 4.0  # logit_scale, softcap
TOL = 2e-5
# linear_cross_entropy in float32 on a GPU: the library's GEMMs run in TF32 (as the C suites'
# float32 CUDA bound, 2e-3); the reference's products in full float32 (HIGHEST)
LIN_TOL = 2e-3 if jax.default_backend() == "gpu" else TOL


def matmul_t(h, w):
    return jnp.matmul(h, w.T, precision=jax.lax.Precision.HIGHEST)


def reference(z, y, reduction, s=S, c=C):
    """(loss, lse, entropy) in jax.numpy: the scaled, capped logits a = c tanh(s z / c)."""
    a = c * jnp.tanh(z * s / c) if c else z * s
    lse = jax.nn.logsumexp(a, -1)
    ent = lse - (jax.nn.softmax(a, -1) * a).sum(-1)
    valid = y != -100
    ce = jnp.where(valid, lse - jnp.take_along_axis(a, jnp.clip(y, 0)[:, None], 1)[:, 0], 0.0)
    loss = {"mean": ce.sum() / jnp.maximum(valid.sum(), 1), "sum": ce.sum(), "none": ce}
    return loss[reduction], lse, ent


def combine(loss, lse, ent):
    return loss.sum() + 0.1 * (lse ** 2).sum() - 0.03 * ent.sum()


def inputs(n=12, v=37, seed=0):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.standard_normal((n, v)) * 3, jnp.float32)
    y = rng.integers(0, v, n)
    y[1] = y[n - 2] = -100
    return z, jnp.asarray(y)


def close(a, r, tol=TOL):
    a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
    assert a.shape == r.shape
    assert np.abs(a - r).max() <= tol * max(np.abs(r).max(), 1.0), np.abs(a - r).max()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_values_and_grad(reduction, jit):
    z, y = inputs()
    kw = dict(reduction=reduction, logit_scale=S, softcap=C, return_lse=True,
              return_entropy=True)
    out = cross_entropy(z, y, **kw)
    assert out._fields == ("loss", "lse", "entropy")
    rloss, rlse, rent = reference(z, y, reduction)
    close(out.loss, rloss)
    close(out.lse, rlse)
    close(out.entropy, rent)
    grad = jax.grad(lambda z: combine(*cross_entropy(z, y, **kw)))
    g = (jax.jit(grad) if jit else grad)(z)
    close(g, jax.grad(lambda z: combine(*reference(z, y, reduction)))(z))
    assert np.asarray(g[1]).any()  # an ignored row: lse's and the entropy's terms


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("which", [1, 2])
def test_one_output_alone(which, reduction):
    """lse alone (fce_backward with grad_lse), the entropy alone (fce_forward)."""
    z, y = inputs(seed=1)
    g = jax.grad(lambda z: cross_entropy(z, y, reduction=reduction, logit_scale=S, softcap=C,
                                         return_lse=True, return_entropy=True)[which].sum())(z)
    close(g, jax.grad(lambda z: reference(z, y, reduction)[which].sum())(z))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_grad(bias, reduction):
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.standard_normal((10, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((29, 8)) / 2, jnp.float32)
    b = jnp.asarray(rng.standard_normal(29), jnp.float32) if bias else None
    _, y = inputs(n=10, v=29, seed=3)

    def f(h, w, b):
        return combine(*linear_cross_entropy(h, w, y, b, reduction=reduction, logit_scale=S,
                                             softcap=C, return_lse=True, return_entropy=True))

    def ref(h, w, b):
        return combine(*reference(matmul_t(h, w) + (b if b is not None else 0.0), y, reduction))

    argnums = (0, 1, 2) if bias else (0, 1)
    for a, r in zip(jax.jit(jax.grad(f, argnums))(h, w, b), jax.grad(ref, argnums)(h, w, b)):
        close(a, r, LIN_TOL)


def test_linear_lse_only_hidden():
    """mean, only hidden differentiated, only lse with a cotangent: the recompute with the
    loss's cotangent 0."""
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.standard_normal((7, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((13, 6)), jnp.float32)
    _, y = inputs(n=7, v=13, seed=5)
    g = jax.grad(lambda h: (linear_cross_entropy(h, w, y, return_lse=True).lse ** 2).sum())(h)
    r = jax.grad(lambda h: (reference(matmul_t(h, w), y, "mean", 1.0, 0.0)[1] ** 2).sum())(h)
    close(g, r, LIN_TOL)


def test_z_loss_from_returned_lse():
    z, y = inputs(seed=6)
    valid = y != -100

    def f(z):
        loss, lse = cross_entropy(z, y, return_lse=True)
        return loss + 1e-2 * jnp.sum(jnp.where(valid, lse ** 2, 0.0)) / valid.sum()

    close(jax.grad(f)(z), jax.grad(lambda z: cross_entropy(z, y, z_loss=1e-2))(z))
