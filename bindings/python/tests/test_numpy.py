"""The Python binding on the CPU backend, with NumPy, against an independent float64 reference
(fce_reference.py). Runs in CI (`make test`): no GPU, no torch.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_numpy.py
"""

import ctypes
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import fce_reference as R
import fusedce
from fusedce import _lib
from numpy_cases import (LIN_D, LIN_N, LIN_V, N, OPTION_SETS, REDUCTIONS, V, _weights,
                         assert_close, make_inputs, make_linear, ml_dtypes, poison)


# ------------------------------------------------------------------ version, ABI ----
def test_version_matches_header():
    major, minor, patch = fusedce.library_version()
    assert major == _lib.HEADER_VERSION_MAJOR
    assert _lib.version() == major * 10000 + minor * 100 + patch
    assert fusedce.__version__.split(".")[0] == str(major)


def test_version_check_rejects_other_major():
    _lib.check_version(_lib.HEADER_VERSION_NUMBER)        # same
    _lib.check_version(_lib.HEADER_VERSION_NUMBER + 1)    # newer patch: fine
    _lib.check_version(_lib.HEADER_VERSION_NUMBER + 100)  # newer minor: fine
    newer, this = (_lib.format_version(_lib.HEADER_VERSION_NUMBER + 10000),
                   _lib.format_version(_lib.HEADER_VERSION_NUMBER))
    major = _lib.HEADER_VERSION_MAJOR
    with pytest.raises(fusedce.VersionMismatchError,
                       match=re.escape(f"{newer} (major {major + 1})") + ".*"
                       + re.escape(f"{this} (major {major})")):
        _lib.check_version(_lib.HEADER_VERSION_NUMBER + 10000)
    with pytest.raises(ImportError, match="libfusedce version 2.0.0"):
        _lib.check_version(20000, 100)


def test_options_struct_layout():
    assert ctypes.sizeof(_lib.Options) == _lib.FCE_OPTIONS_SIZE_V1_0 == 120
    assert ctypes.sizeof(_lib.Outputs) == _lib.FCE_OUTPUTS_SIZE_V1_0 == 64
    assert ctypes.sizeof(_lib.Gradients) == _lib.FCE_GRADIENTS_SIZE_V1_0 == 72
    o = _lib.default_options()
    assert o.struct_size == ctypes.sizeof(_lib.Options) == _lib.options_size()
    assert o.ignore_index == -100 and o.logit_scale == 1.0 and o.softcap == 0.0
    assert o.backend == _lib.FCE_BACKEND_CUDA and o.dtype == _lib.FCE_FLOAT32
    assert o.target_dtype == _lib.FCE_INT64 and o.reduction == _lib.FCE_REDUCTION_MEAN
    assert (o.row_stride, o.grad_row_stride, o.shift_seq_len, o.hidden_row_stride) == (0, 0, 0, 0)
    assert (o.deterministic, o.accumulate, o.grad_weight_fp32, o.vp_entropy) == (0, 0, 0, 0)
    # field offsets as in the C header
    offsets = {name: getattr(_lib.Options, name).offset for name, _ in _lib.Options._fields_}
    assert offsets["ignore_index"] == 16 and offsets["backend"] == 56
    assert offsets["label_smoothing"] == 72 and offsets["vp_entropy"] == 100
    assert (offsets["shift"], offsets["token_scaling"], offsets["batch_invariant"]) == (104, 112, 116)
    assert (o.shift, o.token_scaling, o.vp_entropy, o.batch_invariant) == (0, 0, 0, 0)
    # the outputs, by name, in the order of the C header
    out = _lib.outputs(loss=8, argmax=16, error_flags=24)
    assert out.struct_size == 64 and (out.loss, out.lse, out.argmax, out.error_flags) == (
        8, None, 16, 24)
    assert _lib.Outputs.error_flags.offset == 48 and _lib.Gradients.grad_hidden_dtype.offset == 48
    assert _lib.Outputs.entropy.offset == 56 and out.entropy is None
    assert (_lib.Gradients.grad_lse.offset, _lib.Gradients.grad_entropy.offset) == (56, 64)


def test_version_rule():
    """One rule for every binding (bindings/README.md): the major version must be equal; an older
    minor and a newer minor are accepted."""
    major = _lib.HEADER_VERSION_MAJOR * 10000
    for accepted in (major, major + 100, major + 9999,
                     max(major, _lib.HEADER_VERSION_NUMBER - 100)):
        _lib.check_version(accepted)
    for refused in (major + 10000, major - 1 if major else 10000):
        with pytest.raises(fusedce.VersionMismatchError, match="major versions must be equal"):
            _lib.check_version(refused)


