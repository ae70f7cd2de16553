"""The vocabulary-parallel distillation from hidden states (fce_vp_linear_distill_*) at the array
level: P simulated ranks in one process (NumPy, CPU backend), each holding its rows of the
student's and the teacher's weights, every round of statistics gathered by hand, the loss from
vp_distill_loss, against the unsharded fusedce.linear_distill (runs in CI: no torch); and
fusedce.torch.distributed.vocab_parallel_linear_distill in one process (CPU and CUDA tensors),
over 2 and 3 processes on gloo and over NCCL (one process per GPU), against
fusedce.torch.linear_distill.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q \\
        bindings/python/tests/test_vp_linear_distill.py

Tests skip with their reason where the library lacks the calls, torch is missing or there is no
CUDA device (or too few for the NCCL processes).
"""

import numpy as np
import pytest

import fusedce
import test_distributed
from fusedce import _lib
from test_distributed import (_close, _shards, _spawn, needs_cuda, needs_gloo, needs_nccl,
                              needs_torch, torch, vp)


def _has_vp_linear_distill():
    try:
        return not _lib.lacks(_lib.VP_DISTILL_SYMBOLS + _lib.VP_LINEAR_DISTILL_SYMBOLS)
    except Exception:  # no library at all
        return False


needs_vp_linear_distill = pytest.mark.skipif(not _has_vp_linear_distill(),
                                             reason="the library lacks fce_vp_linear_distill_*")

ROWS, D, DT = 13, 16, 10


def _inputs(vocab, seed):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((ROWS, D)).astype(np.float32)
    W = (rng.standard_normal((vocab, D)) * 0.5).astype(np.float32)
    th = rng.standard_normal((ROWS, DT)).astype(np.float32)
    tW = (rng.standard_normal((vocab, DT)) * 0.5).astype(np.float32)
    y = rng.integers(0, vocab, ROWS).astype(np.int64)
    y[[1, ROWS // 2]] = -100
    return h, W, th, tW, y


def _step(h, W, th, tW, y, ranks, uneven, g_out, workspace_size="optimal",
          grad_hidden_dtype="float32", **kw):
    """The sharded step: every round's statistics of every rank, gathered; the loss (read from
    the gathered statistics only); each rank's gradients: the partial grad_hidden summed, the
    grad_weight rows concatenated."""
    vocab = W.shape[0]
    shards = _shards(vocab, ranks, uneven)
    rounds = vp.vp_distill_rounds(kw.get("divergence", "forward_kl"), kw.get("beta", 0.5))
    gathered = None
    for rnd in range(1, rounds + 1):
        stats = [vp.vp_linear_distill_stats(h, W[s:s + n], th, tW[s:s + n], gathered,
                                            vocab_start=s, vocab_total=vocab, round=rnd,
                                            workspace_size=workspace_size, **kw)
                 for s, n in shards]
        assert all(st.shape == (ROWS, vp.VP_STATS) and st.dtype == np.float32 for st in stats)
        gathered = np.stack(stats)
    res = vp.vp_distill_loss(gathered, y, vocab_total=vocab, return_lse=True,
                             check_targets=True, **kw)
    grads = [vp.vp_linear_distill_backward(h, W[s:s + n], th, tW[s:s + n], gathered, y, g_out,
                                           vocab_start=s, vocab_total=vocab,
                                           workspace_size=workspace_size,
                                           grad_hidden_dtype=grad_hidden_dtype, **kw)
             for s, n in shards]
    assert all(g.grad_bias is None for g in grads)
    dh = np.sum([g.grad_hidden.astype(np.float64) for g in grads], axis=0)
    dw = np.concatenate([g.grad_weight for g in grads], axis=0)
    return res, dh, dw, grads


@needs_vp_linear_distill
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5),
                                             ("jsd", 0.5)])
def test_matches_linear_distill(ranks, reduction, divergence, beta):
    vocab = 41 if ranks == 3 else 40  # 41 over 3 ranks: shards of unequal widths
    h, W, th, tW, y = _inputs(vocab, seed=ranks)
    kw = dict(divergence=divergence, beta=beta, temperature=1.7, reduction=reduction,
              softcap=20.0, logit_scale=0.9)
    g_out = (np.random.default_rng(3).uniform(0.5, 2.0, ROWS).astype(np.float32)
             if reduction == "none" else 1.7)
    ref = fusedce.linear_distill(h, W, th, tW, y, return_lse=True, return_grad=True,
                                 grad_output=g_out, **kw)
    res, dh, dw, _ = _step(h, W, th, tW, y, ranks, ranks == 3, g_out, **kw)
    _close(res.loss, ref.loss, what="loss")
    _close(res.lse, ref.lse, what="lse")
    _close(dh, ref.grad_hidden, what="summed partial grad_hidden")
    _close(dw, ref.grad_weight, what="grad_weight")


