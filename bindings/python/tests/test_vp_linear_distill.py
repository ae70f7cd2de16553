"""The vocabulary-parallel distillation from hidden states (fce_vp_linear_distill_*) at the array
level: P simulated ranks in one process (NumPy, CPU backend), each holding its rows of the
student's and the teacher's weights, every round of statistics gathered by hand, the loss from
vp_distill_loss, against the unsharded fusedce.linear_distill. Runs in CI: no torch.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q \\
        bindings/python/tests/test_vp_linear_distill.py

Tests skip with their reason where the library lacks the calls.
"""

import numpy as np
import pytest

import fusedce
from fusedce import _lib
from test_distributed import _close, _shards, vp


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
