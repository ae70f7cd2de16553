"""An independent float64 NumPy reference of docs/semantics.md, written from the
formulas (not from the library), for the binding's tests."""

import numpy as np


def row_targets(targets, rows, ignore_index=-100, shift_seq_len=0, shift=0):
    """The target each row is scored against (ignore_index for shifted-out rows): with T =
    shift_seq_len > 0 and k = shift (0 meaning 1), row r = b*T+t takes targets[r + k] when
    t < T - k (docs/semantics.md rule 1)."""
    y = np.asarray(targets, dtype=np.int64).copy()
    if shift_seq_len:
        t, k = shift_seq_len, max(shift, 1)
        shifted = np.full(rows, ignore_index, dtype=np.int64)
        for r in range(rows):
            if r % t < t - k:
                shifted[r] = y[r + k]
        y = shifted
    return y


def cross_entropy(logits, targets, *, reduction="mean", ignore_index=-100, class_weights=None,
                  label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0, logit_scale=1.0,
                  shift_seq_len=0, shift=0, token_scaling=False, grad_output=None):
    """Returns dict(loss, lse, z_loss, grad, argmax, accuracy) in float64 (argmax int64).
    grad is d(loss)/d(logits) scaled by grad_output (a float, or [rows] for none; default 1),
    with token scaling's p_y treated as a constant."""
    z = np.asarray(logits, dtype=np.float64)
    n, v = z.shape
    s, c, eps, lam = float(logit_scale), float(softcap), float(label_smoothing), float(z_loss_scale)
    a = s * z
    if c > 0:
        a = c * np.tanh(a / c)
    # m and log s kept apart (rule 9): exact on rows sharing a huge offset, where lse = m + log s
    # rounds log s away even in float64
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = a.max(axis=1, keepdims=True)  # NaN when the row holds one
        d = a - m                         # a - m (NaN everywhere on an all -inf row)
        log_s = np.log(np.exp(d).sum(axis=1, keepdims=True))
        lse = np.where(m[:, 0] == -np.inf, -np.inf, (m + log_s)[:, 0])  # rule 10
    w = (np.ones(v) if class_weights is None
         else np.asarray(class_weights, dtype=np.float64))
    y = row_targets(targets, n, ignore_index, shift_seq_len, shift)
    ignored = y == ignore_index
    invalid = ~ignored & ((y < 0) | (y >= v))
    valid = ~ignored & ~invalid
    rows = np.arange(n)
    yc = np.where(valid, y, 0)
    wy = np.where(valid, w[yc], 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(d - log_s)
    # token scaling: t = p_y for valid rows (a constant), 1 otherwise (rules 8, 9)
    t = np.where(valid, p[rows, yc], 1.0) if token_scaling else np.ones(n)
    with np.errstate(invalid="ignore", over="ignore"):
        ce = ((1 - eps) * wy * (log_s[:, 0] - d[rows, yc])
              + (eps / v) * (w[None, :] * (log_s - d)).sum(axis=1))
    zl = lam * lse ** 2
    loss_rows = np.where(valid, t * (ce + zl), 0.0)
    loss_rows[invalid] = np.nan
    zl_rows = np.where(valid, t * zl, np.where(invalid, zl, 0.0))
    denom = wy.sum() + invalid.sum()   # D (rule 4)
    count = valid.sum() + invalid.sum()  # n

    if reduction == "none":
        loss = loss_rows
        z_loss = zl_rows.sum()
    elif reduction == "sum":
        loss = loss_rows.sum()
        z_loss = zl_rows.sum()
    else:  # rule 5: the CE terms over D, the z-loss terms over n
        ce_rows = np.where(valid, t * ce, 0.0)
        ce_rows[invalid] = np.nan
        loss = ((ce_rows.sum() / denom if denom != 0 else 0.0)
                + (np.where(valid, t * zl, 0.0).sum() / count if count != 0 else 0.0))
        if invalid.any():
            loss = np.nan
        z_loss = zl_rows.sum() / count if count != 0 else 0.0

    # gradient (rules 6, 9)
    g = 1.0 if grad_output is None else grad_output
    if reduction == "none":
        k = np.broadcast_to(np.asarray(g, dtype=np.float64), (n,))
        kz = k
    elif reduction == "sum":
        k = kz = np.full(n, float(g))
    else:
        k = np.full(n, float(g) / denom if denom != 0 else 0.0)
        kz = np.full(n, float(g) / count if count != 0 else 0.0)
    onehot = np.zeros_like(a)
    onehot[rows[valid], yc[valid]] = 1.0
    dce = ((1 - eps) * wy[:, None] * (p - onehot)
           + (eps / v) * (w.sum() * p - w[None, :]))
    dzl = 2 * lam * lse[:, None] * p
    dz = t[:, None] * (k[:, None] * dce + kz[:, None] * dzl) * s
    if c > 0:
        dz = dz * (1 - (a / c) ** 2)
    dz[ignored] = 0.0
    dz[invalid] = np.nan

    # argmax and accuracy (rule 15): NaN counts as the largest, lowest index among equals
    am = np.where(np.isnan(a).any(axis=1), np.argmax(np.isnan(a), axis=1), np.argmax(a, axis=1))
    am = np.where(ignored, -1, am).astype(np.int64)
    correct = valid & (am == y)
    if reduction == "none":
        accuracy = correct.astype(np.float64)
    else:
        accuracy = correct.sum() / count if count != 0 else 0.0
    return dict(loss=loss, lse=lse, z_loss=z_loss, grad=dz, argmax=am, accuracy=accuracy)


def linear_cross_entropy(hidden, weight, targets, bias=None, grad_output=None, **options):
    """dict(loss, lse, z_loss, grad_hidden, grad_weight, grad_bias, argmax, accuracy), float64."""
    h = np.asarray(hidden, dtype=np.float64)
    W = np.asarray(weight, dtype=np.float64)
    z = h @ W.T
    if bias is not None:
        z = z + np.asarray(bias, dtype=np.float64)[None, :]
    r = cross_entropy(z, targets, grad_output=grad_output, **options)
    dz = r["grad"]
    return dict(loss=r["loss"], lse=r["lse"], z_loss=r["z_loss"], grad_hidden=dz @ W,
                grad_weight=dz.T @ h, grad_bias=dz.sum(axis=0), argmax=r["argmax"],
                accuracy=r["accuracy"])
