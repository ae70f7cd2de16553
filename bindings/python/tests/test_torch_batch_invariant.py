"""fusedce.torch's ``batch_invariant`` keyword (fce_options' batch_invariant, docs/semantics.md
rule 21) on the CPU: it reaches the C calls, and a row's loss, lse and gradient are the same bits
alone and inside a batch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: fusedce.torch is optional")

import fusedce.torch as ftorch  # noqa: E402
from fusedce import _lib  # noqa: E402

_SPIED = ("fce_forward", "fce_backward", "fce_backward_rescale", "fce_linear_ce",
          "fce_forward_workspace_size", "fce_linear_ce_workspace_size")


@pytest.fixture
def seen(monkeypatch):
    """The (function, options->batch_invariant) of every spied C call the test makes."""
    real = _lib.load()
    calls = []

    class Spy:
        def __getattr__(self, name):
            f = getattr(real, name)
            if name not in _SPIED:
                return f

            def call(options, *args):
                calls.append((name, options._obj.batch_invariant))
                return f(options, *args)
            return call

    monkeypatch.setattr(_lib, "load", lambda *a, **k: Spy())
    return calls


@pytest.mark.parametrize("flag", [False, True])
def test_keyword_reaches_the_c_calls_cpu(seen, flag):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 40, generator=g, requires_grad=True)
    y = torch.randint(0, 40, (16,), generator=g)
    ftorch.cross_entropy(z, y, reduction="none", batch_invariant=flag).sum().backward()
    h = torch.randn(16, 8, generator=g, requires_grad=True)
    w = torch.randn(40, 8, generator=g, requires_grad=True)
    ftorch.linear_cross_entropy(h, w, y, reduction="none", batch_invariant=flag).sum().backward()
    names = {name for name, _ in seen}
    assert {"fce_forward", "fce_linear_ce"} <= names, seen
    assert all(bi == int(flag) for _, bi in seen), seen


def test_row_alone_and_in_a_batch_cpu():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(300, 1000, generator=g)
    y = torch.randint(0, 1000, (300,), generator=g)
    h = torch.randn(300, 64, generator=g)
    w = torch.randn(1000, 64, generator=g) * 0.1

    def ce(rows):
        zz = z[rows].clone().requires_grad_(True)
        loss, lse = ftorch.cross_entropy(zz, y[rows], reduction="none", return_lse=True,
                                         batch_invariant=True)
        loss.sum().backward()
        return loss.detach().numpy(), lse.detach().numpy(), zz.grad.numpy()

    def lin(rows):
        hh = h[rows].clone().requires_grad_(True)
        loss = ftorch.linear_cross_entropy(hh, w, y[rows], reduction="none",
                                           batch_invariant=True)
        loss.sum().backward()
        return loss.detach().numpy(), hh.grad.numpy()

    probe = 123
    for f in (ce, lin):
        alone = f([probe])
        for rows, pos in (([probe] + list(range(299)), 0), (list(range(200)) + [probe], 200)):
            batch = f(rows)
            for a, b in zip(alone, batch):
                assert np.array_equal(a[0].view(np.uint32), b[pos].view(np.uint32)), f.__name__


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
def test_unaligned_rows_alone_and_in_a_batch_cuda(dtype, inplace):
    """Rows of 50257 16-bit logits do not start 16-byte aligned, which the CUDA calls need under
    batch_invariant: the torch layer copies them into padded rows. A row's loss, lse and
    gradient are the same bits alone and at several places of several batches (each place
    another alignment), and the flag-off call's to rounding; the caller's logits are only
    overwritten with inplace_backward."""
    V = 50257
    g = torch.Generator(device="cuda").manual_seed(3)
    z = (torch.randn(96, V, device="cuda", generator=g) * 3).to(dtype)
    y = torch.randint(0, V, (96,), device="cuda", generator=g)
    up = torch.randn(96, device="cuda", generator=g)

    def ce(rows, flag=True):
        zz = z[rows].clone().requires_grad_(True)
        before = zz.detach().clone()
        loss, lse = ftorch.cross_entropy(zz, y[rows], reduction="none", return_lse=True,
                                         batch_invariant=flag, inplace_backward=inplace)
        (loss * up[rows]).sum().backward()
        if not inplace:
            assert torch.equal(zz.detach(), before), "the logits were changed"
        return loss.detach(), lse.detach(), zz.grad.detach()

    probe = 7
    alone = ce([probe])
    for rows, pos in (([probe] + list(range(40)), 0), (list(range(63)) + [probe], 63),
                      (list(range(1, 96)), probe - 1)):
        batch = ce(rows)
        for a, b in zip(alone, batch):
            assert torch.equal(_bits(a[0]), _bits(b[pos])), (rows[:3], pos)
    plain = ce(list(range(96)), flag=False)
    torch.testing.assert_close(alone[0][0], plain[0][probe], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone[1][0], plain[1][probe], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone[2][0].float(), plain[2][probe].float(), rtol=2e-2, atol=1e-6)
