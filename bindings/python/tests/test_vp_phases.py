"""The vocabulary-parallel phase API (fce_vp_*) at the array level: P simulated shards in one
process (NumPy, CPU backend; torch CUDA tensors when a device is there), against the unsharded
call (fusedce.forward / linear_ce). fusedce.torch.distributed over real process groups:
test_distributed.py, whose helpers these tests share.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_vp_phases.py

Tests skip with their reason where torch, CUDA or a vocabulary-parallel library is missing.
"""


import numpy as np
import pytest

import fusedce
from fusedce import _lib
from test_distributed import (OPTION_SETS, _close, _has_vp, _inputs, _shards, needs_cuda, needs_vp,
                              torch, vp)

def _call_options(options, reduction, rows, vocab):
    """(keywords, grad_output) of a test call: the option set (its class weights made for
    this vocabulary), the reduction, and an upstream gradient per row for 'none'."""
    kw = dict(OPTION_SETS[options])
    if kw.pop("class_weights", False):
        kw["class_weights"] = np.random.default_rng(7).uniform(0.5, 2.0, vocab).astype(np.float32)
    kw["reduction"] = reduction
    g_out = (np.random.default_rng(3).standard_normal(rows).astype(np.float32)
             if reduction == "none" else 1.7)
    return kw, g_out


@needs_vp
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", list(OPTION_SETS))
def test_phases_match_unsharded(ranks, reduction, options):
    """P simulated ranks: stats per shard (uneven for P = 3), gathered in a permuted rank
    order, loss and gradients equal to the one-call fce_forward on the whole vocabulary."""
    rows, vocab = 12, (53 if ranks == 3 else 52)
    z, y = _inputs(rows, vocab, seed=ranks)
    kw, g_out = _call_options(options, reduction, rows, vocab)
    ref = fusedce.forward(z, y, return_lse=True, return_z_loss=True, return_argmax=True,
                          return_accuracy=True, return_grad=True, grad_output=g_out, **kw)
    shards = _shards(vocab, ranks, uneven=ranks == 3)
    stats = [vp.vp_stats(z[:, s:s + n], y, vocab_start=s, vocab_total=vocab, **kw)
             for s, n in shards]
    assert all(st.shape == (rows, vp.VP_STATS) and st.dtype == np.float32 for st in stats)
    order = list(range(ranks))[::-1]  # any rank order
    gathered = np.stack([stats[r] for r in order])
    res = vp.vp_loss(gathered, y, vocab_total=vocab, return_lse=True, return_z_loss=True,
                     return_argmax=True, return_accuracy=True, check_targets=True, **kw)
    _close(res.loss, ref.loss, what="loss")
    _close(res.lse, ref.lse, what="lse")
    _close(res.z_loss, ref.z_loss, what="z_loss")
    np.testing.assert_array_equal(res.argmax, ref.argmax)
    _close(res.accuracy, ref.accuracy, what="accuracy")
    # the concatenated form of the gathered buffer ([P * rows, 8]) is the same memory
    res2 = vp.vp_loss(gathered.reshape(-1, vp.VP_STATS), y, vocab_total=vocab, **kw)
    np.testing.assert_array_equal(res2.loss, res.loss)
    grads = [vp.vp_backward(z[:, s:s + n], y, gathered, g_out, vocab_start=s, vocab_total=vocab,
                            **kw) for s, n in shards]
    _close(np.concatenate(grads, axis=1), ref.grad_logits, what="gradient")


@needs_vp
def test_rank_order_and_determinism():
    """The loss is a function of the gathered buffer: the same for every rank order up to float
    rounding, and bit for bit for the same order."""
    z, y = _inputs(9, 40, seed=11)
    shards = _shards(40, 4, uneven=False)
    stats = [vp.vp_stats(z[:, s:s + n], y, vocab_start=s, vocab_total=40, reduction="none")
             for s, n in shards]
    a = vp.vp_loss(np.stack(stats), y, vocab_total=40, reduction="none").loss
    b = vp.vp_loss(np.stack(stats), y, vocab_total=40, reduction="none").loss
    c = vp.vp_loss(np.stack(stats[::-1]), y, vocab_total=40, reduction="none").loss
    np.testing.assert_array_equal(a, b)
    _close(c, a)


