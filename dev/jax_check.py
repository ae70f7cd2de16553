"""fusedce.jax on a device: values and gradients of cross_entropy and linear_cross_entropy
under jax.jit, in float32 and bfloat16, against optax-style reference code in float64, and a
jitted SGD training step of a small head against the same step in float64. Writes
dev/results/jax-<device>.json (and prints it).

    FUSEDCE_LIBRARY=build/libfusedce.so PYTHONPATH=bindings/python python3 dev/jax_check.py

The shim (libfusedce_jax.so) is built on first use with the C++ compiler and the installed
jaxlib's FFI headers (cached in ~/.cache/fusedce/jax), or taken from FUSEDCE_JAX_LIBRARY.
On a machine without a GPU it runs the same checks at small sizes on the CPU backend
(``--small``, implied), writing jax-cpu-<machine>.json. Exit status 1 when a check fails.

Errors: for a loss, |fused - ref| / |ref|; for a gradient, max |fused - ref| / max |ref| (the
error relative to the array's scale). Tolerances: float32 1e-5 (loss) / 1e-4 (gradient);
bfloat16 inputs (the reference gets the same rounded inputs): 1e-5 / 1e-2 for cross_entropy
(float32 math inside, the gradient rounded once to bfloat16), 2e-2 / 3e-2 for the fused linear
layer (its products are bfloat16 matmuls with float32 accumulation).
"""

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

try:
    import optax  # noqa: E402
except ImportError:  # the same formula, written out
    optax = None

import fusedce  # noqa: E402
from fusedce import jax_ffi  # noqa: E402
from fusedce.jax import cross_entropy, linear_cross_entropy, register  # noqa: E402

F64 = jnp.float64
TOL = {"float32": {"ce": (1e-5, 1e-4), "linear": (1e-5, 1e-4)},
       "bfloat16": {"ce": (1e-5, 1e-2), "linear": (2e-2, 3e-2)}}


# ------------------------------------------------------------------ float64 reference ----
def _nll(a, y):
    """-log softmax(a)[y], as optax.softmax_cross_entropy_with_integer_labels."""
    if optax is not None:
        return optax.softmax_cross_entropy_with_integer_labels(a, y)
    lse = jax.nn.logsumexp(a, axis=-1)
    return lse - jnp.take_along_axis(a, y[:, None], axis=-1)[:, 0]


def ref_ce(z, y, *, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
           softcap=0.0, logit_scale=1.0):
    """The loss in float64 (optax's NLL, label smoothing as uniform mixing, PaLM's z-loss)."""
    a = z.astype(F64) * logit_scale
    if softcap > 0:
        a = softcap * jnp.tanh(a / softcap)
    valid = y != ignore_index
    yc = jnp.where(valid, y, 0)
    lse = jax.nn.logsumexp(a, axis=-1)
    rows = ((1 - label_smoothing) * _nll(a, yc) + label_smoothing * (lse - a.mean(-1))
            + z_loss * lse ** 2)
    rows = jnp.where(valid, rows, 0.0)
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / jnp.maximum(valid.sum(), 1)


def ref_linear(h, w, y, b=None, **kw):
    z = h.astype(F64) @ w.astype(F64).T
    if b is not None:
        z = z + b.astype(F64)
    return ref_ce(z, y, **kw)


# -------------------------------------------------------------------------- helpers ----
def rel(a, r):
    a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
    return float(np.max(np.abs(a - r)) / max(np.max(np.abs(r)), 1e-30))


def median_ms(fn, *args, reps=10):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def device_tag():
    d = jax.devices()[0]
    if d.platform == "gpu":
        return d.device_kind.replace(" ", "-")
    return "cpu-" + platform.machine()


# --------------------------------------------------------------------------- checks ----
CE_CASES = [
    ("plain", {}),
    ("smoothing+z_loss", {"label_smoothing": 0.1, "z_loss": 1e-4}),
    ("softcap+scale+ignore", {"softcap": 30.0, "logit_scale": 0.5, "ignore_index": 7}),
]