def test_older_library_lacks_functions(monkeypatch):
    """A library of the same major version without the functions added later is accepted: what
    it has works (with the 0.1 struct_size for an 0.1/0.2 library), each function it lacks
    raises UnsupportedError "<function>: needs libfusedce >= 0.x" when called."""
    real = _lib.load()

    class Old:  # a 0.1 library: only the functions 0.1 had
        pass

    old = Old()
    for name in ("fce_version", "fce_status_string", "fce_last_error", "fce_options_default",
                 "fce_forward_workspace_size", "fce_forward", "fce_backward_workspace_size",
                 "fce_backward", "fce_linear_ce_workspace_size", "fce_linear_ce",
                 "fce_cuda_available"):
        setattr(old, name, getattr(real, name))
    missing = _lib._declare(old)
    assert missing == frozenset(_lib.SINCE)
    monkeypatch.setattr(_lib, "_LIB", old)
    monkeypatch.setattr(_lib, "_LIB_VERSION", 100)
    monkeypatch.setattr(_lib, "_LIB_MISSING", missing)
    a, g = np.ones(4, np.float32), np.full(1, 2.0, np.float32)
    with pytest.raises(fusedce.UnsupportedError,
                       match=r"^fce_scale_gradient: needs libfusedce >= 0\.2; the loaded library "
                             r"\(.*\) is 0\.1\.0"):
        _lib.scale_gradient(_lib.FCE_BACKEND_CPU, _lib.FCE_FLOAT32, 4, a.ctypes.data,
                            g.ctypes.data)
    with pytest.raises(fusedce.UnsupportedError, match=r"fce_vp_stats: needs libfusedce >= 0\.4"):
        old.fce_vp_stats()
    assert fusedce.build_info() is None and not _lib.has_vp()
    with pytest.raises(fusedce.UnsupportedError, match=r"needs libfusedce >= 0\.4"):
        _lib.require_vp()
    z, y = make_inputs()
    r = fusedce.forward(z, y, return_grad=True)  # what the old library has works
    ref = R.cross_entropy(z, y)
    assert_close(r.loss, ref["loss"], 1e-5)


def test_status_strings():
    assert "NULL" in fusedce.status_string(_lib.FCE_ERROR_NULL_POINTER)
    assert fusedce.status_string(_lib.FCE_SUCCESS).startswith("FCE_SUCCESS")


def _run_python(code, env_library):
    env = dict(os.environ)
    env["FUSEDCE_LIBRARY"] = env_library
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_library_not_found_message(tmp_path):
    missing = str(tmp_path / "nope" / "libfusedce.so")
    p = _run_python("import fusedce\ntry:\n    fusedce.load()\nexcept fusedce.LibraryNotFoundError "
                    "as e:\n    print('NOTFOUND', e)\n", missing)
    assert p.returncode == 0, p.stderr
    assert "NOTFOUND" in p.stdout and "FUSEDCE_LIBRARY" in p.stdout and missing in p.stdout


def test_library_from_folder():
    folder = os.path.dirname(fusedce.library_path())
    p = _run_python("import fusedce; print(fusedce.library_version())", folder)
    assert p.returncode == 0, p.stderr
    assert str(fusedce.library_version()) in p.stdout