@needs_vp
@pytest.mark.parametrize("options", ["plain", "smoothing", "entropy"])
def test_batch_invariant_phases_do_not_depend_on_the_shards(options):
    """batch_invariant=True: [rows, VP_STATS_INVARIANT] statistics; each row's loss, lse,
    entropy and gradient are the same bits for 1 to 4 shards (even and uneven), any gathered
    order and any batch the row is in, and the unsharded call's to float32 rounding."""
    rows, vocab = 11, 300
    z, y = _inputs(rows, vocab, seed=21)
    kw = dict(reduction="none", batch_invariant=True)
    if options == "smoothing":
        kw.update(label_smoothing=0.1, z_loss_scale=1e-3)
    entropy = options == "entropy"
    g_out = np.random.default_rng(3).standard_normal(rows).astype(np.float32)

    def step(zz, yy, gg, ranks, uneven, reverse):
        shards = _shards(vocab, ranks, uneven=uneven)
        stats = [vp.vp_stats(np.ascontiguousarray(zz[:, s:s + n]), yy, vocab_start=s,
                             vocab_total=vocab, entropy=entropy, **kw) for s, n in shards]
        assert all(st.shape == (len(yy), vp.VP_STATS_INVARIANT) for st in stats)
        gathered = np.stack(stats[::-1] if reverse else stats)
        res = vp.vp_loss(gathered, yy, vocab_total=vocab, return_lse=True,
                         return_entropy=entropy, **kw)
        grad = np.concatenate([vp.vp_backward(np.ascontiguousarray(zz[:, s:s + n]), yy,
                                              gathered, gg, vocab_start=s, vocab_total=vocab,
                                              entropy=entropy, **kw) for s, n in shards], axis=1)
        return res, grad

    base, base_grad = step(z, y, g_out, 1, False, False)
    ref = fusedce.forward(z, y, return_lse=True, return_grad=True, grad_output=g_out,
                          **{k: v for k, v in kw.items() if k != "batch_invariant"})
    _close(base.loss, ref.loss, what="loss")
    _close(base.lse, ref.lse, what="lse")
    if entropy:  # H = lse − Σ p a, in float64; its gradient terms are the C suites' to check
        a = z.astype(np.float64)
        lse = np.log(np.exp(a - a.max(1, keepdims=True)).sum(1)) + a.max(1)
        p = np.exp(a - lse[:, None])
        _close(base.entropy, lse - (p * a).sum(1), what="entropy")
    else:
        _close(base_grad, ref.grad_logits, what="gradient")
    for ranks in (2, 3, 4):
        for uneven in (False, True):
            res, grad = step(z, y, g_out, ranks, uneven, reverse=ranks % 2 == 1)
            np.testing.assert_array_equal(res.loss, base.loss)
            np.testing.assert_array_equal(res.lse, base.lse)
            np.testing.assert_array_equal(grad, base_grad)
            if entropy:
                np.testing.assert_array_equal(res.entropy, base.entropy)
    # rows 3..6 alone, as a batch of their own, 3 shards
    res, grad = step(z[3:7], y[3:7], g_out[3:7], 3, True, False)
    np.testing.assert_array_equal(res.loss, base.loss[3:7])
    np.testing.assert_array_equal(grad, base_grad[3:7])
    # statistics of the other width are refused
    with pytest.raises(ValueError, match="gathered_stats must be"):
        vp.vp_loss(np.zeros((1, rows, vp.VP_STATS), np.float32), y, vocab_total=vocab, **kw)


@needs_vp
def test_bfloat16_and_int32_targets():
    rows, vocab = 10, 33
    z, y = _inputs(rows, vocab, seed=5)
    bits = fusedce.float_to_bfloat16_bits(z)
    y32 = y.astype(np.int32)
    ref = fusedce.forward(bits, y32, dtype="bfloat16", return_grad=True, label_smoothing=0.1)
    shards = _shards(vocab, 2, uneven=True)
    gathered = np.stack([vp.vp_stats(np.ascontiguousarray(bits[:, s:s + n]), y32, vocab_start=s,
                                     vocab_total=vocab, dtype="bfloat16", label_smoothing=0.1)
                         for s, n in shards])
    res = vp.vp_loss(gathered, y32, vocab_total=vocab, dtype="bfloat16", label_smoothing=0.1)
    _close(res.loss, ref.loss)
    grads = [vp.vp_backward(np.ascontiguousarray(bits[:, s:s + n]), y32, gathered,
                            vocab_start=s, vocab_total=vocab, dtype="bfloat16",
                            label_smoothing=0.1) for s, n in shards]
    got = fusedce.bfloat16_bits_to_float(np.concatenate(grads, axis=1))
    _close(got, fusedce.bfloat16_bits_to_float(ref.grad_logits), rtol=1e-2)


