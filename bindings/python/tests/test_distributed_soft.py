"""Class-probability targets (docs/semantics.md rule 19) on fusedce.torch.distributed: each rank
passes its shard of the probabilities [..., V_local] to vocab_parallel_cross_entropy and
vocab_parallel_linear_cross_entropy (the fused call and the two phases) over gloo processes,
against the unsharded fusedce.torch calls, values and gradients (the target's own gradient too);
and what is refused with them.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q \
        bindings/python/tests/test_distributed_soft.py
"""

import pytest

from test_distributed import (_assert_close, _layout, _same_on_every_rank, _spawn, needs_gloo,
                              needs_vp, torch)


def _probs(shape, gen, dtype):
    """Class probabilities of the given shape (each row sums to 1, some entries 0)."""
    q = torch.softmax(torch.randn(*shape, generator=gen) * 2, dim=-1)
    q[torch.rand(*shape, generator=gen) < 0.2] = 0.0
    return (q / q.sum(-1, keepdim=True)).to(dtype)


def _check_ce(group, grank, gsize, *, vocab, dtype, reduction, label_smoothing=0.0,
              uneven=False, weight=False, z_loss=0.0, softcap=0.0, q_grad=False, seed=0):
    from fusedce.torch import cross_entropy
    from fusedce.torch.distributed import vocab_parallel_cross_entropy
    gen = torch.Generator().manual_seed(seed)
    s, b = 7, 3
    z = (torch.randn(s, b, vocab, generator=gen) * 3).to(dtype)
    q = _probs((s, b, vocab), gen, dtype)
    cw = torch.rand(vocab, generator=gen) + 0.5 if weight else None
    up = torch.randn(s, b, generator=gen) if reduction == "none" else torch.tensor(1.7)
    start, local, kw = _layout(vocab, grank, gsize, uneven)
    shard = z[..., start:start + local].clone().requires_grad_()
    q_shard = q[..., start:start + local].clone().requires_grad_(q_grad)
    out = vocab_parallel_cross_entropy(shard, q_shard, label_smoothing,
                                       group, reduction=reduction, weight=cw, z_loss=z_loss,
                                       softcap=softcap, return_lse=True, return_z_loss=True,
                                       **kw)
    loss = out.loss
    assert loss.dtype == torch.float32
    assert loss.shape == ((s, b) if reduction == "none" else ())
    _same_on_every_rank(loss.detach(), group)
    (loss * up).sum().backward()
    full = z.reshape(-1, vocab).clone().requires_grad_()
    q_full = q.reshape(-1, vocab).clone().requires_grad_(q_grad)
    ref = cross_entropy(full, q_full, cw, reduction=reduction,
                        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                        return_lse=True, return_z_loss=True)
    (ref.loss.reshape(loss.shape) * up).sum().backward()
    what = f"P={gsize} {dtype} {reduction} eps={label_smoothing} uneven={uneven}"
    _assert_close(loss, ref.loss.reshape(loss.shape), torch.float32, "loss " + what)
    _assert_close(out.lse, ref.lse.reshape(out.lse.shape), torch.float32, "lse " + what)
    _assert_close(out.z_loss, ref.z_loss.reshape(out.z_loss.shape), torch.float32,
                  "z_loss " + what)
    assert shard.grad.dtype == dtype and shard.grad.shape == shard.shape
    _assert_close(shard.grad, full.grad.reshape(s, b, vocab)[..., start:start + local], dtype,
                  "grad " + what)
    if q_grad:
        _assert_close(q_shard.grad, q_full.grad.reshape(s, b, vocab)[..., start:start + local],
                      dtype, "the target's grad " + what)


def _check_linear(group, grank, gsize, *, vocab, dtype, reduction, label_smoothing=0.0,
                  uneven=False, weight=False, q_grad=False, seed=0):
    from fusedce.torch import linear_cross_entropy
    from fusedce.torch.distributed import vocab_parallel_linear_cross_entropy
    gen = torch.Generator().manual_seed(seed)
    s, b, d = 5, 4, 24
    h = torch.randn(s, b, d, generator=gen).to(dtype)
    w = (torch.randn(vocab, d, generator=gen) * 0.3).to(dtype)
    bb = (torch.randn(vocab, generator=gen) * 0.2).to(dtype)
    q = _probs((s, b, vocab), gen, dtype)
    cw = torch.rand(vocab, generator=gen) + 0.5 if weight else None
    up = torch.randn(s, b, generator=gen) if reduction == "none" else torch.tensor(0.8)
    start, local, kw = _layout(vocab, grank, gsize, uneven)
    hh = h.clone().requires_grad_()
    ws = w[start:start + local].clone().requires_grad_()
    bs = bb[start:start + local].clone().requires_grad_()
    q_shard = q[..., start:start + local].clone().requires_grad_(q_grad)
    loss = vocab_parallel_linear_cross_entropy(hh, ws, q_shard, group=group, bias=bs,
                                               reduction=reduction, weight=cw,
                                               label_smoothing=label_smoothing, **kw)
    _same_on_every_rank(loss.detach(), group)
    (loss * up).sum().backward()
    hr, wr, br = (t.clone().requires_grad_() for t in (h, w, bb))
    q_full = q.clone().requires_grad_(q_grad)
    ref = linear_cross_entropy(hr, wr, q_full, linear_bias=br, weight=cw, reduction=reduction,
                               label_smoothing=label_smoothing)
    (ref.reshape(loss.shape) * up).sum().backward()
    what = f"linear P={gsize} {dtype} {reduction} eps={label_smoothing} uneven={uneven}"
    _assert_close(loss, ref.reshape(loss.shape), dtype, "loss " + what)
    _assert_close(hh.grad, hr.grad, dtype, "grad_hidden " + what)
    _assert_close(ws.grad, wr.grad[start:start + local], dtype, "grad_weight " + what)
    _assert_close(bs.grad, br.grad[start:start + local], dtype, "grad_bias " + what)
    if q_grad:
        _assert_close(q_shard.grad, q_full.grad[..., start:start + local], dtype,
                      "the target's grad " + what)