# ---------------------------------------------------------- forward / backward ----
@pytest.mark.parametrize("std", [1.0, 30.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(OPTION_SETS))
def test_forward_backward_float32(case, reduction, std):
    opts = OPTION_SETS[case]
    z, y = make_inputs(std=std, seed=hash((case, reduction, std)) % 1000,
                       ignore_index=opts.get("ignore_index", -100))
    if reduction == "none":
        g = np.random.default_rng(1).uniform(-2, 2, N).astype(np.float32)
    else:
        g = np.array(0.75, dtype=np.float32)
    ref = R.cross_entropy(z, y, reduction=reduction, grad_output=g, **opts)
    loss = poison((N,) if reduction == "none" else ())
    lse, zl, grad = poison((N,)), poison(()), poison((N, V))
    r = fusedce.forward(z, y, reduction=reduction, loss=loss, lse=lse, z_loss=zl,
                        grad_logits=grad, grad_output=g, **opts)
    assert r.loss is loss and r.grad_logits is grad
    assert_close(loss, ref["loss"], 1e-5, "loss")
    assert_close(lse, ref["lse"], 1e-5, "lse")
    assert_close(zl, ref["z_loss"], 1e-5, "z_loss")
    assert_close(grad, ref["grad"], 1e-5, "grad_logits")
    assert int(r.error_flags[0]) == 0

    # loss only: the same loss
    r2 = fusedce.forward(z, y, reduction=reduction, **opts)
    np.testing.assert_array_equal(r2.loss, loss)

    # argmax and accuracy (rule 15), written in the same pass
    r3 = fusedce.forward(z, y, reduction=reduction, return_argmax=True, return_accuracy=True,
                         **opts)
    np.testing.assert_array_equal(r3.argmax, ref["argmax"])
    assert_close(r3.accuracy, ref["accuracy"], 1e-6, "accuracy")
    np.testing.assert_array_equal(r3.loss, loss)

    # fce_backward from the saved lse: the gradient fce_forward wrote, to the rounding of the
    # float32 lse (docs/semantics.md rule 12: no longer bit for bit)
    gb = fusedce.backward(z, y, lse, g, reduction=reduction, grad_logits=poison((N, V)), **opts)
    assert_close(gb, ref["grad"], 1e-5, "backward grad")
    assert_close(gb, grad, 1e-5, "backward grad vs forward grad")


def test_reference_gradient_by_finite_differences():
    """The reference's analytic gradient is itself checked against central differences."""
    z, y = make_inputs(n=6, v=11, std=2.0, seed=3)
    w = _weights(11)
    opts = dict(class_weights=w, label_smoothing=0.1, z_loss_scale=0.01, softcap=3.0,
                logit_scale=0.8, shift_seq_len=3)
    for reduction in REDUCTIONS:
        zz = z.astype(np.float64)
        ref = R.cross_entropy(zz, y, reduction=reduction, **opts)["grad"]
        # (token scaling's p_y is a constant for the gradient: not checked by differences)
        num = np.zeros_like(zz)
        h = 1e-6
        for i in range(zz.shape[0]):
            for j in range(zz.shape[1]):
                zp, zm = zz.copy(), zz.copy()
                zp[i, j] += h
                zm[i, j] -= h
                lp = np.sum(R.cross_entropy(zp, y, reduction=reduction, **opts)["loss"])
                lm = np.sum(R.cross_entropy(zm, y, reduction=reduction, **opts)["loss"])
                num[i, j] = (lp - lm) / (2 * h)
        np.testing.assert_allclose(ref, num, rtol=1e-5, atol=1e-7)


def test_grad_output_scalar_forms():
    z, y = make_inputs()
    ref = R.cross_entropy(z, y, grad_output=2.5)["grad"]
    for g in (2.5, np.float32(2.5), np.array(2.5, np.float32), np.array([2.5], np.float32)):
        r = fusedce.forward(z, y, return_grad=True, grad_output=g)
        assert_close(r.grad_logits, ref, 1e-5, repr(g))
    r = fusedce.forward(z, y, reduction="none", return_grad=True, grad_output=0.5)
    assert_close(r.grad_logits, R.cross_entropy(z, y, reduction="none", grad_output=0.5)["grad"],
                 1e-5)


def test_shift_equals_explicitly_shifted_targets():
    b, t = 4, 6
    z, y = make_inputs(n=b * t)
    ref_rows = R.cross_entropy(z, y, reduction="none", shift_seq_len=t)["loss"]
    # the same thing by hand: logits[:, :-1] against targets[:, 1:]
    zs = z.reshape(b, t, V)[:, :-1].reshape(-1, V)
    ys = y.reshape(b, t)[:, 1:].reshape(-1)
    direct = fusedce.forward(zs, ys, reduction="none").loss
    shifted = fusedce.forward(z, y, reduction="none", shift_seq_len=t).loss
    assert np.all(shifted.reshape(b, t)[:, -1] == 0)
    assert_close(shifted.reshape(b, t)[:, :-1].reshape(-1), direct, 1e-6)
    assert_close(shifted, ref_rows, 1e-5)
    m1 = fusedce.forward(z, y, shift_seq_len=t).loss
    m2 = fusedce.forward(zs, ys).loss
    assert_close(m1, m2, 1e-6)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_shift_k_equals_explicitly_shifted_targets(k):
    """shift=k (0.3): logits[:, :-k] against targets[:, k:], without a copy."""
    b, t = 4, 6
    z, y = make_inputs(n=b * t, seed=k)
    zs = z.reshape(b, t, V)[:, :t - k].reshape(-1, V)
    ys = np.ascontiguousarray(y.reshape(b, t)[:, k:].reshape(-1))
    direct = fusedce.forward(zs, ys, reduction="none", return_argmax=True, return_grad=True)
    r = fusedce.forward(z, y, reduction="none", shift_seq_len=t, shift=k, return_argmax=True,
                        return_grad=True)
    rows = r.loss.reshape(b, t)
    assert np.all(rows[:, t - k:] == 0)
    assert_close(rows[:, :t - k].reshape(-1), direct.loss, 1e-6)
    assert np.all(r.argmax.reshape(b, t)[:, t - k:] == -1)
    am = r.argmax.reshape(b, t)[:, :t - k].reshape(-1)
    np.testing.assert_array_equal(am, np.where(ys == -100, -1, direct.argmax))
    grad = r.grad_logits.reshape(b, t, V)
    assert np.all(grad[:, t - k:] == 0)
    assert_close(grad[:, :t - k].reshape(-1, V), direct.grad_logits, 1e-6)
    mean = fusedce.forward(z, y, shift_seq_len=t, shift=k, return_accuracy=True)
    flat = fusedce.forward(zs, ys, return_accuracy=True)
    assert_close(mean.loss, flat.loss, 1e-6)
    assert_close(mean.accuracy, flat.accuracy, 1e-7)
    if k == 1:  # 0 and 1 are the same shift
        np.testing.assert_array_equal(
            fusedce.forward(z, y, reduction="none", shift_seq_len=t).loss, r.loss)
    with pytest.raises(ValueError, match="shift_seq_len"):
        fusedce.forward(z, y, shift=k)  # a shift needs the sequence length


def test_argmax_and_accuracy_corners():
    """Rule 15: ties go to the lowest index, a NaN is the largest, ignored rows get -1 and do not
    count; an out-of-range target counts and is never right; every row ignored: accuracy 0."""
    v = 6
    z = np.zeros((6, v), np.float32)
    z[0, [2, 4]] = 3.0                 # tie: 2
    z[1, 3], z[1, 5] = np.nan, 9.0     # NaN: 3
    z[2, 1] = -np.inf                  # all 0 but one -inf: 0
    z[3, 5] = 1.0
    z[4, 0] = 2.0
    z[5, 4] = 7.0
    y = np.array([2, 3, 0, -100, v + 3, 1])
    ref = R.cross_entropy(z, y)
    for reduction in REDUCTIONS:
        r = fusedce.forward(z, y, reduction=reduction, return_argmax=True, return_accuracy=True)
        np.testing.assert_array_equal(r.argmax, [2, 3, 0, -1, 0, 4])
        if reduction == "none":
            np.testing.assert_array_equal(r.accuracy, [1, 1, 1, 0, 0, 0])
        else:  # 3 right of the 5 non-ignored rows (the invalid one counts, never right)
            assert r.accuracy.shape == () and float(r.accuracy) == np.float32(3 / 5)
    np.testing.assert_array_equal(ref["argmax"], [2, 3, 0, -1, 0, 4])
    # given buffers, and every row ignored
    am, acc = np.full(6, 77, np.int64), np.full((), 5.0, np.float32)
    r = fusedce.forward(z, np.full(6, -100), argmax=am, accuracy=acc)
    assert r.argmax is am and r.accuracy is acc
    assert np.all(am == -1) and float(acc) == 0.0
    with pytest.raises(TypeError, match="int64"):
        fusedce.forward(z, y, argmax=np.zeros(6, np.int32))
    with pytest.raises(ValueError, match="accuracy"):
        fusedce.forward(z, y, reduction="none", accuracy=np.zeros((), np.float32))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_adversarial_rows_exact(reduction):
    """The 0.3 precision contract (rule 9): rows whose logits share a huge offset are exact, -inf
    entries are zero probabilities, a -inf target logit gives loss +inf, a NaN row NaN, and a
    row holding a +inf NaN too (rule 10: torch's log_softmax), lse included."""
    v = 13
    rng = np.random.default_rng(5)
    z = rng.standard_normal((10, v)).astype(np.float32)
    z[0] = -1e30                       # all equal, huge negative: uniform
    z[1] = -1e30
    z[1, 4] = -1e30 + 2e23             # a huge offset and a spread
    z[2, [1, 5, 7]] = -np.inf          # -inf entries
    z[3] = 1e30                        # all equal, huge positive
    z[4, :] = 1e4 * rng.standard_normal(v).astype(np.float32)  # wide spread
    z[5, 3] = -np.inf                  # -inf target logit
    z[6, 0] = np.nan
    z[8, 11] = np.inf                  # a +inf, the target elsewhere
    z[9, [2, 5]] = np.inf              # two +inf, the target on one
    z[9, 0] = -np.inf
    y = np.array([3, 4, 2, 0, 9, 3, 1, 7, 1, 5])
    nan_rows = [6, 8, 9]
    ref = R.cross_entropy(z, y, reduction=reduction)
    r = fusedce.forward(z, y, reduction=reduction, return_grad=True, return_lse=True,
                        return_argmax=True)
    assert np.all(np.isnan(ref["lse"][nan_rows])) and np.all(np.isnan(r.lse[nan_rows]))
    assert_close(r.lse[np.isfinite(ref["lse"])], ref["lse"][np.isfinite(ref["lse"])], 1e-6)
    assert list(r.argmax[[6, 8, 9]]) == [0, 11, 2]
    if reduction == "none":
        loss = r.loss
        assert np.isposinf(loss[5]) and np.all(np.isnan(loss[nan_rows]))
        assert np.all(np.isnan(ref["loss"][nan_rows]))
        fin = np.isfinite(ref["loss"])
        np.testing.assert_allclose(loss[fin], ref["loss"][fin], rtol=1e-5, atol=1e-5)
        assert abs(loss[0] - np.log(v)) <= 1e-6 and abs(loss[3] - np.log(v)) <= 1e-6
    else:
        assert np.isnan(r.loss)  # the NaN rows win over the +inf loss of row 5
    g = r.grad_logits
    assert np.all(np.isnan(g[nan_rows]))
    assert np.all(np.isfinite(np.delete(g, nan_rows, axis=0)))
    keep = [i for i in range(10) if i not in nan_rows]
    scale = 1.0 if reduction != "mean" else 1.0 / 10
    # finite rows of the gradient: exact to float32 (p = 1/V on the flat rows)
    want = ref["grad"][keep]
    if reduction == "mean":  # the reference's mean is NaN-poisoned: rebuild it for g = 1/10
        want = R.cross_entropy(z[keep], y[keep], reduction="sum")["grad"] * scale
    np.testing.assert_allclose(g[keep], want, rtol=1e-5, atol=1e-6 * scale)


def test_ignored_rows_get_zero_loss_and_gradient():
    z, y = make_inputs()
    y[:] = -100
    y[3] = 7
    r = fusedce.forward(z, y, reduction="none", grad_logits=poison((N, V)),
                        lse=poison((N,)))
    assert np.all(r.loss[np.arange(N) != 3] == 0)
    assert np.all(r.grad_logits[np.arange(N) != 3] == 0)
    assert np.all(np.isfinite(r.lse))  # lse is written for ignored rows too


def test_mean_over_no_rows_is_zero():
    z, y = make_inputs()
    y[:] = -100
    r = fusedce.forward(z, y, return_grad=True, return_z_loss=True, z_loss_scale=0.1)
    assert float(r.loss) == 0.0 and float(r.z_loss) == 0.0
    assert np.all(r.grad_logits == 0)


def test_empty_batch():
    """Zero rows are an empty problem (docs/semantics.md "Zero rows"): the reduced losses, the
    z-loss total and the accuracy are 0, everything per row is empty, the linear gradients of
    the weight and bias are 0 (or untouched with accumulate), the queries say 0 bytes. Negative
    sizes cannot be made from arrays; the library's check is test_api / test_empty's."""
    z, y = np.zeros((0, V), np.float32), np.zeros(0, np.int64)
    assert fusedce.forward_workspace_size(0, V) == 0
    assert fusedce.backward_workspace_size(0, V) == 0
    assert fusedce.linear_ce_workspace_size(0, LIN_D, LIN_V) == (0, 0)
    for reduction in REDUCTIONS:
        for opts in ({}, OPTION_SETS["everything-0.3"]):
            r = fusedce.forward(z, y, reduction=reduction, return_grad=True, return_lse=True,
                                return_z_loss=True, return_argmax=True, return_accuracy=True,
                                **opts)
            none = reduction == "none"
            assert r.loss.shape == ((0,) if none else ())
            assert none or (float(r.loss) == 0.0 and not np.signbit(r.loss))
            assert float(r.z_loss) == 0.0
            assert r.accuracy.shape == ((0,) if none else ()) and (none or r.accuracy == 0)
            assert r.grad_logits.shape == (0, V) and r.lse.shape == (0,)
            assert r.argmax.shape == (0,) and int(r.error_flags[0]) == 0
            g = fusedce.backward(z, y, r.lse, reduction=reduction, **opts)
            assert g.shape == (0, V)
        h, W, b, _ = make_linear()
        for accumulate in (False, True):
            gw = np.full_like(W, 3.0)
            lr = fusedce.linear_ce(h[:0], W, y, b, reduction=reduction, return_grad=True,
                                   accumulate=accumulate, grad_weight=gw, return_z_loss=True)
            assert lr.grad_hidden.shape == (0, LIN_D)
            assert np.all(lr.grad_weight == (3.0 if accumulate else 0.0))
            assert np.all(lr.grad_bias == 0.0)  # allocated as zeros under accumulate
            assert float(lr.z_loss) == 0.0 and (reduction == "none" or float(lr.loss) == 0.0)


def test_query_errors_name_the_call():
    """An option that the workspace query the call makes first finds wrong is reported under the
    call's name (the user never called the query); the public queries keep their own."""
    from fusedce import vocab_parallel as vp
    z, y = make_inputs()
    h, W, b, yl = make_linear()
    g = np.zeros((2, N, vp.VP_STATS), np.float32)
    lse = np.zeros(N, np.float32)
    calls = {
        "fce_forward": lambda **k: fusedce.forward(z, y, **k),
        "fce_backward": lambda **k: fusedce.backward(z, y, lse, **k),
        "fce_linear_ce": lambda **k: fusedce.linear_ce(h, W, yl, b, **k),
        "fce_vp_loss": lambda **k: vp.vp_loss(g, y, vocab_total=2 * V, **k),
        "fce_vp_backward": lambda **k: vp.vp_backward(z, y, g, vocab_total=2 * V, vocab_start=0,
                                                      **k),
        "fce_vp_linear_stats": lambda **k: vp.vp_linear_stats(h, W, yl, vocab_total=LIN_V + 3,
                                                              vocab_start=0, **k),
        "fce_vp_linear_backward": lambda **k: vp.vp_linear_backward(
            h, W, yl, np.zeros((1, LIN_N, vp.VP_STATS), np.float32), vocab_total=LIN_V,
            vocab_start=0, return_grad=True, **k),
        "fce_forward_workspace_size": lambda **k: fusedce.forward_workspace_size(N, V, **k),
        "fce_linear_ce_workspace_size": lambda **k: fusedce.linear_ce_workspace_size(4, 5, 6, **k),
    }
    for name, call in calls.items():
        with pytest.raises(fusedce.InvalidArgumentError) as e:
            call(label_smoothing=1.5)
        assert e.value.message == name + ": options->label_smoothing (1.5) must be in [0, 1)"
        assert e.value.function == name


def test_float64_is_refused_clearly():
    """float64 is no dtype of the library: refused with the call, the argument and the cast, in
    the words fusedce.torch uses."""
    from fusedce import vocab_parallel as vp
    z, y = make_inputs()
    h, W, b, yl = make_linear()
    cases = [
        ("fusedce.forward: logits", lambda: fusedce.forward(z.astype(np.float64), y)),
        ("fusedce.backward: logits", lambda: fusedce.backward(z.astype(np.float64), y,
                                                              np.zeros(N, np.float32))),
        ("fusedce.linear_ce: hidden", lambda: fusedce.linear_ce(h.astype(np.float64), W, yl)),
        ("fusedce.linear_ce: weight", lambda: fusedce.linear_ce(h, W.astype(np.float64), yl)),
        ("fusedce.vocab_parallel.vp_stats: logits",
         lambda: vp.vp_stats(z.astype(np.float64), y, vocab_total=V, vocab_start=0)),
    ]
    for where, call in cases:
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value) == (where + " dtype float64 is not supported; supported: float32, "
                                "float16, bfloat16 (cast with .astype(numpy.float32))")