@needs_vp
def test_in_place_gradient():
    z, y = _inputs(8, 30, seed=2)
    ref = fusedce.forward(z, y, return_grad=True)
    shards = _shards(30, 3, uneven=False)
    parts = [np.ascontiguousarray(z[:, s:s + n]) for s, n in shards]
    gathered = np.stack([vp.vp_stats(p, y, vocab_start=s, vocab_total=30)
                         for p, (s, n) in zip(parts, shards)])
    for p, (s, n) in zip(parts, shards):
        out = vp.vp_backward(p, y, gathered, vocab_start=s, vocab_total=30, in_place=True)
        assert out is p
    _close(np.concatenate(parts, axis=1), ref.grad_logits)


@needs_vp
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_phases_match_unsharded(ranks, reduction, bias):
    rows, dim, vocab = 14, 24, 45
    rng = np.random.default_rng(ranks + 10 * bias)
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    w = (rng.standard_normal((vocab, dim)) * 0.3).astype(np.float32)
    b = (rng.standard_normal(vocab) * 0.2).astype(np.float32) if bias else None
    y = rng.integers(0, vocab, rows).astype(np.int64)
    y[2] = -100
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss_scale=1e-3)
    g_out = rng.standard_normal(rows).astype(np.float32) if reduction == "none" else 0.75
    ref = fusedce.linear_ce(h, w, y, b, return_grad=True, grad_output=g_out, return_lse=True,
                            **kw)
    shards = _shards(vocab, ranks, uneven=True)
    gathered = np.stack([
        vp.vp_linear_stats(h, w[s:s + n], y, None if b is None else b[s:s + n], vocab_start=s,
                           vocab_total=vocab, **kw) for s, n in shards])
    res = vp.vp_loss(gathered, y, vocab_total=vocab, return_lse=True, **kw)
    _close(res.loss, ref.loss, what="loss")
    _close(res.lse, ref.lse, what="lse")
    gh = np.zeros((rows, dim), np.float32)
    gws, gbs = [], []
    for s, n in shards:
        r = vp.vp_linear_backward(h, w[s:s + n], y, gathered, None if b is None else b[s:s + n],
                                  g_out, vocab_start=s, vocab_total=vocab, **kw)
        assert r.grad_hidden.dtype == np.float32  # the partial, float32 by default
        gh += r.grad_hidden  # the all-reduce
        gws.append(r.grad_weight)
        gbs.append(r.grad_bias)
    _close(gh, ref.grad_hidden, rtol=1e-4, what="grad_hidden")
    _close(np.concatenate(gws), ref.grad_weight, rtol=1e-4, what="grad_weight")
    if bias:
        _close(np.concatenate(gbs), ref.grad_bias, rtol=1e-4, what="grad_bias")
    else:
        assert gbs[0] is None


@needs_vp
def test_linear_partial_gradients_and_workspace_sizes():
    rows, dim, vocab = 6, 8, 20
    rng = np.random.default_rng(1)
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    w = rng.standard_normal((vocab, dim)).astype(np.float32)
    y = rng.integers(0, vocab, rows)
    lo, hi = vp.vp_linear_stats_workspace_size(rows, dim, 10)
    assert 0 <= lo <= hi
    lo2, hi2 = vp.vp_linear_backward_workspace_size(2, rows, dim, vocab, 10)
    assert 0 <= lo2 <= hi2
    assert vp.vp_loss_workspace_size(2, rows, vocab) >= 0
    assert vp.vp_backward_workspace_size(2, rows, vocab, 10) >= 0
    gathered = np.stack([vp.vp_linear_stats(h, w[s:s + 10], y, vocab_start=s, vocab_total=vocab,
                                            workspace_size="min") for s in (0, 10)])
    ref = fusedce.linear_ce(h, w, y, return_grad=True)
    only_w = vp.vp_linear_backward(h, w[:10], y, gathered, vocab_start=0, vocab_total=vocab,
                                   return_grad=("weight",))
    assert only_w.grad_hidden is None and only_w.grad_bias is None
    _close(only_w.grad_weight, ref.grad_weight[:10], rtol=1e-4)
    # no gradient asked for: the library refuses it, naming the three buffers
    with pytest.raises(fusedce.NullPointerError,
                       match="fce_vp_linear_backward: gradients->grad_hidden, ->grad_weight and ->grad_bias"):
        vp.vp_linear_backward(h, w[:10], y, gathered, vocab_start=0, vocab_total=vocab,
                              return_grad=False)


