"""The NumPy binding's errors on the CPU backend: Python-side validation, the library's checks
reaching the user with the call and the argument named, status exceptions, and the raw calls.
Runs in CI (`make test`): no GPU, no torch.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_numpy_errors.py
"""

import ctypes

import numpy as np
import pytest

import fce_reference as R
import fusedce
from fusedce import _lib
from numpy_cases import LIN_D, LIN_N, LIN_V, N, V, assert_close, make_inputs, make_linear, poison


# ---------------------------------------------------------------------- errors ----
def test_python_validation_errors():
    z, y = make_inputs()
    with pytest.raises(TypeError, match="float64"):
        fusedce.forward(z.astype(np.float64), y)
    with pytest.raises(TypeError, match="int32 or int64"):
        fusedce.forward(z, y.astype(np.float32))
    with pytest.raises(ValueError, match="2-D"):
        fusedce.forward(z[0], y)
    with pytest.raises(ValueError, match="targets must have shape"):
        fusedce.forward(z, y[:-1])
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        fusedce.forward(np.asfortranarray(z), y)
    with pytest.raises(ValueError, match="contiguous"):
        fusedce.forward(z[::2], np.repeat(y, 2)[::4])
    with pytest.raises(ValueError, match="reduction"):
        fusedce.forward(z, y, reduction="avg")
    with pytest.raises(ValueError, match="shift_seq_len"):
        fusedce.forward(z, y, shift_seq_len=5)
    with pytest.raises(ValueError, match="shift_seq_len"):
        fusedce.forward(z, y, shift_seq_len=-1)
    with pytest.raises(TypeError, match="class_weights must be float32"):
        fusedce.forward(z, y, class_weights=np.ones(V))
    with pytest.raises(ValueError, match="class_weights must have shape"):
        fusedce.forward(z, y, class_weights=np.ones(V - 1, np.float32))
    with pytest.raises(TypeError, match="dtype float32 but dtype='float16'"):
        fusedce.forward(z, y, dtype="float16")
    with pytest.raises(TypeError, match="loss must be float32"):
        fusedce.forward(z, y, loss=np.zeros((), np.float64))
    with pytest.raises(ValueError, match="loss must have shape"):
        fusedce.forward(z, y, reduction="none", loss=np.zeros((), np.float32))
    with pytest.raises(TypeError, match="grad_logits has dtype float16"):
        fusedce.forward(z, y, grad_logits=np.zeros((N, V), np.float16))
    with pytest.raises(ValueError, match="grad_logits has 23 rows"):
        fusedce.forward(z, y, grad_logits=np.zeros((N - 1, V), np.float32))
    ro = np.zeros((), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fusedce.forward(z, y, loss=ro)
    with pytest.raises(ValueError, match="grad_output must have shape"):
        fusedce.forward(z, y, reduction="none", return_grad=True,
                        grad_output=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="either in_place"):
        fusedce.forward(z, y, in_place=True, grad_logits=np.zeros_like(z))
    with pytest.raises(TypeError, match="expected a NumPy array"):
        fusedce.forward(z.tolist(), y)
    with pytest.raises(ValueError, match="backend='cuda'"):
        fusedce.forward(z, y, backend="cuda")
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        fusedce.forward(z, y, ignore_index=1.5)
    h, W, b, yl = make_linear()
    with pytest.raises(ValueError, match="weight has 25 columns"):
        fusedce.linear_ce(h, np.zeros((LIN_V, LIN_D + 1), np.float32), yl)
    with pytest.raises(TypeError, match="weight has dtype float16"):
        fusedce.linear_ce(h, W.astype(np.float16), yl)
    with pytest.raises(ValueError, match="bias must have shape"):
        fusedce.linear_ce(h, W, yl, b[:-1])
    with pytest.raises(ValueError, match="return_grad"):
        fusedce.linear_ce(h, W, yl, b, return_grad=("logits",))


@pytest.mark.parametrize("kwargs, needle", [
    ({"label_smoothing": 1.0}, "label_smoothing"),
    ({"label_smoothing": -0.1}, "label_smoothing"),
    ({"softcap": -1.0}, "softcap"),
    ({"z_loss_scale": -1.0}, "z_loss_scale"),
    ({"z_loss_scale": float("inf")}, "z_loss_scale"),
    ({"logit_scale": float("nan")}, "logit_scale"),
])
def test_library_rejects_option_values(kwargs, needle):
    z, y = make_inputs()
    with pytest.raises(fusedce.InvalidArgumentError) as e:
        fusedce.forward(z, y, **kwargs)
    err = e.value
    assert isinstance(err, ValueError) and isinstance(err, fusedce.FusedCEError)
    assert err.status == _lib.FCE_ERROR_INVALID_ARGUMENT
    # the call the user made, never the workspace query it runs first
    assert needle in err.message and err.message.startswith("fce_forward: ")
    assert "workspace_size" not in err.message
    assert err.message in str(err)
    with pytest.raises(fusedce.InvalidArgumentError, match="^fce_linear_ce: .*" + needle):
        fusedce.linear_ce(*make_linear()[:2], make_linear()[3], **kwargs)


@pytest.mark.parametrize("case", ["shift<0", "shift_seq_len<0", "shift w/o T", "T∤rows",
                                  "misaligned logits", "row_stride<vocab", "misaligned targets",
                                  "class_weights misaligned", "reduction code"])
def test_library_checks_reach_the_user(case):
    """What the library checks is not checked again in Python: its message (naming the function
    and the argument) is the exception's text, with the status's class."""
    z, y = make_inputs()
    buf = np.zeros(z.size * 4 + 8, np.uint8)
    cases = {
        "shift<0": (dict(shift_seq_len=4, shift=-1), fusedce.InvalidArgumentError,
                    r"options->shift \(-1\) must be >= 0"),
        "shift_seq_len<0": (dict(shift_seq_len=-3), fusedce.InvalidArgumentError,
                            r"options->shift_seq_len \(-3\) must be >= 0"),
        "shift w/o T": (dict(shift=2), fusedce.InvalidArgumentError,
                        r"options->shift \(2\) needs options->shift_seq_len"),
        "T∤rows": (dict(shift_seq_len=5), fusedce.InvalidArgumentError,
                   r"rows \(%d\) is not a multiple of options->shift_seq_len \(5\)" % N),
        "reduction code": (dict(reduction=7), fusedce.InvalidArgumentError,
                           r"options->reduction \(7\) is not an fce_reduction"),
    }
    logits, targets, kw = z, y, {}
    if case in cases:
        kw, error, needle = cases[case]
    elif case == "misaligned logits":
        logits = np.frombuffer(buf, np.float32, count=z.size, offset=2).reshape(z.shape)
        error, needle = fusedce.MisalignedError, r"logits \(0x[0-9a-f]+\) is not aligned to 4"
    elif case == "misaligned targets":
        targets = np.frombuffer(buf, np.int64, count=N, offset=4)
        error, needle = fusedce.MisalignedError, r"targets \(0x[0-9a-f]+\) is not aligned to 8"
    elif case == "class_weights misaligned":
        kw = dict(class_weights=np.frombuffer(buf, np.float32, count=V, offset=1))
        error, needle = fusedce.MisalignedError, r"options->class_weights .* is not aligned to 4"
    else:  # rows 3 elements apart: overlapping rows of a [N, V] view
        logits = np.lib.stride_tricks.as_strided(z, shape=z.shape, strides=(12, 4))
        error = fusedce.InvalidArgumentError
        needle = r"options->row_stride \(3\) is less than vocab"
    with pytest.raises(error, match="^fce_forward: " + needle) as e:
        fusedce.forward(logits, targets, **kw)
    assert isinstance(e.value, ValueError) and e.value.message in str(e.value)
    # the library's own message (an option is checked by the workspace query fusedce.forward
    # makes first: its message, under the name of the call made)
    assert e.value.message == fusedce.last_error().replace("fce_forward_workspace_size: ",
                                                           "fce_forward: ")


def test_status_exceptions():
    """Every fce_status has its exception class; FCE_ERROR_OUT_OF_MEMORY (10, 0.4) is a
    MemoryError; a status the binding does not know is still a FusedCEError."""
    classes = {
        _lib.FCE_ERROR_INVALID_ARGUMENT: (fusedce.InvalidArgumentError, ValueError),
        _lib.FCE_ERROR_NULL_POINTER: (fusedce.NullPointerError, ValueError),
        _lib.FCE_ERROR_MISALIGNED: (fusedce.MisalignedError, ValueError),
        _lib.FCE_ERROR_UNSUPPORTED: (fusedce.UnsupportedError, fusedce.FusedCEError),
        _lib.FCE_ERROR_WORKSPACE_TOO_SMALL: (fusedce.WorkspaceTooSmallError, ValueError),
        _lib.FCE_ERROR_BACKEND_UNAVAILABLE: (fusedce.BackendUnavailableError,
                                             fusedce.FusedCEError),
        _lib.FCE_ERROR_CUDA: (fusedce.CudaError, fusedce.FusedCEError),
        _lib.FCE_ERROR_CUBLAS: (fusedce.CublasError, fusedce.FusedCEError),
        _lib.FCE_ERROR_INTERNAL: (fusedce.InternalError, fusedce.FusedCEError),
        _lib.FCE_ERROR_OUT_OF_MEMORY: (fusedce.OutOfMemoryError, MemoryError),
    }
    assert _lib.FCE_ERROR_OUT_OF_MEMORY == 10
    assert sorted(classes) == list(range(1, 11))
    for status, (cls, base) in classes.items():
        err = _lib.error_for_status(status, "fce_forward: something", "fce_forward")
        assert type(err) is cls and isinstance(err, base) and isinstance(err, RuntimeError)
        assert err.status == status and str(err).startswith("fce_forward: something")
    assert type(_lib.error_for_status(99, "x")) is fusedce.FusedCEError


def test_library_errors_through_raw_calls():
    """Statuses the high-level API never lets through, raised from the raw C calls."""
    z, y = make_inputs()
    loss = np.zeros(1, np.float32)
    o = _lib.default_options()
    o.backend = _lib.FCE_BACKEND_CPU

    def fwd(opts, logits_ptr, workspace=None, workspace_bytes=0):
        out = _lib.outputs(loss=loss.ctypes.data)
        _lib.call("fce_forward", ctypes.byref(opts), N, V, logits_ptr, y.ctypes.data,
                  ctypes.byref(out), None, workspace, workspace_bytes, None)

    fwd(o, z.ctypes.data)  # fine
    with pytest.raises(fusedce.NullPointerError) as e:
        fwd(o, None)
    assert e.value.status == _lib.FCE_ERROR_NULL_POINTER and "logits" in e.value.message
    assert fusedce.last_error() == e.value.message
    with pytest.raises(fusedce.MisalignedError, match="logits"):
        fwd(o, z.ctypes.data + 2)
    bad = _lib.default_options()
    bad.backend = _lib.FCE_BACKEND_CPU
    bad.row_stride = V - 1
    with pytest.raises(fusedce.InvalidArgumentError, match="row_stride"):
        fwd(bad, z.ctypes.data)
    bad = _lib.default_options()
    bad.backend = 7
    with pytest.raises(fusedce.InvalidArgumentError, match="backend"):
        fwd(bad, z.ctypes.data)
    bad = _lib.default_options()
    bad.backend = _lib.FCE_BACKEND_CPU
    bad.struct_size = 8
    with pytest.raises(fusedce.InvalidArgumentError, match="struct_size"):
        fwd(bad, z.ctypes.data)
    # workspace too small (fce_linear_ce needs one)
    h, W, b, yl = make_linear()
    lo, _ = fusedce.linear_ce_workspace_size(LIN_N, LIN_D, LIN_V, with_grad=False)
    ws = np.zeros(lo + 32, np.uint8)
    wp = ws.ctypes.data + (-ws.ctypes.data) % 16
    with pytest.raises(fusedce.WorkspaceTooSmallError, match="workspace") as e:
        out = _lib.outputs(loss=loss.ctypes.data)
        _lib.call("fce_linear_ce", ctypes.byref(o), LIN_N, LIN_D, LIN_V, h.ctypes.data,
                  W.ctypes.data, None, yl.ctypes.data, ctypes.byref(out), None, wp, lo - 1, None)
    assert e.value.status == _lib.FCE_ERROR_WORKSPACE_TOO_SMALL
    # an unknown future status still maps to FusedCEError
    err = _lib.error_for_status(99, "from the future")
    assert type(err) is fusedce.FusedCEError and err.status == 99


def test_scale_gradient_raw_call():
    """_lib.scale_gradient (fce_scale_gradient) on host arrays: the float32 product rounded once
    to the dtype, exactly 1 leaves every bit alone, bad arguments raise naming them."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(1003) * 3).astype(np.float32)
    g = np.array([2.5], np.float32)
    cpu, f32 = _lib.FCE_BACKEND_CPU, _lib.FCE_FLOAT32
    a = x.copy()
    _lib.scale_gradient(cpu, f32, a.size, a.ctypes.data, g.ctypes.data, None)
    np.testing.assert_array_equal(a, x * np.float32(2.5))
    h = x.astype(np.float16)
    want = (h.astype(np.float32) * 2.5).astype(np.float16)  # exact in float32, rounded once
    _lib.scale_gradient(cpu, _lib.FCE_FLOAT16, h.size, h.ctypes.data, g.ctypes.data, None)
    np.testing.assert_array_equal(h, want)
    one = np.array([1.0], np.float32)
    bits = x.view(np.uint32).copy()
    bits[5] = 0x7F800001  # a signalling NaN: a multiplication would quiet it
    before = bits.copy()
    _lib.scale_gradient(cpu, f32, bits.size, bits.ctypes.data, one.ctypes.data, None)
    np.testing.assert_array_equal(bits, before)
    _lib.scale_gradient(cpu, f32, 0, None, g.ctypes.data, None)  # count 0: no grad needed
    ap, gp = a.ctypes.data, g.ctypes.data
    for args, error, needle in [
        ((cpu, _lib.FCE_INT32, a.size, ap, gp), fusedce.InvalidArgumentError, "dtype"),
        ((7, f32, a.size, ap, gp), fusedce.InvalidArgumentError, "backend"),
        ((cpu, f32, -1, ap, gp), fusedce.InvalidArgumentError, "count"),
        ((cpu, f32, a.size, None, gp), fusedce.NullPointerError, "grad"),
        ((cpu, f32, a.size, ap, None), fusedce.NullPointerError, "grad_output"),
        ((cpu, f32, 8, ap + 2, gp), fusedce.MisalignedError, "grad"),
        ((cpu, f32, 8, ap, ap + 8), fusedce.InvalidArgumentError, "grad_output"),  # overlap
    ]:
        kept = a.copy()
        with pytest.raises(error) as e:
            _lib.scale_gradient(*args, None)
        message = e.value.message
        assert "fce_scale_gradient" in message and needle in message, message
        np.testing.assert_array_equal(a, kept)


def test_backward_rescale_raw_call():
    """_lib.backward_rescale (fce_backward_rescale) on host arrays: the gradient fce_forward wrote
    for an upstream 1, rescaled for g, is bit for bit fce_forward's given g (ignored rows: zero
    of either sign, as scaling in place makes -0 of their +0 for a negative g); exactly 1 leaves
    every bit alone; bad arguments raise naming fce_backward_rescale and the argument."""
    z, y = make_inputs(std=5.0, seed=12)  # rows 1, 6, 11, ... ignored
    ignored = y == -100
    opts = dict(label_smoothing=0.1, z_loss_scale=1e-3)
    o = _lib.default_options()
    o.backend = _lib.FCE_BACKEND_CPU
    o.label_smoothing, o.z_loss_scale = 0.1, 1e-3
    zp, yp = z.ctypes.data, y.ctypes.data
    for reduction, code in (("mean", _lib.FCE_REDUCTION_MEAN), ("sum", _lib.FCE_REDUCTION_SUM)):
        o.reduction = code
        lse = poison((N,))
        one = fusedce.forward(z, y, reduction=reduction, return_grad=True, lse=lse,
                              **opts).grad_logits
        # 1: untouched; 0.75, -1.7: computed again; 2, -0.25, 0: scaled in place
        for g in (1.0, 0.75, -1.7, 2.0, -0.25, 0.0):
            grad, go = one.copy(), np.array([g], np.float32)
            _lib.backward_rescale(o, N, V, zp, yp, lse.ctypes.data, go.ctypes.data,
                                  grad.ctypes.data)
            want = fusedce.forward(z, y, reduction=reduction, return_grad=True,
                                   grad_output=go[0], **opts).grad_logits
            # bit for bit, signed zeros included (docs/semantics.md rule 14; ignored rows stay +0)
            np.testing.assert_array_equal(grad.view(np.uint32), want.view(np.uint32),
                                          f"{reduction}, g={g}")
            assert np.all(grad[ignored] == 0) and np.all(want[ignored] == 0)
            if g == 1.0:
                np.testing.assert_array_equal(grad.view(np.uint32), one.view(np.uint32))
            if g == 0.75:
                ref = R.cross_entropy(z, y, reduction=reduction, grad_output=go[0], **opts)
                assert_close(grad, ref["grad"], 1e-5, "g = 0.75 vs the reference")
    o.reduction = _lib.FCE_REDUCTION_MEAN
    grad, go = one.copy(), np.array([0.5], np.float32)
    gp, op, lp = grad.ctypes.data, go.ctypes.data, lse.ctypes.data
    none = _lib.default_options()
    none.backend, none.reduction = _lib.FCE_BACKEND_CPU, _lib.FCE_REDUCTION_NONE
    for opts_, args, error, needle in [
        (none, (zp, yp, lp, op, gp), fusedce.InvalidArgumentError, "reduction"),
        (o, (zp, yp, lp, None, gp), fusedce.NullPointerError, "grad_output"),
        (o, (zp, yp, None, op, gp), fusedce.NullPointerError, "lse"),
        (o, (zp, yp, lp, op, None), fusedce.NullPointerError, "grad_logits"),
        (o, (zp, yp, lp, op, zp), fusedce.InvalidArgumentError, "grad_logits"),  # = logits
    ]:
        kept, z_kept = grad.copy(), z.copy()
        with pytest.raises(error) as e:
            _lib.backward_rescale(opts_, N, V, *args)
        message = e.value.message
        assert "fce_backward_rescale" in message and needle in message, message
        np.testing.assert_array_equal(grad, kept)
        np.testing.assert_array_equal(z, z_kept)


def test_errors_do_not_import_lib():
    """_lib.py imports _errors.py, never the other way round: a status reads as a number until
    the library is loaded, then in the library's words."""
    import ast
    import fusedce._errors as errors
    with open(errors.__file__) as f:
        tree = ast.parse(f.read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert "_lib" not in names
    _lib.load()
    assert errors.FusedCEError(_lib.FCE_ERROR_NULL_POINTER, "m").status_string.startswith(
        "FCE_ERROR_NULL_POINTER")