def check_ce(n, v, dtype, reduction, name, opts, seed):
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    z = (jax.random.normal(k1, (n, v), jnp.float32) * 2.0).astype(dtype)
    y = jax.random.randint(k2, (n,), 0, v).at[::9].set(opts.get("ignore_index", -100))
    ct = (jax.random.uniform(k3, (n,), jnp.float32, -1, 1) if reduction == "none"
          else jnp.float32(0.7))

    @jax.jit
    def fused(z, y, ct):
        loss, vjp = jax.vjp(lambda z: cross_entropy(z, y, reduction=reduction, **opts), z)
        return loss, vjp(ct)[0]

    @jax.jit
    def reference(z, y, ct):
        loss, vjp = jax.vjp(lambda z: ref_ce(z, y, reduction=reduction, **opts), z)
        return loss, vjp(ct.astype(F64))[0]

    loss, grad = fused(z, y, ct)
    rloss, rgrad = reference(z.astype(F64), y, ct)
    tl, tg = TOL[jnp.dtype(dtype).name]["ce"]
    el, eg = rel(loss, rloss), rel(grad.astype(jnp.float32), rgrad)
    # jax.grad of the loss itself (upstream exactly 1: fce_backward_rescale does nothing)
    g1 = jax.jit(jax.grad(lambda z: cross_entropy(z, y, **opts)))(z)
    rg1 = jax.jit(jax.grad(lambda z: ref_ce(z, y, **opts)))(z.astype(F64))
    eg1 = rel(g1.astype(jnp.float32), rg1)
    rec = dict(kind="cross_entropy", case=name, dtype=jnp.dtype(dtype).name,
               reduction=reduction, rows=n, vocab=v, options=opts, loss=float(np.sum(loss)),
               loss_rel_err=el, grad_rel_err=eg, grad_upstream1_rel_err=eg1,
               grad_dtype=str(grad.dtype), tol=[tl, tg],
               ok=bool(el <= tl and eg <= tg and eg1 <= tg and grad.dtype == z.dtype))
    return rec