def test_invalid_target_nan_and_flag():
    z, y = make_inputs()
    y[2] = V + 5
    y[4] = -7
    r = fusedce.forward(z, y, reduction="none", return_grad=True)
    assert np.isnan(r.loss[2]) and np.isnan(r.loss[4])
    assert np.all(np.isfinite(np.delete(r.loss, [2, 4])))
    assert np.all(np.isnan(r.grad_logits[2]))
    assert int(r.error_flags[0]) & _lib.FCE_FLAG_TARGET_OUT_OF_RANGE
    assert np.isnan(fusedce.forward(z, y).loss)
    with pytest.raises(ValueError, match="outside"):
        fusedce.forward(z, y, check_targets=True)
    # the caller's flags word is ORed into, never cleared
    flags = np.zeros(1, np.uint32)
    fusedce.forward(z, y, error_flags=flags)
    z2, y2 = make_inputs()
    fusedce.forward(z2, y2, error_flags=flags)
    assert flags[0] == _lib.FCE_FLAG_TARGET_OUT_OF_RANGE
    with pytest.raises(ValueError):
        fusedce.check_error_flags(flags)


@pytest.mark.parametrize("tdtype", [np.int32, np.int64])
def test_target_dtypes(tdtype):
    z, y = make_inputs(target_dtype=tdtype)
    ref = R.cross_entropy(z, y)
    assert_close(fusedce.forward(z, y).loss, ref["loss"], 1e-5)
    with pytest.raises(TypeError, match="target_dtype"):
        fusedce.forward(z, y, target_dtype="int64" if tdtype == np.int32 else "int32")