@needs_vp_linear_distill
def test_workspace_sizes_and_gradient_options():
    vocab = 30
    h, W, th, tW, y = _inputs(vocab, seed=7)
    kw = dict(divergence="jsd", beta=0.5, temperature=2.0, reduction="sum")
    lo, hi = vp.vp_linear_distill_stats_workspace_size(ROWS, D, 15, DT, divergence="jsd")
    assert 0 < lo <= hi
    lo, hi = vp.vp_linear_distill_backward_workspace_size(2, ROWS, D, vocab, 15, DT)
    assert 0 < lo <= hi
    best = _step(h, W, th, tW, y, 2, False, 1.0, **kw)
    small = _step(h, W, th, tW, y, 2, False, 1.0, workspace_size="min", **kw)
    # the CPU's chunks do not depend on the workspace: the same bits
    np.testing.assert_array_equal(small[1], best[1])
    np.testing.assert_array_equal(small[2], best[2])
    # grad_hidden in the inputs' dtype (float32 here), weight only, accumulate
    s, n = 0, 15
    gathered = np.stack([vp.vp_linear_distill_stats(h, W[a:a + b], th, tW[a:a + b],
                                                    vocab_start=a, vocab_total=vocab, **kw)
                         for a, b in ((0, 15), (15, 15))])
    gathered = np.stack([vp.vp_linear_distill_stats(h, W[a:a + b], th, tW[a:a + b], gathered,
                                                    vocab_start=a, vocab_total=vocab, **kw)
                         for a, b in ((0, 15), (15, 15))])
    g = vp.vp_linear_distill_backward(h, W[s:s + n], th, tW[s:s + n], gathered, y,
                                      vocab_start=s, vocab_total=vocab, return_grad="weight",
                                      **kw)
    assert g.grad_hidden is None
    _close(g.grad_weight, best[2][s:s + n], what="grad_weight alone")
    acc = np.ones((n, D), np.float32)
    vp.vp_linear_distill_backward(h, W[s:s + n], th, tW[s:s + n], gathered, y, vocab_start=s,
                                  vocab_total=vocab, grad_weight=acc, accumulate=True, **kw)
    _close(acc, best[2][s:s + n] + 1, what="accumulated grad_weight")


@needs_vp_linear_distill
def test_errors():
    vocab = 20
    h, W, th, tW, y = _inputs(vocab, seed=9)
    with pytest.raises(ValueError, match="teacher_weight"):
        vp.vp_linear_distill_stats(h, W[:10], th, tW[:9], vocab_start=0, vocab_total=vocab)
    with pytest.raises(TypeError, match="teacher_hidden has dtype float16"):
        vp.vp_linear_distill_stats(h, W[:10], th.astype(np.float16), tW[:10], vocab_start=0,
                                   vocab_total=vocab)
    with pytest.raises(fusedce.InvalidArgumentError,
                       match="fce_vp_linear_distill_stats: vocab_start"):
        vp.vp_linear_distill_stats(h, W[:10], th, tW[:10], vocab_start=15, vocab_total=vocab)
    with pytest.raises(fusedce.InvalidArgumentError,
                       match="fce_vp_linear_distill_stats: round"):
        vp.vp_linear_distill_stats(h, W[:10], th, tW[:10], vocab_start=0, vocab_total=vocab,
                                   round=2, divergence="forward_kl")
    gathered = np.zeros((2, ROWS, vp.VP_STATS), np.float32)
    with pytest.raises(fusedce.InvalidArgumentError,
                       match="fce_vp_linear_distill_backward: grad_hidden_dtype"):
        vp.vp_linear_distill_backward(h, W[:10], th, tW[:10], gathered, y, vocab_start=0,
                                      vocab_total=vocab, grad_hidden_dtype="float16")


# ============================================================ torch.distributed ====
DIVERGENCES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5)]


