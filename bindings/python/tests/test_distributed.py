"""The vocabulary-parallel calls (libfusedce 0.4, fce_vp_*): the array-level phase API with P
simulated shards in one process (NumPy, CPU backend; torch CUDA tensors when a device is
there), and fusedce.torch.distributed over real process groups: 2 and 4 processes on gloo (CPU
tensors, the CPU backend), one process on NCCL (a GPU), two on NCCL when there are two GPUs.
Every result is compared with the unsharded call (fusedce.forward / linear_ce,
fusedce.torch.cross_entropy / linear_cross_entropy) and with torch.nn.functional.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q \
        bindings/python/tests/test_distributed.py

Tests skip with their reason where torch, CUDA or a 0.4 library is missing.
"""

import ctypes
import datetime
import importlib
import os
import sys

import numpy as np
import pytest

import fusedce
from fusedce import _lib

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
except Exception:  # pragma: no cover - depends on the environment
    torch = None


def _has_vp():
    try:
        return _lib.has_vp()
    except Exception:
        return False


def _has_vp_linear_ce():
    try:
        return _lib.has_vp_linear_ce()
    except Exception:
        return False


needs_vp = pytest.mark.skipif(
    not _has_vp(), reason="the loaded libfusedce has no vocabulary-parallel calls (needs 0.4)")