def test_row_strides_and_no_write_outside():
    z, y = make_inputs()
    big = np.full((N, V + 13), np.nan, np.float32)
    big[:, :V] = z
    gbig = np.full((N, V + 7), 7.0, np.float32)
    r = fusedce.forward(big[:, :V], y, grad_logits=gbig[:, :V], row_stride=V + 13,
                        grad_row_stride=V + 7)
    ref = R.cross_entropy(z, y)
    assert_close(r.loss, ref["loss"], 1e-5)
    assert_close(gbig[:, :V], ref["grad"], 1e-5)
    assert np.all(gbig[:, V:] == 7.0)
    with pytest.raises(ValueError, match="row_stride"):
        fusedce.forward(big[:, :V], y, row_stride=V)
    g = fusedce.backward(big[:, :V], y, fusedce.forward(z, y, return_lse=True).lse,
                         grad_logits=gbig[:, :V])
    assert_close(g, ref["grad"], 1e-5)


def test_in_place_gradient():
    z, y = make_inputs(std=5.0)
    ref = R.cross_entropy(z, y, label_smoothing=0.1)
    zc = z.copy()
    r = fusedce.forward(zc, y, in_place=True, label_smoothing=0.1)
    assert r.grad_logits is zc
    assert_close(r.loss, ref["loss"], 1e-5)
    assert_close(zc, ref["grad"], 1e-5)
    # backward in place, with a strided buffer
    big = np.zeros((N, V + 3), np.float32)
    big[:, :V] = z
    lse = fusedce.forward(z, y, return_lse=True, label_smoothing=0.1).lse
    fusedce.backward(big[:, :V], y, lse, in_place=True, label_smoothing=0.1)
    assert_close(big[:, :V], ref["grad"], 1e-5)


