"""What the NumPy binding's tests share: the sizes, the option sets, the inputs and the
comparison against the float64 reference (fce_reference.py)."""

import numpy as np

try:
    import ml_dtypes
except ImportError:  # the raw-uint16 path is tested either way
    ml_dtypes = None

V, N = 97, 24
REDUCTIONS = ["mean", "sum", "none"]


def _weights(v, seed=5):
    return np.random.default_rng(seed).uniform(0.2, 2.0, v).astype(np.float32)


OPTION_SETS = {
    "plain": {},
    "class_weights": {"class_weights": _weights(V)},
    "label_smoothing": {"label_smoothing": 0.1},
    "smoothing+weights": {"label_smoothing": 0.2, "class_weights": _weights(V)},
    "z_loss": {"z_loss_scale": 1e-3},
    "softcap": {"softcap": 15.0},
    "logit_scale": {"logit_scale": 0.37},
    "ignore_index=3": {"ignore_index": 3},
    "shift": {"shift_seq_len": 6},
    "everything": {"class_weights": _weights(V), "label_smoothing": 0.1, "z_loss_scale": 1e-4,
                   "softcap": 20.0, "logit_scale": 1.5, "ignore_index": 5, "shift_seq_len": 4},
    # version 0.3
    "shift=3": {"shift_seq_len": 6, "shift": 3},
    "token_scaling": {"token_scaling": True},
    "token_scaling+z_loss+weights": {"token_scaling": True, "z_loss_scale": 1e-3,
                                     "class_weights": _weights(V), "label_smoothing": 0.1},
    "everything-0.3": {"class_weights": _weights(V), "label_smoothing": 0.1,
                       "z_loss_scale": 1e-3, "softcap": 20.0, "logit_scale": -1.5,
                       "ignore_index": 5, "shift_seq_len": 8, "shift": 2, "token_scaling": True},
}


def make_inputs(n=N, v=V, std=1.0, seed=0, ignore_index=-100, target_dtype=np.int64):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((n, v)) * std).astype(np.float32)
    y = rng.integers(0, v, n).astype(target_dtype)
    y[1::5] = ignore_index
    return z, y


def poison(shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype=dtype)


def assert_close(actual, ref, rtol, what=""):
    """Element-wise |a - r| <= rtol * (|r| + max|r|): a relative error bound scaled to the
    array's magnitude (docs/semantics.md: relative error <= 1e-5 for float32)."""
    actual = np.asarray(actual, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert actual.shape == ref.shape, (what, actual.shape, ref.shape)
    assert not np.isnan(actual[np.isfinite(ref)]).any(), f"{what}: NaN where ref is finite"
    scale = np.max(np.abs(ref[np.isfinite(ref)])) if np.isfinite(ref).any() else 1.0
    np.testing.assert_allclose(actual, ref, rtol=rtol, atol=rtol * max(scale, 1e-30),
                               err_msg=what)


LIN_N, LIN_D, LIN_V = 20, 24, 67


def make_linear(seed=0, dtype=np.float32, std=1.0, bias=True):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((LIN_N, LIN_D)) * std).astype(dtype)
    W = (rng.standard_normal((LIN_V, LIN_D)) / np.sqrt(LIN_D)).astype(dtype)
    b = (rng.standard_normal(LIN_V) * 0.1).astype(dtype) if bias else None
    y = rng.integers(0, LIN_V, LIN_N).astype(np.int64)
    y[2::7] = -100
    return h, W, b, y
