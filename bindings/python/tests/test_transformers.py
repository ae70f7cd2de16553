"""fusedce.transformers on the CPU backend: tiny randomly initialised causal LMs of each supported
family (float32, small vocab), patched vs unpatched: loss and every parameter's gradient, HF's
label conventions (causal shift, ignore_index, num_items_in_batch, shift_labels,
logits_to_keep), evaluation untouched, revert.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_transformers.py

Skipped (with the reason) where torch or transformers is missing, or the installed transformers is
outside fusedce.transformers.SUPPORTED_TRANSFORMERS.
"""

import copy
import inspect
import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: fusedce.transformers needs it")
transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (optional)")

import fusedce.transformers as ft  # noqa: E402

try:
    ft.check_version()
    _VERSION_OK = None
except ft.UnsupportedTransformersVersion as e:
    _VERSION_OK = str(e)
pytestmark = pytest.mark.skipif(_VERSION_OK is not None, reason=_VERSION_OK or "")

V = 96     # vocab
B, T = 2, 9


def _config(family, **extra):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                  use_cache=False)
    if family == "llama":
        return transformers.LlamaConfig(**common, **extra)
    if family == "mistral":
        return transformers.MistralConfig(**common, **extra)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, **extra)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=8, **extra)
    # Gemma: a small cap, so that the softcap changes the loss noticeably
    extra.setdefault("final_logit_softcapping", 1.0)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=8, **extra)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**common, head_dim=8, **extra)
    raise ValueError(family)


_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
FAMILIES = list(_CLASSES)


def _pair(family="llama", seed=0, when="training", **extra):
    """(unpatched, patched) models with the same weights, in training mode."""
    torch.manual_seed(seed)
    cls = getattr(transformers, _CLASSES[family])
    ref = cls(_config(family, **extra))
    fused = copy.deepcopy(ref)
    ft.apply(fused, when=when)
    ref.train()
    fused.train()
    return ref, fused


def _batch(seed=1, ignore=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = x.clone()
    if ignore:
        y[0, :3] = -100   # a prompt
        y[1, 5] = -100
    return x, y


def _close(a, b, rtol=1e-5):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) <= rtol * max(float(b.abs().max()), 1e-3)