@needs_vp
def test_inconsistent_shards_are_nan_and_flagged():
    z, y = _inputs(6, 20, seed=4, ignore=False)
    # two shards that overlap: [0, 10) twice, claiming a vocabulary of 20
    st = [vp.vp_stats(z[:, 0:10], y, vocab_start=0, vocab_total=20) for _ in range(2)]
    res = vp.vp_loss(np.stack(st), y, vocab_total=20, reduction="none")
    assert np.isnan(res.loss).any()
    assert int(res.error_flags[0]) & _lib.FCE_FLAG_SHARDS_INCONSISTENT
    with pytest.raises(ValueError, match="do not tile"):
        vp.vp_loss(np.stack(st), y, vocab_total=20, reduction="none", check_targets=True)
    # sizes that do not sum to vocab_total
    st = [vp.vp_stats(z[:, 0:10], y, vocab_start=0, vocab_total=30),
          vp.vp_stats(z[:, 10:20], y, vocab_start=10, vocab_total=30)]
    res = vp.vp_loss(np.stack(st), y, vocab_total=30, reduction="mean")
    assert np.isnan(res.loss) and int(res.error_flags[0]) & _lib.FCE_FLAG_SHARDS_INCONSISTENT


@needs_vp
def test_out_of_range_target_is_nan_and_flagged():
    z, y = _inputs(5, 20, seed=6, ignore=False)
    y[2] = 20
    st = [vp.vp_stats(z[:, s:s + 10], y, vocab_start=s, vocab_total=20) for s in (0, 10)]
    res = vp.vp_loss(np.stack(st), y, vocab_total=20, reduction="none")
    assert np.isnan(res.loss[2]) and np.isfinite(np.delete(res.loss, 2)).all()
    assert int(res.error_flags[0]) & _lib.FCE_FLAG_TARGET_OUT_OF_RANGE
    with pytest.raises(ValueError, match="outside"):
        vp.vp_loss(np.stack(st), y, vocab_total=20, check_targets=True)


@needs_vp
def test_argument_errors():
    z, y = _inputs(4, 20, seed=8)
    st = vp.vp_stats(z[:, :10], y, vocab_start=0, vocab_total=20)
    with pytest.raises(ValueError, match="gathered_stats"):
        vp.vp_loss(st[:, :4], y, vocab_total=20)
    with pytest.raises(ValueError, match="exceeds vocab_total"):
        vp.vp_stats(z[:, :10], y, vocab_start=15, vocab_total=20)
    with pytest.raises(ValueError, match="class_weights"):
        vp.vp_stats(z[:, :10], y, vocab_start=0, vocab_total=20,
                    class_weights=np.ones(10, np.float32))  # must be the whole vocabulary's
    with pytest.raises(fusedce.FusedCEError):
        vp.vp_stats(z[:, :10], y, vocab_start=0, vocab_total=20, label_smoothing=1.5)
    assert vp.shard_range(10, 0, 3) == (0, 4) and vp.shard_range(10, 2, 3) == (7, 3)
    assert vp.shard_range(12, 2, 3, equal=True) == (8, 4)
    with pytest.raises(ValueError):
        vp.shard_range(10, 0, 3, equal=True)


def _probs(rows, vocab, seed):
    """Class probabilities q [rows, vocab] float32, each row summing to 1 (some entries 0)."""
    rng = np.random.default_rng(seed)
    q = rng.uniform(0.0, 1.0, (rows, vocab)) ** 4
    q[rng.uniform(0.0, 1.0, (rows, vocab)) < 0.3] = 0.0
    q[:, 0] += 1e-3
    return (q / q.sum(axis=1, keepdims=True)).astype(np.float32)


