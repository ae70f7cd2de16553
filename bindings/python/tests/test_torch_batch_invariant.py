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