def _check_grads(ref, fused, rtol=1e-5):
    names = dict(fused.named_parameters())
    for name, p in ref.named_parameters():
        q = names[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert _close(q.grad, p.grad, rtol), (
                name, float((q.grad - p.grad).abs().max()), float(p.grad.abs().max()))


# ---------------------------------------------------------------- loss + gradients ----
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_every_gradient(family):
    ref, fused = _pair(family)
    x, y = _batch()
    a = ref(input_ids=x, labels=y)
    b = fused(input_ids=x, labels=y)
    assert b.logits is None and a.logits is not None
    assert b.loss.dtype == torch.float32
    assert _close(b.loss, a.loss), (float(b.loss), float(a.loss))
    a.loss.backward()
    b.loss.backward()
    _check_grads(ref, fused)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_softcap_is_applied(family):
    ref, fused = _pair(family)
    assert fused.config.final_logit_softcapping == 1.0
    x, y = _batch()
    capped = fused(input_ids=x, labels=y).loss
    fused.config.final_logit_softcapping = None
    ref.config.final_logit_softcapping = None
    uncapped = fused(input_ids=x, labels=y).loss
    assert _close(uncapped, ref(input_ids=x, labels=y).loss)
    assert abs(float(capped.detach()) - float(uncapped.detach())) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_num_items_in_batch(family):
    ref, fused = _pair(family)
    x, y = _batch()
    for n in (37, torch.tensor(37)):
        a = ref(input_ids=x, labels=y, num_items_in_batch=n)
        b = fused(input_ids=x, labels=y, num_items_in_batch=n)
        assert _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    _check_grads(ref, fused)


def test_gradient_accumulation_like_the_trainer():
    ref, fused = _pair("qwen2")
    batches = [_batch(seed=s) for s in (1, 2, 3)]
    # the Trainer's count: labels[..., 1:] that are not ignored, over the accumulated batches
    n = sum(int((y[:, 1:] != -100).sum()) for _, y in batches)
    for model in (ref, fused):
        for x, y in batches:
            model(input_ids=x, labels=y, num_items_in_batch=torch.tensor(n)).loss.backward()
    _check_grads(ref, fused)


def test_shift_labels_used_unshifted():
    ref, fused = _pair()
    x, y = _batch()
    shifted = torch.full_like(y, -100)
    shifted[:, :-1] = y[:, 1:]
    shifted[1, 2] = -100
    a = ref(input_ids=x, labels=y, shift_labels=shifted)
    b = fused(input_ids=x, labels=y, shift_labels=shifted)
    assert _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    _check_grads(ref, fused)


def test_ignore_index_keyword():
    ref, fused = _pair()
    x, y = _batch()
    y = torch.where(y == -100, torch.full_like(y, 7), y)
    a = ref(input_ids=x, labels=y, ignore_index=7)
    b = fused(input_ids=x, labels=y, ignore_index=7)
    assert _close(b.loss, a.loss)


def test_all_labels_ignored_is_zero():
    # transformers gives NaN (a mean over nothing); fusedce 0, with zero gradients (documented)
    _, fused = _pair()
    x, y = _batch()
    loss = fused(input_ids=x, labels=torch.full_like(y, -100)).loss
    assert float(loss.detach()) == 0.0
    loss.backward()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_logits_to_keep(family):
    ref, fused = _pair(family)
    x, y = _batch()
    k = 4
    a = ref(input_ids=x, labels=y[:, -k:], logits_to_keep=k)
    b = fused(input_ids=x, labels=y[:, -k:], logits_to_keep=k)
    assert b.logits is None and a.logits.shape == (B, k, V)
    assert _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    _check_grads(ref, fused)
    # positions as a 1-D tensor (packed sequences)
    pos = torch.tensor([0, 2, 3, 7])
    a = ref(input_ids=x, labels=y[:, pos], logits_to_keep=pos)
    b = fused(input_ids=x, labels=y[:, pos], logits_to_keep=pos)
    assert _close(b.loss, a.loss)


def test_labels_from_positional_arguments():
    ref, fused = _pair()
    x, y = _batch()
    # input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels
    b = fused(x, None, None, None, None, y)
    assert b.logits is None
    assert _close(b.loss, ref(x, None, None, None, None, y).loss)
    with pytest.raises(TypeError):
        fused(x, labels=y, input_ids=x)


def test_lm_head_bias():
    ref, fused = _pair()
    torch.manual_seed(3)
    head = torch.nn.Linear(32, V, bias=True)
    ref.lm_head = head
    fused.lm_head = copy.deepcopy(head)
    x, y = _batch()
    a = ref(input_ids=x, labels=y)
    b = fused(input_ids=x, labels=y)
    assert b.logits is None
    assert _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    _check_grads(ref, fused)
    assert fused.lm_head.bias.grad is not None


def test_return_dict_false_tuple():
    ref, fused = _pair()
    x, y = _batch()
    out = fused(input_ids=x, labels=y, return_dict=False)
    assert isinstance(out, tuple)
    assert _close(out[0], ref(input_ids=x, labels=y).loss)
    assert not any(torch.is_tensor(t) and t.dim() == 3 and t.shape[-1] == V for t in out)


def test_hidden_states_output():
    ref, fused = _pair()
    x, y = _batch()
    a = ref(input_ids=x, labels=y, output_hidden_states=True)
    b = fused(input_ids=x, labels=y, output_hidden_states=True)
    assert len(b.hidden_states) == len(a.hidden_states)
    for h, g in zip(b.hidden_states, a.hidden_states):
        assert torch.equal(h, g)


# ------------------------------------------------------ when the original forward runs ----
@pytest.mark.parametrize("family", FAMILIES)
def test_eval_without_labels_is_untouched(family):
    ref, fused = _pair(family)
    ref.eval()
    fused.eval()
    x, _ = _batch()
    with torch.no_grad():
        a = ref(input_ids=x)
        b = fused(input_ids=x)
        assert type(a) is type(b) and b.loss is None
        assert torch.equal(a.logits, b.logits)
        a = ref(input_ids=x, logits_to_keep=1)
        b = fused(input_ids=x, logits_to_keep=1)
        assert torch.equal(a.logits, b.logits)


def test_eval_with_labels_is_transformers_own():
    ref, fused = _pair()
    ref.eval()
    fused.eval()
    x, y = _batch()
    a = ref(input_ids=x, labels=y)
    b = fused(input_ids=x, labels=y)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)