def _refusals(group, grank, gsize):
    from fusedce.torch.distributed import (vocab_parallel_cross_entropy,
                                           vocab_parallel_linear_cross_entropy)
    vocab = 8 * gsize
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(6, 8, generator=gen).requires_grad_()
    q = _probs((6, 8), gen, torch.float32)
    fn = "vocab_parallel_cross_entropy"
    with pytest.raises(ValueError, match=fn + ": return_token_accuracy"):
        vocab_parallel_cross_entropy(z, q, group=group, return_token_accuracy=True)
    with pytest.raises(ValueError, match=fn + ": use_token_scaling"):
        vocab_parallel_cross_entropy(z, q, group=group, use_token_scaling=True)
    with pytest.raises(ValueError, match=fn + ": check_targets"):
        vocab_parallel_cross_entropy(z, q, group=group, check_targets=True)
    with pytest.raises(ValueError, match=fn + r": target of class probabilities must be this "
                       r"rank's shard \[..., 8\]"):
        vocab_parallel_cross_entropy(z, torch.cat([q, q], -1), group=group)
    with pytest.raises(TypeError, match="must match"):
        vocab_parallel_cross_entropy(z, q.double(), group=group)
    h = torch.randn(6, 4, generator=gen)
    w = torch.randn(8, 4, generator=gen).requires_grad_()
    with pytest.raises(ValueError, match="vocab_parallel_linear_cross_entropy: ignore_index"):
        vocab_parallel_linear_cross_entropy(h, w, q, group=group, ignore_index=0)
    with pytest.raises(ValueError, match="requires a gradient is not supported with "
                       "sequence_parallel"):
        vocab_parallel_linear_cross_entropy(h, w, torch.cat([q] * gsize).requires_grad_(),
                                            group=group, sequence_parallel=True)
    assert vocab == 8 * gsize  # (every rank made the same calls: none reached a collective)


def _cases_soft(group, grank, gsize):
    vocab = 10 * gsize
    for dtype in (torch.float32, torch.bfloat16):
        for reduction in ("mean", "sum", "none"):
            _check_ce(group, grank, gsize, vocab=vocab, dtype=dtype, reduction=reduction)
    _check_ce(group, grank, gsize, vocab=vocab + 1, dtype=torch.float32, reduction="mean",
              uneven=True, weight=True, label_smoothing=0.1, seed=1)
    _check_ce(group, grank, gsize, vocab=vocab + 2, dtype=torch.float32, reduction="none",
              uneven=True, z_loss=1e-3, softcap=4.0, seed=2)
    # the target's own gradient (on this rank's columns)
    _check_ce(group, grank, gsize, vocab=vocab + 1, dtype=torch.float32, reduction="mean",
              uneven=True, weight=True, label_smoothing=0.1, softcap=5.0, q_grad=True, seed=3)
    _check_ce(group, grank, gsize, vocab=vocab, dtype=torch.bfloat16, reduction="none",
              q_grad=True, seed=6)
    for dtype in (torch.float32, torch.bfloat16):
        # mean: the fused call (fce_vp_linear_ce); none: the two phases
        for reduction in ("mean", "none"):
            _check_linear(group, grank, gsize, vocab=vocab + 1, dtype=dtype,
                          reduction=reduction, uneven=True, label_smoothing=0.1, seed=4)
    _check_linear(group, grank, gsize, vocab=vocab, dtype=torch.float32, reduction="sum",
                  weight=True, seed=5)
    _check_linear(group, grank, gsize, vocab=vocab + 1, dtype=torch.float32, reduction="mean",
                  uneven=True, weight=True, label_smoothing=0.1, q_grad=True, seed=7)
    _check_linear(group, grank, gsize, vocab=vocab, dtype=torch.float32, reduction="none",
                  q_grad=True, seed=8)
    _refusals(group, grank, gsize)


CASES = {"soft": _cases_soft}


@needs_vp
@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_processes_class_probabilities(world, tmp_path, monkeypatch):
    _spawn(world, "gloo", ("soft",), tmp_path, monkeypatch, module=__name__)