@needs_vp
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", ["plain", "smoothing", "weights", "zloss-softcap-scale"])
def test_class_probabilities_match_unsharded(ranks, reduction, options):
    """Class-probability targets (docs/semantics.md rule 19): each rank passes its columns of q
    to vp_stats and vp_backward; vp_loss reads none (its shard, or None with rows=)."""
    rows, vocab = 12, 53
    z, _ = _inputs(rows, vocab, seed=20 + ranks)
    q = _probs(rows, vocab, seed=ranks)
    kw, g_out = _call_options(options, reduction, rows, vocab)
    ref = fusedce.forward(z, q, return_lse=True, return_z_loss=True, return_argmax=True,
                          return_grad=True, grad_output=g_out, **kw)
    shards = _shards(vocab, ranks, uneven=True)
    q_shards = [np.ascontiguousarray(q[:, s:s + n]) for s, n in shards]  # dense, as the C ABI
    gathered = np.stack([vp.vp_stats(z[:, s:s + n], qs, vocab_start=s, vocab_total=vocab, **kw)
                         for (s, n), qs in zip(shards, q_shards)][::-1])
    res = vp.vp_loss(gathered, q[:, :shards[0][1]], vocab_total=vocab, return_lse=True,
                     return_z_loss=True, return_argmax=True, check_targets=True, **kw)
    _close(res.loss, ref.loss, what="loss")
    _close(res.lse, ref.lse, what="lse")
    _close(res.z_loss, ref.z_loss, what="z_loss")
    np.testing.assert_array_equal(res.argmax, ref.argmax)
    res2 = vp.vp_loss(gathered, None, vocab_total=vocab, rows=rows, target_dtype="float32", **kw)
    np.testing.assert_array_equal(res2.loss, res.loss)
    grads = [vp.vp_backward(z[:, s:s + n], qs, gathered, g_out, vocab_start=s,
                            vocab_total=vocab, **kw) for (s, n), qs in zip(shards, q_shards)]
    _close(np.concatenate(grads, axis=1), ref.grad_logits, what="gradient")


@needs_vp
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_linear_class_probabilities_match_unsharded(ranks):
    rows, dim, vocab = 14, 24, 45
    rng = np.random.default_rng(ranks)
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    w = (rng.standard_normal((vocab, dim)) * 0.3).astype(np.float32)
    b = (rng.standard_normal(vocab) * 0.2).astype(np.float32)
    q = _probs(rows, vocab, seed=30 + ranks)
    kw = dict(reduction="mean", label_smoothing=0.1, z_loss_scale=1e-3)
    ref = fusedce.linear_ce(h, w, q, b, return_grad=True, return_lse=True, **kw)
    shards = _shards(vocab, ranks, uneven=True)
    q_shards = [np.ascontiguousarray(q[:, s:s + n]) for s, n in shards]
    gathered = np.stack([vp.vp_linear_stats(h, w[s:s + n], qs, b[s:s + n], vocab_start=s,
                                            vocab_total=vocab, **kw)
                         for (s, n), qs in zip(shards, q_shards)])
    res = vp.vp_loss(gathered, q[:, :shards[0][1]], vocab_total=vocab, return_lse=True, **kw)
    _close(res.loss, ref.loss, what="loss")
    _close(res.lse, ref.lse, what="lse")
    gh = np.zeros((rows, dim), np.float32)
    gws, gbs = [], []
    for (s, n), qs in zip(shards, q_shards):
        r = vp.vp_linear_backward(h, w[s:s + n], qs, gathered, b[s:s + n], vocab_start=s,
                                  vocab_total=vocab, **kw)
        gh += r.grad_hidden
        gws.append(r.grad_weight)
        gbs.append(r.grad_bias)
    _close(gh, ref.grad_hidden, rtol=1e-4, what="grad_hidden")
    _close(np.concatenate(gws), ref.grad_weight, rtol=1e-4, what="grad_weight")
    _close(np.concatenate(gbs), ref.grad_bias, rtol=1e-4, what="grad_bias")
    # the query takes the probabilities' dtype (the same scratch as for class indices)
    assert (vp.vp_loss_workspace_size(ranks, rows, vocab, target_dtype="float32") ==
            vp.vp_loss_workspace_size(ranks, rows, vocab))


@needs_vp
def test_class_probabilities_argument_errors():
    z, _ = _inputs(4, 20, seed=8)
    q = _probs(4, 20, seed=8)
    with pytest.raises(ValueError, match="columns"):  # the shard's columns of q, not all of them
        vp.vp_stats(z[:, :10], q, vocab_start=0, vocab_total=20)
    q0 = np.ascontiguousarray(q[:, :10])
    with pytest.raises(ValueError, match="dense"):  # the C ABI takes the shard dense
        vp.vp_stats(z[:, :10], q[:, :10], vocab_start=0, vocab_total=20)
    with pytest.raises(TypeError, match="logits' dtype"):
        vp.vp_stats(z[:, :10], q0.astype(np.float16), vocab_start=0, vocab_total=20)
    st = vp.vp_stats(z[:, :10], q0, vocab_start=0, vocab_total=20)
    with pytest.raises(ValueError, match="rows="):
        vp.vp_loss(np.stack([st, st]), None, vocab_total=20)
    with pytest.raises(fusedce.FusedCEError, match="fce_vp_loss: outputs->accuracy"):
        vp.vp_loss(np.stack([st, st]), q[:, :10], vocab_total=20, return_accuracy=True)
    with pytest.raises(fusedce.FusedCEError, match="fce_vp_stats: options->token_scaling"):
        vp.vp_stats(z[:, :10], q0, vocab_start=0, vocab_total=20, token_scaling=True)