needs_vp_linear_ce = pytest.mark.skipif(
    not _has_vp_linear_ce(), reason="the loaded libfusedce has no fce_vp_linear_ce (needs 0.5)")
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
needs_gloo = pytest.mark.skipif(
    torch is None or not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available")
HAS_CUDA = torch is not None and torch.cuda.is_available() and fusedce.cuda_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device, or libfusedce was built without the CUDA backend")
needs_nccl = pytest.mark.skipif(
    not HAS_CUDA or not (dist.is_available() and dist.is_nccl_available()),
    reason="no CUDA device or no NCCL in torch.distributed")

from fusedce import vocab_parallel as vp  # noqa: E402 (loads nothing: the library is lazy)


# ============================================================ array level (NumPy) ====
def _shards(vocab, ranks, uneven):
    return [vp.shard_range(vocab, r, ranks, equal=not uneven) for r in range(ranks)]


def _inputs(rows, vocab, seed=0, ignore=True):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    y = rng.integers(0, vocab, rows).astype(np.int64)
    if ignore:
        y[1] = -100
        y[rows // 2] = -100
    return z, y


def _close(actual, expected, rtol=2e-5, what=""):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(np.max(np.abs(expected[np.isfinite(expected)]), initial=0.0), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


OPTION_SETS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "weights": {"label_smoothing": 0.05, "class_weights": True},
    "zloss-softcap-scale": {"z_loss_scale": 1e-3, "softcap": 4.0, "logit_scale": 0.7},
    "shift-tokenscaling": {"shift_seq_len": 6, "shift": 2, "token_scaling": True,
                           "z_loss_scale": 1e-2},
}


# ============================================ fusedce.torch.distributed, processes ====
DEV = "cpu"  # the device of the tensors the cases make: cuda:<rank> in the NCCL workers


def _tol(dtype):
    return 2e-5 if dtype == torch.float32 else 1.5e-2


def _assert_close(actual, expected, dtype, what):
    tol = _tol(dtype)
    actual, expected = actual.detach(), expected.detach()
    scale = float(expected.float().abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol,
                               atol=tol * max(scale, 1e-6), msg=lambda m: f"{what}: {m}")


def _same_on_every_rank(t, group):
    t = t.reshape(-1).contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    for p in parts:
        assert torch.equal(p, parts[0]), "the loss differs between ranks"


def _layout(vocab, grank, gsize, uneven):
    if uneven:
        start, local = vp.shard_range(vocab, grank, gsize)
        return start, local, dict(vocab_start=start, vocab_total=vocab)
    local = vocab // gsize
    return grank * local, local, {}


def _check_ce(group, grank, gsize, *, vocab, dtype, reduction, label_smoothing=0.0,
              uneven=False, weight=False, formula="torch", inplace=False, extras=False,
              z_loss=0.0, softcap=0.0, seed=0):
    from fusedce.torch import cross_entropy
    from fusedce.torch.distributed import vocab_parallel_cross_entropy
    gen = torch.Generator().manual_seed(seed)
    s, b = 7, 3
    z = (torch.randn(s, b, vocab, generator=gen) * 3).to(DEV, dtype)
    y = torch.randint(0, vocab, (s, b), generator=gen)
    y[0, 1] = y[4, 2] = -100
    y = y.to(DEV)
    cw = (torch.rand(vocab, generator=gen) + 0.5).to(DEV) if weight else None
    up = (torch.randn(s, b, generator=gen) if reduction == "none" else torch.tensor(1.7)).to(DEV)
    start, local, kw = _layout(vocab, grank, gsize, uneven)
    shard = z[..., start:start + local].clone().requires_grad_()
    flags = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
                 return_lse=True) if extras else {}
    out = vocab_parallel_cross_entropy(shard, y, label_smoothing, group, reduction=reduction,
                                       weight=cw, label_smoothing_formula=formula,
                                       inplace_backward=inplace, z_loss=z_loss,
                                       softcap=softcap, **flags, **kw)
    loss = out[0] if extras else out
    assert loss.dtype == torch.float32
    assert loss.shape == (y.shape if reduction == "none" else ())
    _same_on_every_rank(loss.detach(), group)
    (loss * up).sum().backward()
    eps = label_smoothing * vocab / (vocab - 1) if formula == "megatron" else label_smoothing
    full = z.reshape(-1, vocab).clone().requires_grad_()
    ref = cross_entropy(full, y.reshape(-1), cw, reduction=reduction, label_smoothing=eps,
                        z_loss=z_loss, softcap=softcap, **flags)
    ref_loss = ref[0] if extras else ref
    (ref_loss.reshape(loss.shape) * up).sum().backward()
    what = f"P={gsize} {dtype} {reduction} eps={label_smoothing} uneven={uneven}"
    _assert_close(loss, ref_loss.reshape(loss.shape), torch.float32, "loss " + what)
    assert shard.grad.dtype == dtype and shard.grad.shape == shard.shape
    _assert_close(shard.grad, full.grad.reshape(s, b, vocab)[..., start:start + local], dtype,
                  "grad " + what)
    if extras:
        for name in ("z_loss", "token_accuracy", "predicted_tokens", "lse"):
            a, e = getattr(out, name), getattr(ref, name)
            per_row = reduction == "none" or name in ("predicted_tokens", "lse")
            assert a.shape == (y.shape if per_row else ())
            _assert_close(a, e.reshape(a.shape), torch.float32, name + " " + what)
    if z_loss == 0 and softcap == 0:  # torch.nn.functional in float64
        f64 = F.cross_entropy(z.double().reshape(-1, vocab), y.reshape(-1),
                              weight=cw.double() if cw is not None else None,
                              reduction=reduction, label_smoothing=eps)
        _assert_close(loss.double(), f64.reshape(loss.shape), torch.float32, "F " + what)


def _megatron_formula_reference(z, y, eps):
    """Megatron's vocab-parallel loss with label smoothing at tensor-parallel size 1 (written
    from its formula, float64): (1 - s)·(lse - z_y) - s·mean_j log p_j, s = eps·V/(V-1)."""
    v = z.shape[-1]
    logp = torch.log_softmax(z.double(), -1)
    s = eps * v / (v - 1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return (1 - s) * nll - s * logp.mean(-1)


def _check_linear(group, grank, gsize, *, vocab, dtype, reduction, bias=True,
                  label_smoothing=0.0, uneven=False, reduce_grad_hidden=True, seed=0):
    from fusedce.torch import linear_cross_entropy
    from fusedce.torch.distributed import vocab_parallel_linear_cross_entropy
    gen = torch.Generator().manual_seed(seed)
    s, b, d = 5, 4, 24
    h = torch.randn(s, b, d, generator=gen).to(DEV, dtype)
    w = (torch.randn(vocab, d, generator=gen) * 0.3).to(DEV, dtype)
    bb = (torch.randn(vocab, generator=gen) * 0.2).to(DEV, dtype) if bias else None
    y = torch.randint(0, vocab, (s, b), generator=gen)
    y[1, 1] = -100
    y = y.to(DEV)
    up = (torch.randn(s, b, generator=gen) if reduction == "none" else torch.tensor(0.6)).to(DEV)
    start, local, kw = _layout(vocab, grank, gsize, uneven)
    hh = h.clone().requires_grad_()
    ws = w[start:start + local].clone().requires_grad_()
    bs = bb[start:start + local].clone().requires_grad_() if bias else None
    loss = vocab_parallel_linear_cross_entropy(hh, ws, y, group=group, bias=bs,
                                               reduction=reduction,
                                               label_smoothing=label_smoothing,
                                               reduce_grad_hidden=reduce_grad_hidden, **kw)
    _same_on_every_rank(loss.detach(), group)
    (loss * up).sum().backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    br = bb.clone().requires_grad_() if bias else None
    ref = linear_cross_entropy(hr, wr, y, linear_bias=br, reduction=reduction,
                               label_smoothing=label_smoothing)
    (ref * up).sum().backward()
    what = f"linear P={gsize} {dtype} {reduction} bias={bias} uneven={uneven}"
    _assert_close(loss, ref, torch.float32 if dtype == torch.float32 else dtype, "loss " + what)
    gh = hh.grad
    if not reduce_grad_hidden:  # each rank's partial: the caller's reduction
        gh = gh.float()
        dist.all_reduce(gh, group=group)
    assert hh.grad.dtype == dtype and hh.grad.shape == h.shape
    _assert_close(gh, hr.grad, dtype, "grad_hidden " + what)
    assert ws.grad.dtype == dtype
    _assert_close(ws.grad, wr.grad[start:start + local], dtype, "grad_weight " + what)
    if bias:
        _assert_close(bs.grad, br.grad[start:start + local], dtype, "grad_bias " + what)
    if dtype == torch.float32 and label_smoothing == 0:  # torch.nn.functional in float64
        logits = F.linear(h.double(), w.double(), bb.double() if bias else None)
        f64 = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction=reduction)
        _assert_close(loss.double(), f64.reshape(loss.shape), torch.float32, "F " + what)


def _cases_ce(group, grank, gsize):
    vocab = 12 * gsize
    for dtype in (torch.float32, torch.bfloat16):
        for reduction in ("none", "mean", "sum"):
            _check_ce(group, grank, gsize, vocab=vocab, dtype=dtype, reduction=reduction,
                      label_smoothing=0.1)
    # uneven shards, class weights, ignore rows (every case has some), extras, z-loss, softcap
    _check_ce(group, grank, gsize, vocab=vocab + 3, dtype=torch.float32, reduction="mean",
              uneven=True, weight=True, label_smoothing=0.05, seed=1)
    _check_ce(group, grank, gsize, vocab=vocab + 1, dtype=torch.bfloat16, reduction="none",
              uneven=True, extras=True, z_loss=1e-3, softcap=5.0, seed=2)
    _check_ce(group, grank, gsize, vocab=vocab, dtype=torch.float32, reduction="mean",
              extras=True, seed=3)
    _check_ce(group, grank, gsize, vocab=vocab, dtype=torch.float32, reduction="none",
              label_smoothing=0.1, formula="megatron", inplace=True, seed=4)


def _cases_linear(group, grank, gsize):
    vocab = 10 * gsize
    for dtype in (torch.float32, torch.bfloat16):
        for reduction in ("mean", "none"):
            _check_linear(group, grank, gsize, vocab=vocab, dtype=dtype, reduction=reduction,
                          label_smoothing=0.1 if reduction == "mean" else 0.0)
    _check_linear(group, grank, gsize, vocab=vocab + 3, dtype=torch.float32, reduction="sum",
                  bias=False, uneven=True, seed=1)
    _check_linear(group, grank, gsize, vocab=vocab + 1, dtype=torch.float32, reduction="mean",
                  uneven=True, reduce_grad_hidden=False, seed=2)


def _cases_misc(group, grank, gsize):
    from fusedce.torch import cross_entropy, distributed
    vpce = distributed.vocab_parallel_cross_entropy
    vocab = 8 * gsize
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(6, vocab, generator=gen).to(DEV)
    y = torch.randint(0, vocab, (6,), generator=gen).to(DEV)
    local = z[:, grank * 8:(grank + 1) * 8]
    # Megatron's positional form (logits, target, label_smoothing, tp_group), and tp_group=
    a = vpce(local, y, 0.0, group)
    b = vpce(local, y, tp_group=group)
    assert torch.equal(a, b)
    # the all_gather fallback (for backends without all_gather_into_tensor): the same loss
    from fusedce.torch import _distributed_calls as td
    backend = str(dist.get_backend(group))
    td._GATHER_FALLBACK.add(backend)
    try:
        assert torch.equal(vpce(local, y, 0.0, group), a)
    finally:
        td._GATHER_FALLBACK.discard(backend)
    # per-row z-loss with token scaling: the target logit comes from the gathered statistics
    kw = dict(reduction="none", z_loss=1e-2, use_token_scaling=True, return_z_loss=True)
    out = vpce(local, y, 0.0, group, **kw)
    ref = cross_entropy(z, y, **kw)
    _assert_close(out.z_loss, ref.z_loss, torch.float32, "z_loss rows, token scaling")
    _assert_close(out.loss, ref.loss, torch.float32, "loss, token scaling")
    # the same for the linear form (its target logits: those the library made, gathered)
    from fusedce.torch import linear_cross_entropy
    h = torch.randn(6, 16, generator=gen).to(DEV)
    w = (torch.randn(vocab, 16, generator=gen) / 4).to(DEV)
    out = distributed.vocab_parallel_linear_cross_entropy(
        h, w[grank * 8:(grank + 1) * 8], y, group=group, **kw)
    ref = linear_cross_entropy(h, w, y, **kw)
    _assert_close(out.z_loss, ref.z_loss, torch.float32, "linear z_loss rows, token scaling")
    _assert_close(out.loss, ref.loss, torch.float32, "linear loss, token scaling")
    # no grad: the loss only
    with torch.no_grad():
        c = vpce(local.clone().requires_grad_(), y, group=group)
    assert torch.equal(a, c)
    # Megatron's label smoothing formula, at the size of the vocabulary (its TP=1 result)
    m = vpce(local, y, 0.1, group, label_smoothing_formula="megatron")
    _assert_close(m.double().cpu(), _megatron_formula_reference(z.cpu(), y.cpu(), 0.1),
                  torch.float32, "megatron formula")
    # shards that do not tile the vocabulary: NaN, and check_targets raises on every rank
    bad = vpce(z[:, :8], y, group=group, vocab_start=0, vocab_total=vocab)
    assert gsize == 1 or torch.isnan(bad).any()
    if gsize > 1:
        with pytest.raises(RuntimeError, match="do not tile"):
            vpce(z[:, :8], y, group=group, vocab_start=0, vocab_total=vocab, check_targets=True)
    # an out-of-range target: torch's IndexError with check_targets
    yy = y.clone()
    yy[3] = vocab + 5
    with pytest.raises(IndexError, match="out of bounds"):
        vpce(local, yy, group=group, check_targets=True)
    # uneven shards need vocab_total; equal ones check it
    with pytest.raises(ValueError, match="vocab_total"):
        vpce(local, y, group=group, vocab_start=grank * 8)
    with pytest.raises(ValueError, match="vocab_total"):
        vpce(local, y, group=group, vocab_total=vocab + 1)
    # an empty batch (no row on any rank): the empty problem, no statistics gathered; an empty
    # 'none' loss, 0 for 'sum' and 'mean', an empty logits / hidden gradient, a zero weight
    # gradient (the cotangent: ones shaped as the loss, empty for 'none')
    for reduction in ("none", "sum", "mean"):
        shape = (0,) if reduction == "none" else ()
        e = local[:0].clone().requires_grad_()
        le = vpce(e, y[:0], group=group, reduction=reduction)
        assert le.shape == shape and le.dtype == torch.float32, reduction
        assert reduction == "none" or le.item() == 0.0, reduction
        (ge,) = torch.autograd.grad(le, e, torch.ones_like(le))
        assert ge.shape == (0, 8), reduction
        he = h[:0].clone().requires_grad_()
        we = w[grank * 8:(grank + 1) * 8].clone().requires_grad_()
        le = distributed.vocab_parallel_linear_cross_entropy(he, we, y[:0], group=group,
                                                             reduction=reduction)
        assert le.shape == shape and le.dtype == torch.float32, reduction
        assert reduction == "none" or le.item() == 0.0, reduction
        gh, gw = torch.autograd.grad(le, (he, we), torch.ones_like(le))
        assert gh.shape == (0, 16) and gw.shape == we.shape, reduction
        assert torch.all(gw == 0), reduction
    # a second backward through the graph (retain_graph) recomputes; in place it raises
    x = local.clone().requires_grad_()
    loss = vpce(x, y, group=group, reduction="mean")
    loss.backward(retain_graph=True)
    g1 = x.grad.clone()
    x.grad = None
    loss.backward()
    assert torch.equal(g1, x.grad)
    ref = cross_entropy(z.clone().requires_grad_(), y)
    assert torch.allclose(loss, ref, rtol=2e-5, atol=2e-6)


def _cases_subgroups(group, grank, gsize):
    """4 processes: two groups of two ranks, each sharding its own vocabulary."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    mine = groups[rank // 2]
    assert dist.get_rank(mine) == rank % 2 and world == 4
    _check_ce(mine, rank % 2, 2, vocab=22, dtype=torch.float32, reduction="none",
              label_smoothing=0.1, seed=20 + rank // 2)
    _check_linear(mine, rank % 2, 2, vocab=21, dtype=torch.float32, reduction="mean",
                  uneven=True, seed=30 + rank // 2)


class _Boom(RuntimeError):
    """What a patched all-gather raises: it must come out of the forward as it is."""


class _CountGathers:
    """Counts the all-gathers fce_vp_linear_ce runs through its callback (the fused path) while
    the block runs."""

    def __enter__(self):
        from fusedce.torch import _distributed_calls as td
        self.calls, self._td, self._orig = 0, td, td._AllGather._call

        def call(gather, *args):
            self.calls += 1
            return self._orig(gather, *args)
        td._AllGather._call = call  # bound when an _AllGather is made: the calls to come
        return self

    def __exit__(self, *exc):
        self._td._AllGather._call = self._orig


def _check_fused(group, grank, gsize, *, vocab, dtype, reduction, bias=False, weight=False,
                 label_smoothing=0.0, z_loss=0.0, softcap=0.0, uneven=False, widths=None,
                 up=0.6, extras=False, reduce_grad_hidden=True, workspace_bytes=None, seed=0):
    """vocab_parallel_linear_cross_entropy with a gradient: for mean and sum the fused call
    (fce_vp_linear_ce, its all-gathers through the callback in the forward, none in the
    backward), for 'none' the two phases (no callback); loss, extras and gradients against the
    unsharded fusedce.torch.linear_cross_entropy. widths: a custom split (rank order)."""
    from fusedce.torch import linear_cross_entropy
    from fusedce.torch.distributed import vocab_parallel_linear_cross_entropy
    gen = torch.Generator().manual_seed(seed)
    s, b, d = 6, 3, 20
    h = torch.randn(s, b, d, generator=gen).to(DEV, dtype)
    w = (torch.randn(vocab, d, generator=gen) * 0.3).to(DEV, dtype)
    bb = (torch.randn(vocab, generator=gen) * 0.2).to(DEV, dtype) if bias else None
    cw = (torch.rand(vocab, generator=gen) + 0.5).to(DEV) if weight else None
    y = torch.randint(0, vocab, (s, b), generator=gen)
    y[0, 2] = y[3, 1] = -100
    y = y.to(DEV)
    if reduction == "none":
        up = torch.randn(s, b, generator=gen).to(DEV)
    if widths is not None:
        assert len(widths) == gsize and sum(widths) == vocab
        start, local = sum(widths[:grank]), widths[grank]
        kw = dict(vocab_start=start, vocab_total=vocab)
    else:
        start, local, kw = _layout(vocab, grank, gsize, uneven)
    flags = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True,
                 return_lse=True) if extras else {}
    opt = dict(reduction=reduction, weight=cw, label_smoothing=label_smoothing, z_loss=z_loss,
               softcap=softcap, **flags)
    hh = h.clone().requires_grad_()
    ws = w[start:start + local].clone().requires_grad_()
    bs = bb[start:start + local].clone().requires_grad_() if bias else None
    with _CountGathers() as count:
        out = vocab_parallel_linear_cross_entropy(hh, ws, y, group=group, bias=bs,
                                                  reduce_grad_hidden=reduce_grad_hidden,
                                                  workspace_bytes=workspace_bytes, **opt, **kw)
    fused = reduction != "none"
    if not fused:
        assert count.calls == 0, "reduction 'none' takes the two phases"
    elif DEV == "cpu":
        assert count.calls == 1, "the CPU backend gathers once"
    else:
        assert count.calls >= 1
    loss = out[0] if extras else out
    assert loss.dtype == torch.float32 and loss.shape == (() if fused else y.shape)
    _same_on_every_rank(loss.detach(), group)
    with _CountGathers() as count:
        if isinstance(up, float) and up == 1.0:
            loss.backward()  # the upstream gradient exactly 1: the gradients as they are
        else:
            (loss * up).sum().backward()
    assert count.calls == 0, "the backward makes no all-gather"
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    br = bb.clone().requires_grad_() if bias else None
    ref = linear_cross_entropy(hr, wr, y.reshape(-1), linear_bias=br, **opt)
    ref_loss = ref[0] if extras else ref
    (ref_loss.reshape(loss.shape) * up).sum().backward()
    what = (f"fused P={gsize} {dtype} {reduction} bias={bias} weight={weight} "
            f"eps={label_smoothing} z={z_loss} cap={softcap} uneven={uneven} widths={widths}")
    ldt = torch.float32 if dtype == torch.float32 else dtype
    _assert_close(loss, ref_loss.reshape(loss.shape), ldt, "loss " + what)
    if extras:
        for name in ("z_loss", "token_accuracy", "predicted_tokens", "lse"):
            a, e = getattr(out, name), getattr(ref, name)
            per_row = reduction == "none" or name in ("predicted_tokens", "lse")
            assert a.shape == (y.shape if per_row else ()), name
            _assert_close(a, e.reshape(a.shape), ldt, name + " " + what)
    gh = hh.grad
    assert gh.dtype == dtype and gh.shape == h.shape
    if not reduce_grad_hidden:  # each rank's partial: the caller's reduction
        gh = gh.float()
        dist.all_reduce(gh, group=group)
    _assert_close(gh, hr.grad, dtype, "grad_hidden " + what)
    assert ws.grad.dtype == dtype and ws.grad.shape == ws.shape
    _assert_close(ws.grad, wr.grad[start:start + local], dtype, "grad_weight " + what)
    if bias:
        assert bs.grad.dtype == dtype
        _assert_close(bs.grad, br.grad[start:start + local], dtype, "grad_bias " + what)
    if dtype == torch.float32 and not (label_smoothing or weight or z_loss or softcap):
        logits = F.linear(h.double(), w.double(), bb.double() if bias else None)
        f64 = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction=reduction)
        _assert_close(loss.double(), f64.reshape(loss.shape), torch.float32, "F " + what)


def _cases_fused(group, grank, gsize):
    from fusedce.torch import _distributed_calls as td
    from fusedce.torch import linear_cross_entropy
    from fusedce.torch.distributed import vocab_parallel_linear_cross_entropy as vplce
    vocab = 10 * gsize
    for dtype in (torch.float32, torch.bfloat16):
        _check_fused(group, grank, gsize, vocab=vocab, dtype=dtype, reduction="mean", bias=True,
                     label_smoothing=0.1)
        _check_fused(group, grank, gsize, vocab=vocab + 1, dtype=dtype, reduction="sum",
                     uneven=True, z_loss=1e-3, up=1.0, seed=1)
    # class weights, bias, extras, uneven shards
    _check_fused(group, grank, gsize, vocab=vocab + 2, dtype=torch.float32, reduction="mean",
                 uneven=True, weight=True, label_smoothing=0.05, bias=True, extras=True, seed=2)
    _check_fused(group, grank, gsize, vocab=vocab, dtype=torch.bfloat16, reduction="sum",
                 weight=True, z_loss=1e-2, softcap=4.0, extras=True, up=-2.5, seed=3)
    _check_fused(group, grank, gsize, vocab=vocab + 1, dtype=torch.float32, reduction="mean",
                 uneven=True, reduce_grad_hidden=False, seed=4)
    # (a bfloat16 partial ∂hidden, not all-reduced here)
    _check_fused(group, grank, gsize, vocab=vocab, dtype=torch.bfloat16, reduction="mean",
                 bias=True, reduce_grad_hidden=False, seed=11)
    # a custom split whose first shard is wider than vocab_total / ranks rounded up; on the
    # CPU backend (always gather-once) at the minimum workspace too
    widths = [7 + gsize - 1] + [6] * (gsize - 1)
    _check_fused(group, grank, gsize, vocab=7 * gsize, dtype=torch.float32, reduction="mean",
                 widths=widths, bias=True, seed=5)
    if DEV == "cpu":
        _check_fused(group, grank, gsize, vocab=7 * gsize, dtype=torch.float32,
                     reduction="sum", widths=widths, workspace_bytes=0, seed=6)
        _check_fused(group, grank, gsize, vocab=vocab, dtype=torch.float32, reduction="mean",
                     workspace_bytes=0, seed=7)
    # reduction 'none' keeps the two phases (no callback), with its per-row upstream gradient
    _check_fused(group, grank, gsize, vocab=vocab + 1, dtype=torch.float32, reduction="none",
                 uneven=True, bias=True, label_smoothing=0.1, seed=8)
    _check_fused(group, grank, gsize, vocab=vocab, dtype=torch.bfloat16, reduction="none",
                 z_loss=1e-3, extras=True, seed=9)

    gen = torch.Generator().manual_seed(10)
    n, d = 9, 16
    h = torch.randn(n, d, generator=gen).to(DEV)
    w = (torch.randn(vocab, d, generator=gen) / 4).to(DEV)
    y = torch.randint(0, vocab, (n,), generator=gen).to(DEV)
    mine = slice(grank * 10, (grank + 1) * 10)

    # without a gradient: the two phases, the same loss (on the CPU backend the fused call runs
    # exactly those calls: bit for bit)
    hh, ww = h.clone().requires_grad_(), w[mine].clone().requires_grad_()
    loss = vplce(hh, ww, y, group=group)
    with torch.no_grad(), _CountGathers() as count:
        plain = vplce(hh, ww, y, group=group)
    assert count.calls == 0
    if DEV == "cpu":
        assert torch.equal(plain, loss)
    _assert_close(plain, loss, torch.float32, "no_grad loss")

    # a second backward through the graph (retain_graph): made again, with the collectives
    scaled = loss * 0.6
    scaled.backward(retain_graph=True)
    g1 = (hh.grad.clone(), ww.grad.clone())
    hh.grad = ww.grad = None
    with _CountGathers() as count:
        scaled.backward()
    assert count.calls >= 1
    _assert_close(hh.grad, g1[0], torch.float32, "second backward grad_hidden")
    _assert_close(ww.grad, g1[1], torch.float32, "second backward grad_weight")

    # only the weight requires grad (hidden is not a leaf that needs one)
    ww = w[mine].clone().requires_grad_()
    vplce(h, ww, y, group=group).backward()
    _assert_close(ww.grad, g1[1] / 0.6, torch.float32, "weight only")

    # autocast: the matmul in bfloat16, a float32 weight gets its float32 gradient
    hh, ww = h.clone().requires_grad_(), w[mine].clone().requires_grad_()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(DEV.split(":")[0], dtype=torch.bfloat16):
        a = vplce(hh, ww, y, group=group, label_smoothing=0.1)
        r = linear_cross_entropy(hr, wr, y, label_smoothing=0.1)
    (a * 1.3).backward()
    (r * 1.3).backward()
    assert ww.grad.dtype == torch.float32 and hh.grad.dtype == torch.float32
    _assert_close(a, r, torch.bfloat16, "autocast loss")
    _assert_close(hh.grad, hr.grad, torch.bfloat16, "autocast grad_hidden")
    _assert_close(ww.grad, wr.grad[mine], torch.bfloat16, "autocast grad_weight")

    # check_targets: an out-of-range target raises torch's IndexError on every rank
    yy = y.clone()
    yy[4] = vocab + 3
    with pytest.raises(IndexError, match="out of bounds"):
        vplce(h.clone().requires_grad_(), w[mine], yy, group=group, check_targets=True)
    # shards that do not tile the vocabulary: NaN; check_targets raises on every rank
    first = w[:10].clone().requires_grad_()
    bad = vplce(h, first, y, group=group, vocab_start=0, vocab_total=vocab)
    assert gsize == 1 or torch.isnan(bad)
    if gsize > 1:
        with pytest.raises(RuntimeError, match="do not tile"):
            vplce(h, first, y, group=group, vocab_start=0, vocab_total=vocab,
                  check_targets=True)

    # an exception in the all-gather (raised inside the library's callback) comes out of the
    # forward as it is, on every rank (no rank issued a collective), and nothing is left behind
    orig = td._gather_into

    def boom(*_args):
        raise _Boom("the all-gather failed")
    td._gather_into = boom
    try:
        with pytest.raises(_Boom, match="the all-gather failed"):
            vplce(h.clone().requires_grad_(), w[mine], y, group=group)
    finally:
        td._gather_into = orig
    again = vplce(h, w[mine].clone().requires_grad_(), y, group=group)
    _assert_close(again, loss, torch.float32, "after the failed all-gather")


CASES = {"ce": _cases_ce, "linear": _cases_linear, "misc": _cases_misc,
         "subgroups": _cases_subgroups, "fused": _cases_fused}


def _worker(rank, world, backend, init_file, cases, module=None):
    global DEV
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        DEV = f"cuda:{rank}"
    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        group = dist.group.WORLD
        table = importlib.import_module(module).CASES if module else CASES
        for name in cases:
            table[name](group, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world, backend, cases, tmp_path, monkeypatch, module=None):
    """Runs the named cases (of ``module``'s CASES, by default this one's) on `world`
    processes of `backend`."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    init_file = str(tmp_path / f"store-{backend}-{world}-{'-'.join(cases)}")
    if os.path.dirname(__file__) not in sys.path:  # the workers import this module
        sys.path.insert(0, os.path.dirname(__file__))
    import torch.multiprocessing as mp
    mp.start_processes(_worker, args=(world, backend, init_file, tuple(cases), module),
                       nprocs=world, join=True, start_method="spawn")


@needs_vp
@needs_gloo
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes(world, tmp_path, monkeypatch):
    """fusedce.torch.distributed over `world` processes on gloo (CPU tensors, the CPU backend):
    loss and gradients of vocab_parallel_cross_entropy and vocab_parallel_linear_cross_entropy
    equal to the unsharded fusedce.torch calls and torch.nn.functional (float32 and bfloat16,
    label smoothing, ignored rows, uneven shards, class weights, extras), Megatron's forms, the
    error paths; with 4 processes also two subgroups of two. One spawn per size (starting a
    process that imports torch costs seconds): a failure names its case."""
    cases = ("ce", "linear", "misc") + (("subgroups",) if world == 4 else ())
    _spawn(world, "gloo", cases, tmp_path, monkeypatch)


@needs_vp_linear_ce
@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_processes_fused_linear(world, tmp_path, monkeypatch):
    """vocab_parallel_linear_cross_entropy's fused path (fce_vp_linear_ce, its all-gather through
    the callback) over `world` processes on gloo: mean and sum with bias, class weights, label
    smoothing, z-loss, softcap, extras, float32 and bfloat16, equal and uneven shards (a custom
    split with a shard wider than vocab_total / ranks too), reduce_grad_hidden=False, the
    minimum workspace, autocast, retain_graph, the error paths and an exception raised in the
    all-gather; reduction 'none' and no_grad keep the two phases."""
    _spawn(world, "gloo", ("fused",), tmp_path, monkeypatch)


@needs_vp
@needs_torch
def test_single_process_without_distributed():
    """Without an initialised torch.distributed the call runs as one rank (no collective)."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    from fusedce.torch import cross_entropy, linear_cross_entropy
    from fusedce.torch.distributed import (vocab_parallel_cross_entropy,
                                           vocab_parallel_linear_cross_entropy)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4, 3, 17, generator=gen, requires_grad=True)
    y = torch.randint(0, 17, (4, 3), generator=gen)
    loss = vocab_parallel_cross_entropy(z, y, 0.1)
    assert loss.shape == (4, 3)
    ref = cross_entropy(z.detach().reshape(-1, 17), y.reshape(-1), reduction="none",
                        label_smoothing=0.1)
    torch.testing.assert_close(loss, ref.reshape(4, 3))
    loss.sum().backward()
    h = torch.randn(12, 8, generator=gen, requires_grad=True)
    w = torch.randn(17, 8, generator=gen, requires_grad=True)
    a = vocab_parallel_linear_cross_entropy(h, w, y.reshape(-1))
    b = linear_cross_entropy(h, w, y.reshape(-1))
    torch.testing.assert_close(a, b)
    a.backward()
    # autocast: the matmul in bfloat16, a float32 weight gets its float32 gradient
    w.grad = None
    w2 = w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = vocab_parallel_linear_cross_entropy(h, w, y.reshape(-1))
        b = linear_cross_entropy(h, w2, y.reshape(-1))
    torch.testing.assert_close(a, b)
    a.backward()
    b.backward()
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-2, atol=1e-3)
    import fusedce.torch
    import fusedce.torch.distributed as d1
    from fusedce.torch import distributed as d2
    assert d1 is d2 is fusedce.torch.distributed


HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))))), "include", "fusedce.h")


def _header_params(name):
    """The parameters of function ``name`` as include/fusedce.h declares it (comments removed,
    whitespace collapsed): what the ctypes signature of _lib must match."""
    import re
    if not os.path.exists(HEADER):
        pytest.skip(f"{HEADER} is not there (not a source tree)")
    with open(HEADER) as f:
        text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", f.read(), flags=re.S)
    m = re.search(r"\bFCE_API\s+[\w\s\*]*?\b" + re.escape(name) + r"\s*\(([^;]*?)\)\s*;",
                  text)
    assert m, f"{name} is not declared in {HEADER}"
    params = [" ".join(p.split()) for p in m.group(1).split(",")]
    return [] if params == ["void"] else params


@needs_vp_linear_ce
@needs_torch
def test_fused_linear_single_process(monkeypatch):
    """Without torch.distributed (one rank): the fused call's one all-gather is a copy; an
    exception raised in the all-gather comes out of the forward as it is; a library without
    fce_vp_linear_ce takes the two phases, with the same results; the workspace every rank
    plans with, and a shard wider than vocab_total / ranks."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    from fusedce._options import CEOptions
    from fusedce.torch import _distributed_calls as td
    from fusedce.torch import linear_cross_entropy
    from fusedce.torch.distributed import vocab_parallel_linear_cross_entropy as vplce
    gen = torch.Generator().manual_seed(3)
    h0 = torch.randn(12, 8, generator=gen)
    w0 = torch.randn(17, 8, generator=gen) / 3
    b0 = torch.randn(17, generator=gen) / 5
    y = torch.randint(0, 17, (12,), generator=gen)
    y[5] = -100
    kw = dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3)

    def run(fn, expect_calls, bias_keyword):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_()
        with _CountGathers() as count:
            loss = fn(h, w, y, **{bias_keyword: b}, **kw)
        assert count.calls == expect_calls
        (loss * 0.5).backward()
        return loss, h.grad, w.grad, b.grad

    fused = run(vplce, 1, "bias")
    ref = run(linear_cross_entropy, 0, "linear_bias")
    for a, e, what in zip(fused, ref, ("loss", "grad_hidden", "grad_weight", "grad_bias")):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-6, msg=what)
    # bfloat16 (one rank: ∂hidden with nothing to all-reduce)
    h16, w16, b16 = h0.bfloat16(), w0.bfloat16(), b0.bfloat16()
    got, exp = [], []
    for fn, out, bias_keyword in ((vplce, got, "bias"), (linear_cross_entropy, exp, "linear_bias")):
        h, w, b = (t.clone().requires_grad_() for t in (h16, w16, b16))
        loss = fn(h, w, y, **{bias_keyword: b}, **kw)
        (loss * 0.5).backward()
        out += [loss, h.grad, w.grad, b.grad]
    for a, e, what in zip(got, exp, ("loss", "grad_hidden", "grad_weight", "grad_bias")):
        a, e = a.detach(), e.detach()
        assert a.dtype == e.dtype, what
        scale = float(e.float().abs().max())
        torch.testing.assert_close(a.float(), e.float(), rtol=1.5e-2, atol=1.5e-2 * scale,
                                   msg=what)

    def boom(*_args):
        raise _Boom("the all-gather failed")
    with monkeypatch.context() as m:
        m.setattr(td, "_gather_into", boom)
        with pytest.raises(_Boom, match="the all-gather failed"):
            vplce(h0.clone().requires_grad_(), w0, y)
        # without a gradient (the two phases): no all-gather for one rank, no callback
        vplce(h0, w0, y)
    with monkeypatch.context() as m:  # a library without the fused call (0.4)
        m.setattr(_lib, "_LIB_MISSING",
                  _lib._LIB_MISSING | frozenset(_lib.VP_LINEAR_CE_SYMBOLS))
        assert _lib.has_vp() and not _lib.has_vp_linear_ce()
        phases = run(vplce, 0, "bias")
    for a, e, what in zip(phases, fused, ("loss", "grad_hidden", "grad_weight", "grad_bias")):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-6, msg=what)

    # the signatures of the two functions: as many parameters as include/fusedce.h declares,
    # the all-gather callback where the header has its fce_vp_all_gather_fn
    lib = _lib.load()
    params = _header_params("fce_vp_linear_ce")
    assert len(lib.fce_vp_linear_ce.argtypes) == len(params), params
    assert dict(_lib.VpShard._fields_)["all_gather"] is _lib.VP_ALL_GATHER_FN
    assert len(lib.fce_vp_linear_ce_workspace_size.argtypes) == len(
        _header_params("fce_vp_linear_ce_workspace_size"))

    # the workspace: the same for every shard up to ⌈vt / P⌉ wide; a wider one gets its own
    # minimum on the CPU backend (always gather-once) and its full-speed size on CUDA when the
    # budget gives every rank the full-speed size; below that on CUDA it raises
    opts = CEOptions(reduction=_lib.FCE_REDUCTION_MEAN, ignore_index=-100)
    key, o = td._opts_struct(h0, torch.float32, y, opts, None)

    def sizes(width):
        lo, hi = ctypes.c_size_t(), ctypes.c_size_t()
        _lib.check(lib.fce_vp_linear_ce_workspace_size(
            ctypes.byref(o), 2, 12, 8, 21, width, 1, _lib.FCE_FLOAT32, ctypes.byref(lo),
            ctypes.byref(hi)), "fce_vp_linear_ce_workspace_size")
        return lo.value, hi.value
    lo, hi = sizes(11)
    assert sizes(10) == (lo, hi) and 0 < lo <= hi
    for vl in (10, 11):
        for budget, cuda in ((0, False), (0, True), (1 << 40, True)):
            assert td._fused_workspace(o, key, 2, 12, 8, 21, vl, budget, cuda, ()) == (
                lo if budget == 0 else hi)
    lo13, hi13 = sizes(13)
    assert td._fused_workspace(o, key, 2, 12, 8, 21, 13, 0, False, ()) == max(lo, lo13)
    assert td._fused_workspace(o, key, 2, 12, 8, 21, 13, 1 << 40, True, ()) == max(hi, hi13)
    if lo < hi:
        with pytest.raises(ValueError, match="wider than vocab_total / ranks"):
            td._fused_workspace(o, key, 2, 12, 8, 21, 13, lo, True, ())


@needs_vp
@needs_nccl
def test_nccl_one_process(tmp_path, monkeypatch):
    """One process on NCCL over one GPU: the collectives run (a group of one), the library on
    the current CUDA stream."""
    _spawn(1, "nccl", ("ce", "linear", "misc") + (("fused",) if _has_vp_linear_ce() else ()),
           tmp_path, monkeypatch)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
@needs_vp
def test_nccl_two_processes(tmp_path, monkeypatch):
    _spawn(2, "nccl", ("ce", "linear", "misc") + (("fused",) if _has_vp_linear_ce() else ()),
           tmp_path, monkeypatch)