def test_training_without_labels_is_untouched():
    ref, fused = _pair()
    x, _ = _batch()
    assert torch.equal(ref(input_ids=x).logits, fused(input_ids=x).logits)


def test_skip_logits_per_call():
    ref, fused = _pair()
    x, y = _batch()
    a = ref(input_ids=x, labels=y)
    b = fused(input_ids=x, labels=y, skip_logits=False)     # logits asked for, in training
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    fused.eval()
    b = fused(input_ids=x, labels=y, skip_logits=True)      # the fused path in eval mode
    assert b.logits is None and _close(b.loss, a.loss)
    with pytest.raises(ValueError, match="needs labels"):
        fused(input_ids=x, skip_logits=True)


def test_when_labels():
    ref, fused = _pair(when="labels")
    ref.eval()
    fused.eval()
    x, y = _batch()
    b = fused(input_ids=x, labels=y)
    assert b.logits is None
    assert _close(b.loss, ref(input_ids=x, labels=y).loss)
    with pytest.raises(ValueError, match="when must be"):
        ft.apply(fused, when="always")


def test_unfusable_head_falls_back_with_a_warning():
    ref, fused = _pair()
    fused.lm_head.register_forward_hook(lambda mod, inp, out: None)
    x, y = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = fused(input_ids=x, labels=y)
    assert any("lm_head has forward hooks" in str(w.message) for w in caught)
    a = ref(input_ids=x, labels=y)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    with pytest.raises(ValueError, match="cannot serve"):
        fused(input_ids=x, labels=y, skip_logits=True)


def test_custom_loss_function_falls_back():
    _, fused = _pair()
    fused.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum() * 0 + 42.0
    x, y = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fused(input_ids=x, labels=y)
    assert float(out.loss) == 42.0 and out.logits is not None


# ------------------------------------------------------------- apply / revert API ----
def test_revert_instance_restores_the_original():
    ref, fused = _pair()
    assert ft.is_applied(fused) and "forward" in vars(fused)
    ft.apply(fused)                        # again: options replaced, nothing stacked
    assert ft._patch_info(vars(fused)["forward"])["instance_previous"] is None
    ft.revert(fused)
    assert not ft.is_applied(fused) and "forward" not in vars(fused)
    x, y = _batch()
    a, b = ref(input_ids=x, labels=y), fused(input_ids=x, labels=y)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    ft.revert(fused)                       # nothing to undo: no error


def test_instance_level_forward_is_kept_and_restored():
    _, fused = _pair()
    ft.revert(fused)
    calls = []
    original = fused.forward

    def hooked(*args, **kwargs):           # as accelerate's hooks replace model.forward
        calls.append(1)
        return original(*args, **kwargs)
    fused.forward = hooked
    ft.apply(fused)
    x, y = _batch()
    fused(input_ids=x)                     # no labels: through the previous forward
    assert calls == [1]
    assert fused(input_ids=x, labels=y).logits is None
    ft.revert(fused)
    assert vars(fused)["forward"] is hooked


def test_class_patch_and_family_functions():
    cls = transformers.LlamaForCausalLM
    original = cls.__dict__["forward"]
    try:
        assert ft.apply_to_llama() is cls
        assert ft.is_applied(cls) and cls.forward is not original
        torch.manual_seed(0)
        model = cls(_config("llama"))
        assert ft.is_applied(model) and "forward" not in vars(model)
        model.train()
        x, y = _batch()
        out = model(input_ids=x, labels=y)
        assert out.logits is None
        ref = copy.deepcopy(model)
        ft.revert(cls)
        assert cls.__dict__["forward"] is original and not ft.is_applied(model)
        assert _close(out.loss, ref(input_ids=x, labels=y).loss)
        # an instance patch on top of a class patch, and per-family instance checks
        ft.apply(cls)
        ft.apply_to_llama(model, when="labels")
        with pytest.raises(TypeError, match="expects a Qwen2ForCausalLM"):
            ft.apply_to_qwen2(model)
    finally:
        ft.revert(cls)
    assert cls.__dict__["forward"] is original