def test_older_library_refuses_clearly(monkeypatch):
    """A 0.3 library (or a 0.4 one made to look older) is still accepted for everything else;
    the vocabulary-parallel calls raise UnsupportedError naming the version."""
    z, y = _inputs(4, 20, seed=8)
    if _has_vp():
        monkeypatch.setattr(_lib, "_LIB_VERSION", 300)
    assert not _lib.has_vp()
    fusedce.forward(z, y)  # the rest works
    with pytest.raises(fusedce.UnsupportedError, match="0.4"):
        vp.vp_stats(z[:, :10], y, vocab_start=0, vocab_total=20)
    if torch is not None:
        from fusedce.torch import distributed
        with pytest.raises(fusedce.UnsupportedError, match="0.4"):
            distributed.vocab_parallel_cross_entropy(torch.zeros(2, 3),
                                                     torch.zeros(2, dtype=torch.long))


def test_header_version_and_constants():
    assert (_lib.HEADER_VERSION_MAJOR, _lib.HEADER_VERSION_MINOR) == (1, 0)
    assert fusedce.__version__ == "1.0.0"
    assert _lib.FCE_VP_STATS == vp.VP_STATS == 8
    assert _lib.FCE_VP_STATS_INVARIANT == vp.VP_STATS_INVARIANT == 44
    assert _lib.FCE_FLAG_SHARDS_INCONSISTENT == 2


@needs_vp
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_phases_cuda_torch_tensors(dtype):
    """The phase API on CUDA (torch tensors, the current stream): simulated shards."""
    tdt = getattr(torch, dtype)
    rows, vocab, dim = 64, 1000, 32
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(rows, vocab, generator=gen) * 3).to(tdt).cuda()
    y = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    y[3] = -100
    ref = fusedce.forward(z, y, return_grad=True, label_smoothing=0.1, return_lse=True)
    shards = _shards(vocab, 3, uneven=True)
    gathered = torch.stack([vp.vp_stats(z[:, s:s + n], y, vocab_start=s, vocab_total=vocab,
                                        label_smoothing=0.1) for s, n in shards])
    res = vp.vp_loss(gathered, y, vocab_total=vocab, label_smoothing=0.1, return_lse=True)
    torch.testing.assert_close(res.loss, ref.loss, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(res.lse, ref.lse, rtol=2e-5, atol=2e-5)
    grads = torch.cat([vp.vp_backward(z[:, s:s + n], y, gathered, vocab_start=s,
                                      vocab_total=vocab, label_smoothing=0.1)
                       for s, n in shards], dim=1)
    tol = 1e-4 if dtype == "float32" else 1e-2  # float32 combination on CUDA, 1 bf16 ulp
    torch.testing.assert_close(grads.float(), ref.grad_logits.float(), rtol=tol, atol=tol * 1e-2)
    # the fused linear + CE
    h = torch.randn(rows, dim, generator=gen).to(tdt).cuda()
    w = (torch.randn(vocab, dim, generator=gen) * 0.3).to(tdt).cuda()
    ref = fusedce.linear_ce(h, w, y, return_grad=True)
    gathered = torch.stack([vp.vp_linear_stats(h, w[s:s + n], y, vocab_start=s,
                                               vocab_total=vocab) for s, n in shards])
    res = vp.vp_loss(gathered, y, vocab_total=vocab)
    torch.testing.assert_close(res.loss, ref.loss, rtol=1e-4, atol=1e-4)
    gh = torch.zeros(rows, dim, device="cuda")
    gw = []
    for s, n in shards:
        r = vp.vp_linear_backward(h, w[s:s + n], y, gathered, vocab_start=s, vocab_total=vocab)
        gh += r.grad_hidden
        gw.append(r.grad_weight)
    tol = 1e-4 if dtype == "float32" else 2e-2
    scale = ref.grad_hidden.float().abs().max().item()
    torch.testing.assert_close(gh, ref.grad_hidden.float(), rtol=tol, atol=tol * scale)
    scale = ref.grad_weight.float().abs().max().item()
    torch.testing.assert_close(torch.cat(gw).float(), ref.grad_weight.float(), rtol=tol,
                               atol=tol * scale)