def _torch_inputs(dtype, device, seed):
    """hidden [2, 5, D], the student's weight [41, D], the teacher's [2, 5, DT] and [41, DT]
    (41 classes: uneven shards over 2 and 3 ranks), targets [2, 5] with an ignored row: the same
    on every rank."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, ROWS // 2, D, generator=g)
    w = torch.randn(41, D, generator=g) * 0.5
    th = torch.randn(2, ROWS // 2, DT, generator=g)
    tw = torch.randn(41, DT, generator=g) * 0.5
    y = torch.randint(0, 41, (2, ROWS // 2), generator=g)
    y[0, 1] = -100
    return [x.to(dtype).to(device) for x in (h, w, th, tw)] + [y.to(device)]


def _normwise(actual, expected, tol, what):
    """Norm-wise relative error within tol (the library's tests' comparison)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    err, ref = float(torch.linalg.vector_norm(a - e)), float(torch.linalg.vector_norm(e))
    assert err <= tol * ref or err == ref == 0, (
        f"{what}: norm-wise relative error {err / ref if ref else err} > {tol}")


def _tolerances(dtype, device, h, w, th, tw):
    """(loss and lse, gradients) bounds against fusedce.torch.linear_distill for computations in
    ``dtype``: those of tests/test_vp_linear_distill.cpp. On the CPU both calls make float32
    logits; on CUDA the GEMMs of the whole weight and of a shard differ (TF32; logits in the
    16-bit dtype, which moves the loss by up to u·max|z| relative, z both models' logits)."""
    if str(device) == "cpu":
        return 2e-5, (2e-5 if dtype == torch.float32 else 1.5e-2)
    if dtype == torch.float32:
        return 2e-3, 2e-3
    zmax = max(float((a.double() @ b.double().T).abs().max()) for a, b in ((h, w), (th, tw)))
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    return u * (4 + 4 * zmax), 8 * u


def _check_torch(group, rank, size, *, divergence, beta, reduction, dtype, seed, device="cpu",
                 **extra):
    """fusedce.torch.distributed.vocab_parallel_linear_distill with this rank's rows of both
    weights against fusedce.torch.linear_distill over the whole vocabulary (every rank makes the
    same inputs): the loss (the same bits on every rank), lse, the full ∂hidden and the gradient
    of this rank's weight rows, for an upstream gradient other than 1."""
    from fusedce.torch import linear_distill
    from fusedce.torch.distributed import vocab_parallel_linear_distill
    h, w, th, tw, y = _torch_inputs(dtype, device, seed)
    vocab = w.shape[0]
    kw = dict(divergence=divergence, beta=beta, temperature=2.0, reduction=reduction)
    hw, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = linear_distill(hw, ww, th, tw, target=y, **kw)
    g = torch.Generator().manual_seed(seed + 100)
    up = (torch.rand(ref.shape, generator=g) + 0.5).to(device)
    (ref * up).sum().backward()
    s, n = vp.shard_range(vocab, rank, size)  # uneven: 41 classes
    hm, wm = h.clone().requires_grad_(True), w[s:s + n].clone().requires_grad_(True)
    loss, lse = vocab_parallel_linear_distill(hm, wm, th, tw[s:s + n], y, group=group,
                                              vocab_start=s, vocab_total=vocab, return_lse=True,
                                              **kw, **extra)
    (loss * up).sum().backward()
    z = h.double() @ w.double().T
    ltol, gtol = _tolerances(dtype, device, h, w, th, tw)
    what = f"{divergence} {reduction} {dtype} {device} on {size} rank(s)"
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    _normwise(loss, ref, ltol, "loss " + what)
    assert lse.shape == y.shape and lse.dtype == torch.float32 and not lse.requires_grad
    _normwise(lse, torch.logsumexp(z / 2.0, -1), ltol, "lse " + what)
    assert hm.grad.dtype == dtype and wm.grad.dtype == dtype
    _normwise(hm.grad, hw.grad, gtol, "grad of hidden " + what)
    _normwise(wm.grad, ww.grad[s:s + n], gtol, "grad of the weight rows " + what)
    assert th.grad is None and tw.grad is None
    if group is not None:  # bitwise the same loss on every rank
        test_distributed._same_on_every_rank(loss.detach(), group)


