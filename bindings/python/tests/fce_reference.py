"""An independent float64 NumPy reference of SPEC.md / lib/SEMANTICS.md, written from the
formulas (not from the library), for the binding's tests."""

import numpy as np


def row_targets(targets, rows, ignore_index=-100, shift_seq_len=0):
    """The target each row is scored against (ignore_index for shifted-out rows)."""
    y = np.asarray(targets, dtype=np.int64).copy()
    if shift_seq_len:
        t = shift_seq_len
        shifted = np.full(rows, ignore_index, dtype=np.int64)
        for r in range(rows):
            if r % t != t - 1:
                shifted[r] = y[r + 1]
        y = shifted
    return y


def cross_entropy(logits, targets, *, reduction="mean", ignore_index=-100, class_weights=None,
                  label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0, logit_scale=1.0,
                  shift_seq_len=0, grad_output=None):
    """Returns dict(loss, lse, z_loss, grad) in float64. grad is d(loss)/d(logits) scaled by
    grad_output (a float, or [rows] for none; default 1)."""
    z = np.asarray(logits, dtype=np.float64)
    n, v = z.shape
    s, c, eps, lam = float(logit_scale), float(softcap), float(label_smoothing), float(z_loss_scale)
    a = s * z
    if c > 0:
        a = c * np.tanh(a / c)
    m = a.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = (m + np.log(np.exp(a - m).sum(axis=1, keepdims=True)))[:, 0]
    w = (np.ones(v) if class_weights is None
         else np.asarray(class_weights, dtype=np.float64))
    y = row_targets(targets, n, ignore_index, shift_seq_len)
    ignored = y == ignore_index
    invalid = ~ignored & ((y < 0) | (y >= v))
    valid = ~ignored & ~invalid
    rows = np.arange(n)
    yc = np.where(valid, y, 0)
    wy = np.where(valid, w[yc], 0.0)
    ce = ((1 - eps) * wy * (lse - a[rows, yc])
          + (eps / v) * (w[None, :] * (lse[:, None] - a)).sum(axis=1))
    loss_rows = np.where(valid, ce + lam * lse ** 2, 0.0)
    loss_rows[invalid] = np.nan
    zl_rows = np.where(valid | invalid, lam * lse ** 2, 0.0)
    denom = wy.sum() + invalid.sum()

    if reduction == "none":
        loss = loss_rows
        z_loss = zl_rows.sum()
    elif reduction == "sum":
        loss = loss_rows.sum()
        z_loss = zl_rows.sum()
    else:
        loss = loss_rows.sum() / denom if denom != 0 else 0.0
        z_loss = zl_rows.sum() / denom if denom != 0 else 0.0

    # gradient
    g = 1.0 if grad_output is None else grad_output
    if reduction == "none":
        k = np.broadcast_to(np.asarray(g, dtype=np.float64), (n,))
    elif reduction == "sum":
        k = np.full(n, float(g))
    else:
        k = np.full(n, float(g) / denom if denom != 0 else 0.0)
    p = np.exp(a - lse[:, None])
    onehot = np.zeros_like(a)
    onehot[rows[valid], yc[valid]] = 1.0
    da = ((1 - eps) * wy[:, None] * (p - onehot)
          + (eps / v) * (w.sum() * p - w[None, :])
          + 2 * lam * lse[:, None] * p)
    dz = k[:, None] * da * s
    if c > 0:
        dz = dz * (1 - (a / c) ** 2)
    dz[ignored] = 0.0
    dz[invalid] = np.nan
    return dict(loss=loss, lse=lse, z_loss=z_loss, grad=dz)


def linear_cross_entropy(hidden, weight, targets, bias=None, grad_output=None, **options):
    """dict(loss, lse, z_loss, grad_hidden, grad_weight, grad_bias), float64."""
    h = np.asarray(hidden, dtype=np.float64)
    W = np.asarray(weight, dtype=np.float64)
    z = h @ W.T
    if bias is not None:
        z = z + np.asarray(bias, dtype=np.float64)[None, :]
    r = cross_entropy(z, targets, grad_output=grad_output, **options)
    dz = r["grad"]
    return dict(loss=r["loss"], lse=r["lse"], z_loss=r["z_loss"], grad_hidden=dz @ W,
                grad_weight=dz.T @ h, grad_bias=dz.sum(axis=0))
