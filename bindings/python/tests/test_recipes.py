"""The RL recipes of examples/python/recipes (docs/recipes.md) on the CPU backend (and on CUDA
where torch sees a GPU), a few steps on a small randomly initialised Llama: their first-step
parity checks against plain torch (per-token log-probs, entropy, the loss and every parameter's
gradient) must hold, and the losses be finite.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_recipes.py

Skipped (with the reason) where torch or transformers is missing.
"""

import math
import os
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed: the recipes need it")
pytest.importorskip("transformers",
                    reason="Hugging Face transformers is not installed: the recipes need it")

RECIPES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                        "..", "examples", "python", "recipes"))
if not os.path.isdir(RECIPES):  # a copy of the tests outside the repository
    pytest.skip(f"the recipes are not at {RECIPES}", allow_module_level=True)
if RECIPES not in sys.path:
    sys.path.insert(0, RECIPES)

import dpo  # noqa: E402
import grpo  # noqa: E402
import torch  # noqa: E402

# each recipe on the CPU backend, and on CUDA where torch sees a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device for torch"))]

# small enough for a few seconds on the CPU, large enough for several chunks of the vocabulary
SMALL = ["--vocab", "3000", "--hidden", "64", "--prompt-len", "6",
         "--response-len", "10", "--steps", "3"]
TOL = 1e-4  # float32: the two ways differ by rounding only


def _check_parity(result, names):
    for name in names:
        assert result[name] < TOL, (name, result[name])
    assert result["grad_rel_err"] < TOL, result["grad_rel_err"]
    assert all(math.isfinite(x) for x in result["loss"]), result["loss"]


@pytest.mark.parametrize("device", DEVICES)
def test_grpo_parity(device):
    result = grpo.main(SMALL + ["--device", device, "--prompts", "2", "--group", "3"])
    _check_parity(result, ["logp_max_diff", "entropy_max_diff", "kl_max_diff", "loss_diff"])
    assert all(e > 0 for e in result["entropy"])
    assert result["kl"][0] == 0 and result["kl"][-1] > 0  # the policy moved off the reference


@pytest.mark.parametrize("device", DEVICES)
def test_grpo_without_reference(device):
    result = grpo.main(SMALL + ["--device", device, "--kl-coef", "0", "--steps", "1"])
    _check_parity(result, ["logp_max_diff", "entropy_max_diff", "loss_diff"])


@pytest.mark.parametrize("device", DEVICES)
def test_dpo_parity(device):
    result = dpo.main(SMALL + ["--device", device, "--pairs", "3", "--lr", "1e-4"])
    _check_parity(result, ["seq_logp_max_diff", "margin_max_diff", "loss_diff"])
    assert abs(result["loss"][0] - math.log(2)) < 1e-4  # the policy starts as the reference
    assert result["loss"][-1] < result["loss"][0]