def _cases_linear_distill(group, rank, size):
    device = test_distributed.DEV  # cuda:<rank> in the NCCL workers
    seed = 0
    for dtype in (torch.float32, torch.bfloat16):
        for divergence, beta in DIVERGENCES:
            for reduction in ("mean", "sum", "none"):
                seed += 1
                _check_torch(group, rank, size, divergence=divergence, beta=beta,
                             reduction=reduction, dtype=dtype, seed=seed, device=device)


CASES = {"linear_distill": _cases_linear_distill}
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@needs_vp_linear_distill
@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
def test_torch_single_process(device, dtype, reduction, divergence, beta):
    """Without torch.distributed (group None): one rank holding the whole vocabulary."""
    _check_torch(None, 0, 1, divergence=divergence, beta=beta, reduction=reduction,
                 dtype=getattr(torch, dtype), seed=7, device=device)


@needs_vp_linear_distill
@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_torch_options(device):
    """The smallest workspace, softcap and logit_scale, no targets, reduce_grad_hidden=False
    (one rank: the same gradient), a gradient for the weight only; autocast (a float32 weight
    gets a float32 gradient, as linear_distill's); without a gradient, the forward alone; the
    arguments' checks."""
    from fusedce.torch import linear_distill
    from fusedce.torch.distributed import vocab_parallel_linear_distill as vpld
    h, w, th, tw, y = _torch_inputs(torch.float32, device, 3)
    kw = dict(divergence="jsd", beta=0.3, temperature=1.5, softcap=8.0, logit_scale=0.9)
    hw, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = linear_distill(hw, ww, th, tw, **kw)
    ref.backward()
    tol = 2e-5 if device == "cpu" else 2e-3
    for opts in (dict(workspace_bytes=0), dict(reduce_grad_hidden=False)):
        hm, wm = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = vpld(hm, wm, th, tw, **kw, **opts)
        loss.backward()
        _normwise(loss, ref, tol, f"loss {opts}")
        _normwise(hm.grad, hw.grad, tol, f"grad of hidden {opts}")
        _normwise(wm.grad, ww.grad, tol, f"grad of the weight {opts}")
    wm = w.clone().requires_grad_(True)
    vpld(h, wm, th, tw, **kw).backward()
    _normwise(wm.grad, ww.grad, tol, "grad of the weight alone")
    with torch.no_grad():
        _normwise(vpld(h, w, th, tw, target=y, reduction="none", **kw),
                  linear_distill(h, w, th, tw, target=y, reduction="none", **kw), tol,
                  "loss without a gradient")
    with torch.autocast(device, dtype=torch.bfloat16):
        hw, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ref = linear_distill(hw, ww, th, tw, target=y, **kw)
        hm, wm = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = vpld(hm, wm, th, tw, y, **kw)
    ref.backward()
    loss.backward()
    assert wm.grad.dtype == torch.float32 and hm.grad.dtype == torch.float32
    ltol, gtol = _tolerances(torch.bfloat16, device, h, w, th, tw)
    _normwise(loss, ref, ltol, "loss under autocast")
    _normwise(hm.grad, hw.grad, gtol, "grad of hidden under autocast")
    _normwise(wm.grad, ww.grad, gtol, "grad of the weight under autocast")
    with pytest.raises(ValueError, match="teacher_weight_shard must be"):
        vpld(h, w, th, tw[:-1])
    with pytest.raises(ValueError, match="teacher_hidden must be"):
        vpld(h, w, th[:1], tw)
    with pytest.raises(ValueError, match="weight_shard must be"):
        vpld(h, w[:, :-1], th, tw)
    with pytest.raises(TypeError, match="weight_shard has dtype"):
        vpld(h, w.to(torch.bfloat16), th, tw)


@needs_vp_linear_distill
@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_torch_gloo_processes(world, tmp_path, monkeypatch):
    """Over `world` gloo processes (CPU tensors): uneven shards of 41 classes."""
    _spawn(world, "gloo", ("linear_distill",), tmp_path, monkeypatch, module=__name__)


@needs_vp_linear_distill
@needs_nccl
@pytest.mark.parametrize("world", [1, 2])
def test_torch_nccl_processes(world, tmp_path, monkeypatch):
    """Over NCCL, one process per GPU (CUDA tensors, the CUDA backend, the collectives on the
    current stream)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    _spawn(world, "nccl", ("linear_distill",), tmp_path, monkeypatch, module=__name__)
