"""The vocabulary-parallel distillation phases (fce_vp_distill_*) at the array level: P simulated
shards of both the student's and the teacher's logits in one process (NumPy, CPU backend),
every round of statistics gathered by hand, against the unsharded fusedce.distill; and
fusedce.torch.distributed.vocab_parallel_distill in one process and over 2 and 3 processes on
gloo, against fusedce.torch.distill.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_vp_distill.py

Tests skip with their reason where the library lacks the calls or torch is missing.
"""

import numpy as np
import pytest

import fusedce
from fusedce import _lib
from test_distributed import _close, _inputs, _shards, vp


def _has_vp_distill():
    try:
        return not _lib.lacks(_lib.VP_DISTILL_SYMBOLS)
    except Exception:  # no library at all
        return False


needs_vp_distill = pytest.mark.skipif(not _has_vp_distill(),
                                      reason="the library lacks fce_vp_distill_*")


def _step(z, t, y, ranks, uneven, order, g_out, **kw):
    """The sharded step: every round's statistics per shard, gathered in `order`; the loss
    (checked the same from every rank's point of view: it reads the gathered buffer only) and
    the gradient of every shard, concatenated."""
    rows, vocab = z.shape
    shards = _shards(vocab, ranks, uneven)
    rounds = vp.vp_distill_rounds(kw.get("divergence", "forward_kl"), kw.get("beta", 0.5))
    gathered = None
    for rnd in range(1, rounds + 1):
        stats = [vp.vp_distill_stats(z[:, s:s + n], t[:, s:s + n], gathered, vocab_start=s,
                                     vocab_total=vocab, round=rnd, **kw) for s, n in shards]
        assert all(st.shape == (rows, vp.VP_STATS) and st.dtype == np.float32 for st in stats)
        gathered = np.stack([stats[r] for r in order])
    res = vp.vp_distill_loss(gathered, y, vocab_total=vocab, return_lse=True,
                             check_targets=True, **kw)
    grads = [vp.vp_distill_backward(z[:, s:s + n], t[:, s:s + n], gathered, y, g_out,
                                    vocab_start=s, vocab_total=vocab, **kw) for s, n in shards]
    return res, np.concatenate(grads, axis=1), gathered


@needs_vp_distill
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5),
                                             ("jsd", 0.3), ("jsd", 0.0)])
def test_distill_phases_match_unsharded(ranks, reduction, divergence, beta):
    rows, vocab = 12, (53 if ranks == 3 else 52)
    z, y = _inputs(rows, vocab, seed=ranks)
    t, _ = _inputs(rows, vocab, seed=ranks + 10)
    kw = dict(divergence=divergence, beta=beta, temperature=1.7, reduction=reduction,
              softcap=20.0, logit_scale=0.9)
    g_out = (np.random.default_rng(3).uniform(0.5, 2.0, rows).astype(np.float32)
             if reduction == "none" else 1.7)
    ref = fusedce.distill(z, t, y, return_lse=True, return_grad=True, grad_output=g_out, **kw)
    order = list(range(ranks))[::-1]  # any rank order
    res, grad, _ = _step(z, t, y, ranks, ranks == 3, order, g_out, **kw)
    _close(res.loss, ref.loss, what="loss")
    _close(res.lse, ref.lse, what="lse")
    _close(grad, ref.grad_logits, what="gradient")


@needs_vp_distill
def test_rounds():
    assert vp.vp_distill_rounds("forward_kl") == 1
    assert vp.vp_distill_rounds("reverse_kl") == 1
    assert vp.vp_distill_rounds("jsd", 0.5) == 2
    assert vp.vp_distill_rounds("jsd", 0.0) == 1
    assert vp.vp_distill_rounds("jsd", 1.0) == 1
    with pytest.raises(fusedce.InvalidArgumentError, match="teacher->beta"):
        vp.vp_distill_rounds("jsd", 1.5)


@needs_vp_distill
def test_in_place_and_no_targets():
    rows, vocab = 7, 30
    z, _ = _inputs(rows, vocab, seed=5)
    t, _ = _inputs(rows, vocab, seed=6)
    kw = dict(divergence="jsd", beta=0.4)
    ref = fusedce.distill(z, t, return_grad=True, **kw)
    shards = _shards(vocab, 2, uneven=True)
    g1 = np.stack([vp.vp_distill_stats(z[:, s:s + n], t[:, s:s + n], vocab_start=s,
                                       vocab_total=vocab, **kw) for s, n in shards])
    g2 = np.stack([vp.vp_distill_stats(z[:, s:s + n], t[:, s:s + n], g1, vocab_start=s,
                                       vocab_total=vocab, **kw) for s, n in shards])
    res = vp.vp_distill_loss(g2, None, rows=rows, vocab_total=vocab, check_targets=True, **kw)
    _close(res.loss, ref.loss, what="loss")
    for s, n in shards:
        zs = np.ascontiguousarray(z[:, s:s + n])
        out = vp.vp_distill_backward(zs, t[:, s:s + n], g2, vocab_start=s, vocab_total=vocab,
                                     in_place=True, **kw)
        assert out is zs
        _close(zs, ref.grad_logits[:, s:s + n], what="gradient in place")