def test_signature_seen_by_trainer_and_generate():
    _, fused = _pair()
    params = inspect.signature(fused.forward).parameters
    assert "labels" in params and "input_ids" in params
    assert any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_unsupported_models_and_versions():
    with pytest.raises(TypeError, match="not a supported causal LM"):
        ft.apply(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="not a supported causal-LM class"):
        ft.apply(transformers.LlamaModel)

    class MyLlama(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)
    with pytest.raises(ValueError, match="overrides LlamaForCausalLM.forward"):
        ft.apply(MyLlama(_config("llama")))

    for bad in ("4.40.2", "4.50.3", "6.0.0", "6.0.0.dev0", "3.5.1"):
        with pytest.raises(ft.UnsupportedTransformersVersion, match=r">=4\.51,<6"):
            ft.check_version(bad)
    for good in ("4.51.0", "4.57.6", "5.0.0rc1", "5.17.0", "5.23.0"):
        assert ft.check_version(good) == good


def test_unsupported_version_can_be_overridden(monkeypatch):
    monkeypatch.setenv("FUSEDCE_TRANSFORMERS_ANY_VERSION", "1")
    assert ft.check_version("7.0.0") == "7.0.0"


def test_subclass_without_forward_is_supported():
    class Plain(transformers.Qwen3ForCausalLM):
        pass
    torch.manual_seed(0)
    model = Plain(_config("qwen3"))
    ref = copy.deepcopy(model)
    ft.apply(model)
    model.train()
    ref.train()
    x, y = _batch()
    assert _close(model(input_ids=x, labels=y).loss, ref(input_ids=x, labels=y).loss)


# --------------------------------------------------------------- with the Trainer ----
def test_trainer_gradient_accumulation(tmp_path):
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(5)
            self.x = torch.randint(0, V, (8, T), generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            y = self.x[i].clone()
            y[: i % 3] = -100
            return {"input_ids": self.x[i], "labels": y}

    def train(model):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-3,
                                 report_to=[], use_cpu=True, save_strategy="no",
                                 logging_strategy="no", seed=0, data_seed=0,
                                 dataloader_num_workers=0)
        Trainer(model=model, args=args, train_dataset=Data()).train()
        return model

    ref, fused = _pair()
    train(ref)
    train(fused)
    assert ft.is_applied(fused)
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        assert _close(q, p, 1e-4), name


def test_torch_compile_fullgraph():
    # the patched forward and the fused loss trace without graph breaks
    ref, fused = _pair()
    x, y = _batch()
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    b = compiled(input_ids=x, labels=y)
    assert b.logits is None
    a = ref(input_ids=x, labels=y)
    assert _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    _check_grads(ref, fused)


@pytest.mark.parametrize("order", ["apply_then_peft", "peft_then_apply"])
def test_peft_lora(order):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(_config("llama"))
    fused = copy.deepcopy(ref)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**lora))
    if order == "apply_then_peft":
        ft.apply(fused)
        fused = peft.get_peft_model(fused, peft.LoraConfig(**lora))
    else:
        fused = peft.get_peft_model(fused, peft.LoraConfig(**lora))
        ft.apply(fused)
    fused.load_state_dict(ref.state_dict())
    assert ft.is_applied(fused)
    ref.train()
    fused.train()
    x, y = _batch()
    a = ref(input_ids=x, labels=y)
    b = fused(input_ids=x, labels=y)
    assert b.logits is None and _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    names = dict(fused.named_parameters())
    trained = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert trained and all("lora" in n for n in trained)
    for n in trained:
        assert _close(names[n].grad, dict(ref.named_parameters())[n].grad), n
    ft.revert(fused)
    assert not ft.is_applied(fused)


def test_generate_is_untouched():
    ref, fused = _pair("qwen3")
    ref.eval()
    fused.eval()
    x, _ = _batch()
    kw = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(ref.generate(x, **kw), fused.generate(x, **kw))


def test_gradient_checkpointing():
    ref, fused = _pair("gemma2")
    for m in (ref, fused):   # (5.x: activation_checkpointing_enable, the same)
        enable = getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)
        enable()
    x, y = _batch()
    a = ref(input_ids=x, labels=y)
    b = fused(input_ids=x, labels=y)
    assert b.logits is None and _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    _check_grads(ref, fused)
