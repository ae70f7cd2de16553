"""batch_invariant=True on fusedce.torch.distributed.vocab_parallel_cross_entropy over gloo
processes (docs/semantics.md rule 21), and over NCCL on two GPUs where there are: each token's
loss ('none'), lse, entropy and gradient columns are the same bits on 2 and 3 ranks as in one
process over the whole vocabulary (on the same backend and device model), and inside a smaller
batch.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q \
        bindings/python/tests/test_distributed_invariant.py
"""

import os

import pytest

import test_distributed
from test_distributed import _layout, _spawn, needs_gloo, needs_nccl, needs_vp, torch

VOCAB = 1206  # divisible by 2 and 3: equal shards (uneven ones on 4 ranks)
CASES_KW = [dict(), dict(label_smoothing=0.1, z_loss=1e-3), dict(softcap=15.0)]


def _inputs(dev="cpu"):
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(6, 4, VOCAB, generator=gen) * 4
    y = torch.randint(0, VOCAB, (6, 4), generator=gen)
    y[1, 2] = -100
    up = torch.randn(6, 4, generator=gen)
    return z.to(dev), y.to(dev), up.to(dev)


def _step(logits, y, up, group, kw, **layout):
    from fusedce.torch.distributed import vocab_parallel_cross_entropy
    x = logits.clone().requires_grad_()
    out = vocab_parallel_cross_entropy(x, y, group=group, reduction="none", return_lse=True,
                                       return_entropy=True, batch_invariant=True, **kw, **layout)
    (out.loss * up).sum().backward()
    return out.loss.detach(), out.lse.detach(), out.entropy.detach(), x.grad


def _cases_invariant(group, grank, gsize):
    dev = test_distributed.DEV  # cuda:<rank> in the NCCL workers
    ref = torch.load(os.environ["FCE_TEST_INVARIANT_REF"], map_location=dev)
    z, y, up = _inputs(dev)
    start, local, layout = _layout(VOCAB, grank, gsize, VOCAB % gsize != 0)
    for i, kw in enumerate(CASES_KW):
        loss, lse, ent, grad = _step(z[..., start:start + local], y, up, group, kw, **layout)
        r_loss, r_lse, r_ent, r_grad = ref[i]
        what = f"{kw} on {gsize} ranks"
        assert torch.equal(loss, r_loss), "loss " + what
        assert torch.equal(lse, r_lse), "lse " + what
        assert torch.equal(ent, r_ent), "entropy " + what
        assert torch.equal(grad, r_grad[..., start:start + local]), "gradient " + what
        # rows 2..3 of the sequence dimension alone
        loss2, _, _, grad2 = _step(z[2:4, :, start:start + local], y[2:4], up[2:4], group, kw,
                                   **layout)
        assert torch.equal(loss2, r_loss[2:4]), "loss of a smaller batch " + what
        assert torch.equal(grad2, r_grad[2:4, :, start:start + local]), "gradient " + what


CASES = {"invariant": _cases_invariant}


@needs_vp
@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_processes_batch_invariant(world, tmp_path, monkeypatch):
    """One process over the whole vocabulary (no process group) makes the reference; the ranks
    of a gloo group compare their results with it bit for bit. Also against the unsharded
    fusedce.torch.cross_entropy, to float32 rounding."""
    _reference(tmp_path, monkeypatch, "cpu")
    _spawn(world, "gloo", ("invariant",), tmp_path, monkeypatch, module=__name__)


@needs_vp
@needs_nccl
@pytest.mark.skipif(torch is None or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_processes_batch_invariant(tmp_path, monkeypatch):
    """The same over NCCL on every GPU of the machine (the CUDA backend; uneven shards where
    the vocabulary does not divide): the reference on cuda:0 alone."""
    _reference(tmp_path, monkeypatch, "cuda:0")
    _spawn(torch.cuda.device_count(), "nccl", ("invariant",), tmp_path, monkeypatch,
           module=__name__)


def _reference(tmp_path, monkeypatch, dev):
    from fusedce.torch import cross_entropy
    z, y, up = _inputs(dev)
    ref = []
    for kw in CASES_KW:
        loss, lse, ent, grad = _step(z, y, up, None, kw)
        full = z.reshape(-1, VOCAB).clone().requires_grad_()
        plain = cross_entropy(full, y.reshape(-1), reduction="none", return_lse=True,
                              return_entropy=True, **kw)
        (plain.loss * up.reshape(-1)).sum().backward()
        torch.testing.assert_close(loss.reshape(-1), plain.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.reshape(-1), plain.lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.reshape(-1), plain.entropy, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.reshape(-1, VOCAB), full.grad, rtol=1e-5, atol=1e-6)
        ref.append((loss, lse, ent, grad))
    path = str(tmp_path / "reference.pt")
    torch.save([tuple(t.cpu() for t in r) for r in ref], path)
    monkeypatch.setenv("FCE_TEST_INVARIANT_REF", path)