def test_deterministic_bitwise():
    z, y = make_inputs(n=64, v=1000, std=10.0)
    a = fusedce.forward(z, y, return_grad=True, deterministic=True, label_smoothing=0.1)
    b = fusedce.forward(z, y, return_grad=True, deterministic=True, label_smoothing=0.1)
    assert a.loss.tobytes() == b.loss.tobytes()
    assert a.grad_logits.tobytes() == b.grad_logits.tobytes()


# ------------------------------------------------------------- 16-bit dtypes ----
def _half_rtol(dtype):
    return {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[dtype]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("std", [1.0, 30.0])
def test_float16(reduction, std):
    z32, y = make_inputs(std=std)
    z = z32.astype(np.float16)
    opts = dict(label_smoothing=0.1, class_weights=_weights(V), z_loss_scale=1e-4)
    ref = R.cross_entropy(z.astype(np.float64), y, reduction=reduction, **opts)
    r = fusedce.forward(z, y, reduction=reduction, return_grad=True, return_lse=True, **opts)
    assert r.grad_logits.dtype == np.float16
    assert_close(r.loss, ref["loss"], 1e-5, "loss")  # float32 loss, accumulated in double
    assert_close(r.lse, ref["lse"], 1e-5, "lse")
    assert_close(r.grad_logits, ref["grad"], _half_rtol("float16"), "grad")


@pytest.mark.parametrize("std", [1.0, 30.0])
def test_bfloat16_raw_bits(std):
    z32, y = make_inputs(std=std)
    bits = fusedce.float_to_bfloat16_bits(z32)
    assert bits.dtype == np.uint16
    zq = fusedce.bfloat16_bits_to_float(bits)
    assert np.max(np.abs(zq - z32) / np.maximum(np.abs(z32), 1e-30)) <= 2.0 ** -8
    ref = R.cross_entropy(zq, y, softcap=10.0)
    with pytest.raises(TypeError, match="dtype='bfloat16'"):
        fusedce.forward(bits, y)
    r = fusedce.forward(bits, y, dtype="bfloat16", return_grad=True, softcap=10.0)
    assert r.grad_logits.dtype == np.uint16
    assert_close(r.loss, ref["loss"], 1e-5, "loss")
    assert_close(fusedce.bfloat16_bits_to_float(r.grad_logits), ref["grad"],
                 _half_rtol("bfloat16"), "grad")


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
def test_bfloat16_ml_dtypes():
    z32, y = make_inputs(std=3.0)
    z = z32.astype(ml_dtypes.bfloat16)
    ref = R.cross_entropy(z.astype(np.float64), y, reduction="sum")
    r = fusedce.forward(z, y, reduction="sum", return_grad=True)
    assert r.grad_logits.dtype == z.dtype
    assert_close(r.loss, ref["loss"], 1e-5)
    assert_close(r.grad_logits.astype(np.float64), ref["grad"], _half_rtol("bfloat16"))
    # the same bits through the raw path
    r2 = fusedce.forward(z.view(np.uint16), y, dtype="bf16", reduction="sum")
    assert float(r2.loss) == float(r.loss)


# ------------------------------------------------------------------- linear_ce ----
LINEAR_OPTIONS = {
    "plain": {},
    "weights+smoothing": {"class_weights": _weights(LIN_V), "label_smoothing": 0.1},
    "z_loss+softcap+scale": {"z_loss_scale": 1e-3, "softcap": 5.0, "logit_scale": 2.0},
    "shift": {"shift_seq_len": 5},
    "shift=2+token_scaling+z_loss": {"shift_seq_len": 10, "shift": 2, "token_scaling": True,
                                     "z_loss_scale": 1e-3},
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(LINEAR_OPTIONS))
def test_linear_ce_float32(case, reduction, bias):
    opts = LINEAR_OPTIONS[case]
    h, W, b, y = make_linear(seed=len(case), std=4.0, bias=bias)
    g = (np.random.default_rng(2).uniform(-1, 1, LIN_N).astype(np.float32)
         if reduction == "none" else 1.5)
    ref = R.linear_cross_entropy(h, W, y, b, grad_output=g, reduction=reduction, **opts)
    gh, gw = poison((LIN_N, LIN_D)), poison((LIN_V, LIN_D))
    gb = poison((LIN_V,)) if bias else None
    r = fusedce.linear_ce(h, W, y, b, reduction=reduction, grad_hidden=gh, grad_weight=gw,
                          grad_bias=gb, grad_output=g, return_lse=True, return_z_loss=True,
                          return_argmax=True, return_accuracy=True, **opts)
    assert_close(r.loss, ref["loss"], 1e-5, "loss")
    np.testing.assert_array_equal(r.argmax, ref["argmax"])
    assert_close(r.accuracy, ref["accuracy"], 1e-6, "accuracy")
    assert_close(r.lse, ref["lse"], 1e-5, "lse")
    assert_close(r.z_loss, ref["z_loss"], 1e-5, "z_loss")
    assert_close(gh, ref["grad_hidden"], 1e-5, "grad_hidden")
    assert_close(gw, ref["grad_weight"], 1e-5, "grad_weight")
    if bias:
        assert_close(gb, ref["grad_bias"], 1e-5, "grad_bias")
    # evaluation: loss only, any workspace size at least the minimum gives the same loss
    lo = fusedce.linear_ce(h, W, y, b, reduction=reduction, workspace_size="min", **opts)
    hi = fusedce.linear_ce(h, W, y, b, reduction=reduction, workspace_size="optimal", **opts)
    assert lo.grad_hidden is None and lo.grad_weight is None
    assert_close(lo.loss, ref["loss"], 1e-5, "loss (min workspace)")
    assert_close(hi.loss, ref["loss"], 1e-5, "loss (optimal workspace)")


def test_linear_ce_gradient_subsets_and_accumulate():
    h, W, b, y = make_linear(seed=4)
    ref = R.linear_cross_entropy(h, W, y, b)
    r = fusedce.linear_ce(h, W, y, b, return_grad=("weight",))
    assert r.grad_hidden is None and r.grad_bias is None
    assert_close(r.grad_weight, ref["grad_weight"], 1e-5)
    gw = np.ones((LIN_V, LIN_D), np.float32)
    gb = np.full(LIN_V, 2.0, np.float32)
    fusedce.linear_ce(h, W, y, b, grad_weight=gw, grad_bias=gb, accumulate=True)
    assert_close(gw, 1.0 + ref["grad_weight"], 1e-5)
    assert_close(gb, 2.0 + ref["grad_bias"], 1e-5)
    r = fusedce.linear_ce(h, W, y, b, return_grad=True, accumulate=True)  # zeros allocated
    assert_close(r.grad_weight, ref["grad_weight"], 1e-5)
    with pytest.raises(ValueError, match="no bias"):
        fusedce.linear_ce(h, W, y, None, return_grad=("bias",))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_linear_ce_half(dtype):
    h32, W32, b32, y = make_linear(seed=6, std=2.0)
    if dtype == "float16":
        h, W, b = h32.astype(np.float16), W32.astype(np.float16), b32.astype(np.float16)
        hq, Wq, bq = h, W, b
        kw = {}
    else:
        h, W, b = (fusedce.float_to_bfloat16_bits(a) for a in (h32, W32, b32))
        hq, Wq, bq = (fusedce.bfloat16_bits_to_float(a) for a in (h, W, b))
        kw = {"dtype": "bfloat16"}
    ref = R.linear_cross_entropy(hq, Wq, y, bq, label_smoothing=0.1)
    r = fusedce.linear_ce(h, W, y, b, return_grad=True, grad_weight_fp32=True,
                          label_smoothing=0.1, **kw)
    assert r.grad_weight.dtype == np.float32 and r.grad_bias.dtype == np.float32
    assert r.grad_hidden.dtype == h.dtype
    to64 = (lambda a: a.astype(np.float64)) if dtype == "float16" else (
        lambda a: fusedce.bfloat16_bits_to_float(a).astype(np.float64))
    # logits are formed in float32 from 16-bit inputs: the loss is float32-accurate
    assert_close(r.loss, ref["loss"], 1e-4, "loss")
    assert_close(r.grad_weight, ref["grad_weight"], 1e-4, "grad_weight (float32)")
    assert_close(to64(r.grad_hidden), ref["grad_hidden"], _half_rtol(dtype) * 2, "grad_hidden")
    r2 = fusedce.linear_ce(h, W, y, b, return_grad=True, label_smoothing=0.1, **kw)
    assert r2.grad_weight.dtype == h.dtype
    assert_close(to64(r2.grad_weight), ref["grad_weight"], _half_rtol(dtype) * 2, "grad_weight")


def test_linear_ce_strided_hidden():
    h, W, b, y = make_linear(seed=8)
    big = np.zeros((LIN_N, LIN_D + 5), np.float32)
    big[:, :LIN_D] = h
    ref = R.linear_cross_entropy(h, W, y, b)
    r = fusedce.linear_ce(big[:, :LIN_D], W, y, b, return_grad=True,
                          hidden_row_stride=LIN_D + 5)
    assert_close(r.loss, ref["loss"], 1e-5)
    assert_close(r.grad_hidden, ref["grad_hidden"], 1e-5)
    with pytest.raises(ValueError, match="must be dense"):
        fusedce.linear_ce(h, np.zeros((LIN_V, LIN_D + 2), np.float32)[:, :LIN_D], y)


# ------------------------------------------------------------ workspace queries ----
def test_workspace_queries_and_user_workspace():
    assert isinstance(fusedce.forward_workspace_size(N, V), int)
    assert isinstance(fusedce.backward_workspace_size(N, V, reduction="none"), int)
    lo, hi = fusedce.linear_ce_workspace_size(LIN_N, LIN_D, LIN_V)
    assert 0 < lo <= hi
    h, W, b, y = make_linear(seed=9)
    ref = R.linear_cross_entropy(h, W, y, b)
    raw = np.empty(hi + 32, np.uint8)
    ws = raw[(-raw.ctypes.data) % 16:][:hi]
    r = fusedce.linear_ce(h, W, y, b, workspace=ws, return_grad=True)
    assert_close(r.grad_weight, ref["grad_weight"], 1e-5)
    # the workspace's size and alignment are the library's to check: its message names them
    with pytest.raises(fusedce.WorkspaceTooSmallError,
                       match=r"fce_linear_ce: workspace_bytes \(%d\) is less than" % (lo - 16)):
        fusedce.linear_ce(h, W, y, b, workspace=ws[: lo - 16])
    with pytest.raises(fusedce.MisalignedError,
                       match=r"fce_linear_ce: workspace \(.*\) is not aligned to 16 bytes"):
        fusedce.linear_ce(h, W, y, b, workspace=raw[((-raw.ctypes.data) % 16) + 1:][:lo])
    with pytest.raises(fusedce.WorkspaceTooSmallError, match="workspace_bytes"):
        fusedce.linear_ce(h, W, y, b, workspace_size=lo - 1, return_grad=True)  # < minimum


# ---------------------------------------------------------------- array kinds ----
class DLPackOnly:
    """An array known only through the DLPack protocol (as a JAX array would be)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, stream=None):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_inputs():
    z, y = make_inputs(std=4.0)
    big = np.zeros((N, V + 4), np.float32)
    big[:, :V] = z
    ref = R.cross_entropy(z, y, reduction="none")
    r = fusedce.forward(DLPackOnly(big[:, :V]), DLPackOnly(y), reduction="none",
                        return_grad=True)
    assert isinstance(r.loss, np.ndarray)
    assert_close(r.loss, ref["loss"], 1e-5)
    assert_close(r.grad_logits, ref["grad"], 1e-5)
    gl = np.zeros((N, V), np.float32)
    fusedce.forward(DLPackOnly(z), DLPackOnly(y), grad_logits=DLPackOnly(gl))
    assert_close(gl, R.cross_entropy(z, y)["grad"], 1e-5)


class FakeCudaArray:
    """__cuda_array_interface__ for a pointer no one may dereference: the binding must fail
    before (validation) or in the library (no CUDA backend in a CPU build)."""

    def __init__(self, shape, typestr, strides=None, ptr=0x7F0000000000):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, False), "strides": strides,
                                         "version": 3, "stream": 1}


def test_cuda_array_interface_validation():
    with pytest.raises(TypeError, match="float64 is not supported; supported: float32, float16, "
                                        "bfloat16"):
        fusedce.forward(FakeCudaArray((4, 10), "<f8"), FakeCudaArray((4,), "<i8"))
    with pytest.raises(TypeError, match="int32 or int64"):
        fusedce.forward(FakeCudaArray((4, 10), "<f4"), FakeCudaArray((4,), "<f4"))
    with pytest.raises(ValueError, match="same device"):
        fusedce.forward(FakeCudaArray((4, 10), "<f4"), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        fusedce.forward(FakeCudaArray((4, 10), "<f4", strides=(4, 16)), FakeCudaArray((4,), "<i8"))
    with pytest.raises(TypeError, match="dtype='bfloat16'"):
        fusedce.forward(FakeCudaArray((4, 10), "<V2"), FakeCudaArray((4,), "<i8"))
    with pytest.raises(TypeError, match="loss must be passed"):
        fusedce.forward(FakeCudaArray((4, 10), "<f4"), FakeCudaArray((4,), "<i8"))
    with pytest.raises(ValueError, match="backend='cpu'"):
        fusedce.forward(FakeCudaArray((4, 10), "<f4"), FakeCudaArray((4,), "<i8"), backend="cpu")


@pytest.mark.skipif(fusedce.cuda_available(), reason="this build has a usable CUDA backend")
def test_cuda_backend_unavailable_is_reported():
    with pytest.raises(fusedce.BackendUnavailableError) as e:
        fusedce.forward(FakeCudaArray((4, 10), "<f4"), FakeCudaArray((4,), "<i8"),
                        loss=FakeCudaArray((), "<f4"), workspace=FakeCudaArray((1024,), "|u1"))
    assert e.value.status == _lib.FCE_ERROR_BACKEND_UNAVAILABLE
    assert "FCE_BACKEND_CUDA" in str(e.value)
    with pytest.raises(fusedce.BackendUnavailableError):
        fusedce.forward_workspace_size(4, 10, backend="cuda")