@needs_vp_distill
def test_inconsistent_statistics_raise():
    """Round 1's statistics where the JSD needs round 2's, and a shard gathered twice."""
    rows, vocab = 5, 20
    z, y = _inputs(rows, vocab, seed=8)
    t, _ = _inputs(rows, vocab, seed=9)
    shards = _shards(vocab, 2, uneven=False)
    kw = dict(divergence="jsd", beta=0.5)
    g1 = np.stack([vp.vp_distill_stats(z[:, s:s + n], t[:, s:s + n], vocab_start=s,
                                       vocab_total=vocab, **kw) for s, n in shards])
    with pytest.raises(ValueError, match="SHARDS_INCONSISTENT|do not tile|inconsistent"):
        vp.vp_distill_loss(g1, y, vocab_total=vocab, check_targets=True, **kw)
    fwd = np.stack([vp.vp_distill_stats(z[:, :10], t[:, :10], vocab_start=0, vocab_total=vocab)
                    for _ in range(2)])
    res = vp.vp_distill_loss(fwd, y, vocab_total=vocab, reduction="none")
    assert int(np.asarray(res.error_flags)[0]) & _lib.FCE_FLAG_SHARDS_INCONSISTENT
    assert np.isnan(res.loss[y != -100]).all()


@needs_vp_distill
def test_errors_name_the_call():
    z = np.zeros((4, 10), np.float32)
    g = np.zeros((1, 4, vp.VP_STATS), np.float32)
    with pytest.raises(fusedce.InvalidArgumentError, match=r"fce_vp_distill_stats: round \(3\)"):
        vp.vp_distill_stats(z, z, vocab_start=0, vocab_total=10, round=3, divergence="jsd")
    with pytest.raises(fusedce.InvalidArgumentError,
                       match="fce_vp_distill_stats: previous is given in round 1"):
        vp.vp_distill_stats(z, z, g, vocab_start=0, vocab_total=10, round=1)
    with pytest.raises(fusedce.InvalidArgumentError, match="fce_vp_distill_stats: vocab_start"):
        vp.vp_distill_stats(z, z, vocab_start=5, vocab_total=10)
    with pytest.raises(fusedce.InvalidArgumentError, match="fce_vp_distill_loss: teacher->beta"):
        vp.vp_distill_loss(g, np.zeros(4, np.int64), vocab_total=10, beta=2.0)


# ============================================================ torch.distributed ====
try:
    import torch
    import torch.distributed as dist
except Exception:  # pragma: no cover - depends on the environment
    torch = None

needs_torch_gloo = pytest.mark.skipif(
    torch is None or not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available")


def _check_torch(group, rank, size, *, divergence, beta, reduction, dtype, seed):
    """fusedce.torch.distributed.vocab_parallel_distill on this rank's columns against
    fusedce.torch.distill on the whole rows (every rank makes the same inputs): the loss, the same
    on every rank, and this rank's columns of the gradient."""
    from fusedce.torch.distributed import vocab_parallel_distill
    rows, vocab = 10, 41
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(2, rows // 2, vocab, generator=g) * 3).to(dtype)
    t = (torch.randn(2, rows // 2, vocab, generator=g) * 3).to(dtype)
    y = torch.randint(0, vocab, (2, rows // 2), generator=g)
    y[0, 1] = -100
    kw = dict(divergence=divergence, beta=beta, temperature=1.5, reduction=reduction,
              softcap=15.0)
    whole = z.clone().requires_grad_(True)
    ref = fusedce.torch.distill(whole, t, target=y, **kw)
    up = torch.rand(ref.shape, generator=g) + 0.5
    (ref * up).sum().backward()
    s, n = vp.shard_range(vocab, rank, size)  # uneven: 41 classes
    cols = slice(s, s + n)
    extra = dict(vocab_start=s, vocab_total=vocab)
    mine = z[..., cols].clone().requires_grad_(True)
    loss, lse = vocab_parallel_distill(mine, t[..., cols], y, group=group, return_lse=True,
                                       **extra, **kw)
    (loss * up).sum().backward()
    _close(loss.detach().numpy(), ref.detach().numpy(), rtol=1e-4 if dtype != torch.float32
           else 2e-5, what=f"loss {divergence} {reduction}")
    _close(mine.grad.float().numpy(), whole.grad[..., cols].float().numpy(),
           rtol=1e-2 if dtype != torch.float32 else 2e-5, what="gradient")
    assert lse.shape == (2, rows // 2) and not lse.requires_grad
    if group is not None:  # bitwise the same loss on every rank
        losses = [torch.empty_like(loss) for _ in range(size)]
        dist.all_gather(losses, loss.detach().contiguous(), group=group)
        for other in losses:
            assert torch.equal(other, losses[0])


def _cases_distill(group, rank, size):
    seed = 0
    for divergence, beta in (("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)):
        for reduction in ("mean", "sum", "none"):
            seed += 1
            _check_torch(group, rank, size, divergence=divergence, beta=beta,
                         reduction=reduction, dtype=torch.float32, seed=seed)
    _check_torch(group, rank, size, divergence="jsd", beta=0.6, reduction="mean",
                 dtype=torch.bfloat16, seed=50)


CASES = {"distill": _cases_distill}


@needs_vp_distill
@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_single_process():
    """Without torch.distributed: one rank holding the whole vocabulary."""
    _cases_distill(None, 0, 1)


@needs_vp_distill
@needs_torch_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_torch_gloo_processes(world, tmp_path, monkeypatch):
    from test_distributed import _spawn
    _spawn(world, "gloo", ("distill",), tmp_path, monkeypatch, module=__name__)