def check_linear(n, d, v, dtype, reduction, bias, seed):
    key = jax.random.PRNGKey(seed)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    h = jax.random.normal(k1, (n, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(k2, (v, d), jnp.float32) / np.sqrt(d)).astype(dtype)
    b = (jax.random.normal(k3, (v,), jnp.float32) * 0.1).astype(dtype) if bias else None
    y = jax.random.randint(k4, (n,), 0, v).at[::11].set(-100)
    ct = (jax.random.uniform(k5, (n,), jnp.float32, -1, 1) if reduction == "none"
          else jnp.float32(1.0))
    opts = dict(reduction=reduction, z_loss=1e-4, label_smoothing=0.05)
    args = (h, w, b) if bias else (h, w)

    def fused_fn(*a):
        return linear_cross_entropy(a[0], a[1], y, a[2] if bias else None, **opts)

    def ref_fn(*a):
        return ref_linear(a[0], a[1], y, a[2] if bias else None, **opts)

    @jax.jit
    def fused(args, ct):
        loss, vjp = jax.vjp(fused_fn, *args)
        return loss, vjp(ct)

    @jax.jit
    def reference(args, ct):
        loss, vjp = jax.vjp(ref_fn, *args)
        return loss, vjp(ct.astype(F64))

    loss, grads = fused(args, ct)
    rloss, rgrads = reference(tuple(a.astype(F64) for a in args), ct)
    tl, tg = TOL[jnp.dtype(dtype).name]["linear"]
    el = rel(loss, rloss)
    errs = [rel(g.astype(jnp.float32), r) for g, r in zip(grads, rgrads)]
    names = ["grad_hidden_rel_err", "grad_weight_rel_err", "grad_bias_rel_err"]
    rec = dict(kind="linear_cross_entropy", dtype=jnp.dtype(dtype).name, reduction=reduction,
               bias=bias, rows=n, hidden=d, vocab=v, options=opts, loss=float(np.sum(loss)),
               loss_rel_err=el, tol=[tl, tg],
               ok=bool(el <= tl and all(e <= tg for e in errs)
                       and all(g.dtype == a.dtype for g, a in zip(grads, args))))
    rec.update(dict(zip(names, errs)))
    return rec


def check_training(n, d_in, d, v, dtype, steps=5, lr=0.5, seed=3):
    """SGD on a small head: x -> tanh(x @ proj) -> (cast to dtype) -> linear CE against y. The
    parameters are float32 (the master copy); the reference runs the same steps in float64."""
    key = jax.random.PRNGKey(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    params = {"proj": jax.random.normal(k1, (d_in, d), jnp.float32) / np.sqrt(d_in),
              "head": jax.random.normal(k2, (v, d), jnp.float32) / np.sqrt(d)}
    x = jax.random.normal(k3, (n, d_in), jnp.float32)
    y = jax.random.randint(k4, (n,), 0, v).at[::13].set(-100)

    def fused_loss(p):
        hid = jnp.tanh(x @ p["proj"]).astype(dtype)
        return linear_cross_entropy(hid, p["head"].astype(dtype), y, z_loss=1e-4)

    def fused_ce_loss(p):  # the logits formed by XLA, the loss by fusedce
        hid = jnp.tanh(x @ p["proj"]).astype(dtype)
        return cross_entropy(hid @ p["head"].astype(dtype).T, y, z_loss=1e-4)

    def ref_loss(p):
        hid = jnp.tanh(x.astype(F64) @ p["proj"])
        if dtype != jnp.float32:  # the same rounding of the inputs of the head
            hid = hid.astype(dtype).astype(F64)
            head = p["head"].astype(dtype).astype(F64)
        else:
            head = p["head"]
        return ref_linear(hid, head, y, z_loss=1e-4)

    def sgd(loss_fn):
        @jax.jit
        def step(p):
            loss, g = jax.value_and_grad(loss_fn)(p)
            return loss, jax.tree_util.tree_map(lambda a, b: a - lr * b.astype(a.dtype), p, g)
        return step

    out = {}
    ref_p = jax.tree_util.tree_map(lambda a: a.astype(F64), params)
    ref_step = sgd(ref_loss)
    ref_hist = []
    for _ in range(steps):
        loss, ref_p = ref_step(ref_p)
        ref_hist.append(float(loss))
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    ok_all = ref_hist[-1] < ref_hist[0]
    for name, fn in (("linear_cross_entropy", fused_loss), ("cross_entropy", fused_ce_loss)):
        p = params
        step = sgd(fn)
        hist = []
        for _ in range(steps):
            loss, p = step(p)
            hist.append(float(loss))
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(hist, ref_hist))
        param_err = max(rel(p[k], ref_p[k]) for k in p)
        update_err = max(rel(p[k].astype(F64) - params[k], ref_p[k] - params[k]) for k in p)
        ok = bool(hist[-1] < hist[0] and loss_err <= tol and update_err <= 10 * tol)
        ok_all = ok_all and ok
        out[name] = dict(losses=hist, loss_rel_err=loss_err, param_rel_err=param_err,
                         update_rel_err=update_err, ok=ok)
        out[name + "_ms_per_step"] = median_ms(step, params)
    out.update(dict(reference_losses=ref_hist, dtype=jnp.dtype(dtype).name, rows=n, d_in=d_in,
                    hidden=d, vocab=v, steps=steps, lr=lr, tol=tol, ok=bool(ok_all)))
    return out


def timing(n, v, d, dtype):
    """Informational: jitted value_and_grad, fused vs the same loss written in jax.numpy."""
    key = jax.random.PRNGKey(9)
    z = jax.random.normal(key, (n, v), jnp.float32).astype(dtype)
    h = jax.random.normal(key, (n, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(key, (v, d), jnp.float32) / np.sqrt(d)).astype(dtype)
    y = jax.random.randint(key, (n,), 0, v)

    def xla_ce(z):
        a = z.astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(a, -1) - jnp.take_along_axis(a, y[:, None], 1)[:, 0])

    fns = {
        "ce_fused": (jax.jit(jax.value_and_grad(lambda z: cross_entropy(z, y))), (z,)),
        "ce_xla": (jax.jit(jax.value_and_grad(xla_ce)), (z,)),
        "linear_fused": (jax.jit(jax.value_and_grad(
            lambda h, w: linear_cross_entropy(h, w, y), argnums=(0, 1))), (h, w)),
        "linear_xla": (jax.jit(jax.value_and_grad(
            lambda h, w: xla_ce(h @ w.T), argnums=(0, 1))), (h, w)),
    }
    return {k: median_ms(f, *a) for k, (f, a) in fns.items()} | dict(
        rows=n, vocab=v, hidden=d, dtype=jnp.dtype(dtype).name)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="small sizes (implied without a GPU)")
    p.add_argument("--out", help="the JSON file (default dev/results/jax-<device>.json)")
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    small = args.small or not on_gpu
    shim = register()
    n, v = (64, 1000) if small else (4096, 50257)
    ln, ld, lv = (48, 64, 1000) if small else (4096, 2048, 32000)
    records = []
    seed = 0
    for dtype in (jnp.float32, jnp.bfloat16):
        for reduction in ("mean", "sum", "none"):
            for name, opts in CE_CASES:
                seed += 1
                records.append(check_ce(n, v, dtype, reduction, name, opts, seed))
        for reduction in ("mean", "none"):
            for bias in (False, True):
                seed += 1
                records.append(check_linear(ln, ld, lv, dtype, reduction, bias, seed))
    for r in records:
        print(("ok  " if r["ok"] else "FAIL"), r["kind"], r.get("case", ""), r["dtype"],
              r["reduction"], "bias" if r.get("bias") else "",
              "loss %.2e" % r["loss_rel_err"],
              " ".join("%s %.2e" % (k.replace("_rel_err", ""), r[k]) for k in r
                       if k.endswith("rel_err") and k != "loss_rel_err"))
    train = [check_training(*((256, 64, 128, 1000) if small else (4096, 512, 1024, 32000)),
                            dtype=dt) for dt in (jnp.float32, jnp.bfloat16)]
    for t in train:
        print(("ok  " if t["ok"] else "FAIL"), "training", t["dtype"], "reference",
              ["%.5f" % x for x in t["reference_losses"]])
        for k in ("linear_cross_entropy", "cross_entropy"):
            print("     %-22s" % k, ["%.5f" % x for x in t[k]["losses"]],
                  "loss err %.1e update err %.1e, %.2f ms/step" % (
                      t[k]["loss_rel_err"], t[k]["update_rel_err"], t[k + "_ms_per_step"]))
    times = [timing(*((64, 1000, 64) if small else (8192, 128256, 4096)), dtype=jnp.bfloat16)]
    print("timing (ms, jitted value_and_grad):", times)
    import jaxlib
    result = dict(device=device_tag(), jax=jax.__version__, jaxlib=jaxlib.__version__,
                  platform=jax.default_backend(), small=small,
                  fusedce_build=fusedce.build_info(), shim=shim,
                  shim_abi=jax_ffi.SHIM_ABI,  # 2: the workspace is a result of the custom calls
                  optax=getattr(optax, "__version__", None), checks=records, training=train,
                  timing=times, ok=bool(all(r["ok"] for r in records)
                                        and all(t["ok"] for t in train)))
    out = args.out or os.path.join(HERE, "results", "jax-%s.json" % device_tag())
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("%s: %s" % ("all checks passed" if result["ok"] else "SOME CHECKS FAILED", out))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
