"""The entropy and the differentiable lse (docs/semantics.md rule 18) of the vocabulary-parallel
calls in Python: the array-level phases with ``entropy=True`` (NumPy, the CPU backend, shards
simulated in one process), and fusedce.torch.distributed's ``return_lse`` / ``return_entropy``
over 2 gloo processes, against the unsharded fusedce.torch calls, values and gradients.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q \
        bindings/python/tests/test_distributed_entropy.py
"""

import numpy as np
import pytest

from test_distributed import (_assert_close, _close, _inputs, _layout, _same_on_every_rank,
                              _shards, _spawn, needs_gloo, needs_vp, torch, vp)


@needs_vp
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_phases_entropy(ranks):
    """entropy=True on every phase: vp_loss's return_entropy equals the entropy of the whole
    row's softmax (float64), and the loss and the gradient stay those of the plain phases."""
    vocab = 53
    z, y = _inputs(9, vocab, seed=5)
    shards = _shards(vocab, ranks, uneven=True)
    stats = np.stack([vp.vp_stats(np.ascontiguousarray(z[:, s:s + n]), y, vocab_total=vocab,
                                  vocab_start=s, entropy=True) for s, n in shards])
    res = vp.vp_loss(stats, y, vocab_total=vocab, return_entropy=True, entropy=True)
    zd = z.astype(np.float64)
    p = np.exp(zd - zd.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    _close(res.entropy, -(p * np.log(p)).sum(1), what="entropy")
    plain = np.stack([vp.vp_stats(np.ascontiguousarray(z[:, s:s + n]), y, vocab_total=vocab,
                                  vocab_start=s) for s, n in shards])
    _close(res.loss, vp.vp_loss(plain, y, vocab_total=vocab).loss, what="loss")
    for s, n in shards:
        zs = np.ascontiguousarray(z[:, s:s + n])
        _close(vp.vp_backward(zs, y, stats, vocab_total=vocab, vocab_start=s, entropy=True),
               vp.vp_backward(zs, y, plain, vocab_total=vocab, vocab_start=s), what="gradient")


def _check_row_terms(group, grank, gsize, *, linear, reduction, uneven, label_smoothing=0.0,
                     weight=False, softcap=0.0, entropy=True, seed=3):
    """return_lse / return_entropy (docs/semantics.md rule 18) of vocab_parallel_cross_entropy
    or vocab_parallel_linear_cross_entropy: lse and the entropy equal to the unsharded call's,
    and the gradient of loss + Σ gl·lse + Σ ge·entropy (lse and entropy differentiable) too."""
    from fusedce.torch import cross_entropy, linear_cross_entropy
    from fusedce.torch.distributed import (vocab_parallel_cross_entropy,
                                           vocab_parallel_linear_cross_entropy)
    gen = torch.Generator().manual_seed(seed)
    n, d, vocab = 12, 16, 62
    y = torch.randint(0, vocab, (n,), generator=gen)
    y[2] = y[7] = -100
    cw = torch.rand(vocab, generator=gen) + 0.5 if weight else None
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    up = torch.randn(n, generator=gen) if reduction == "none" else torch.tensor(0.7)
    start, local, kw = _layout(vocab, grank, gsize, uneven)
    opts = dict(reduction=reduction, weight=cw, label_smoothing=label_smoothing,
                softcap=softcap, return_lse=True, return_entropy=entropy)
    if linear:
        h = torch.randn(n, d, generator=gen)
        w = torch.randn(vocab, d, generator=gen) / 2
        hs, ws = h.clone().requires_grad_(), w[start:start + local].clone().requires_grad_()
        out = vocab_parallel_linear_cross_entropy(hs, ws, y, group=group, **opts, **kw)
        hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
        ref = linear_cross_entropy(hf, wf, y, **opts)
    else:
        z = torch.randn(n, vocab, generator=gen) * 3
        zs = z[:, start:start + local].clone().requires_grad_()
        out = vocab_parallel_cross_entropy(zs, y, group=group, **opts, **kw)
        zf = z.clone().requires_grad_()
        ref = cross_entropy(zf, y, **opts)
    what = f"P={gsize} linear={linear} {reduction} uneven={uneven} eps={label_smoothing}"
    _assert_close(out.loss, ref.loss, torch.float32, "loss " + what)
    _assert_close(out.lse, ref.lse, torch.float32, "lse " + what)
    total = (out.loss * up).sum() + (out.lse * gl).sum()
    ref_total = (ref.loss * up).sum() + (ref.lse * gl).sum()
    if entropy:
        _assert_close(out.entropy, ref.entropy, torch.float32, "entropy " + what)
        _same_on_every_rank(out.entropy.detach(), group)
        total, ref_total = total + (out.entropy * ge).sum(), ref_total + (ref.entropy * ge).sum()
    total.backward()
    ref_total.backward()
    if linear:
        _assert_close(hs.grad, hf.grad, torch.float32, "grad hidden " + what)
        _assert_close(ws.grad, wf.grad[start:start + local], torch.float32, "grad weight " + what)
    else:
        _assert_close(zs.grad, zf.grad[:, start:start + local], torch.float32, "grad " + what)


def _cases_row_terms(group, grank, gsize):
    for linear in (False, True):
        for reduction in ("mean", "none"):
            _check_row_terms(group, grank, gsize, linear=linear, reduction=reduction,
                             uneven=True)
        _check_row_terms(group, grank, gsize, linear=linear, reduction="sum", uneven=False,
                         label_smoothing=0.1, weight=True, softcap=20.0)
        _check_row_terms(group, grank, gsize, linear=linear, reduction="mean", uneven=True,
                         entropy=False)


CASES = {"row_terms": _cases_row_terms}


@needs_vp
@needs_gloo
def test_gloo_processes_lse_and_entropy(tmp_path, monkeypatch):
    """return_lse / return_entropy of both torch.distributed functions over 2 processes on gloo,
    uneven and equal shards, the three reductions, label smoothing, class weights and softcap:
    the values and the gradients through lse and the entropy equal the unsharded calls'."""
    _spawn(2, "gloo", ("row_terms",), tmp_path, monkeypatch, module=__name__)
