"""Sharded training on CPU with gloo (2 and 4 processes), and on 2 GPUs with NCCL, each result
against the unsharded single-process call on the same device: DTensor weights (Replicate,
Shard(0) even and uneven, with the lse and entropy; the placements that raise), sequence
parallelism (a DTensor hidden Shard(0), and fusedce.torch.distributed.megatron_linear_cross_entropy with sequence_parallel on
and off), reductions mean/sum/none and ignore_index; a tiny randomly initialised Llama under
FSDP2 (fully_shard, lm_head in the root unit and as its own unit), with a tensor-parallel lm_head
(parallelize_module, ColwiseParallel) and with both on a 2×2 mesh (4 processes) through
fusedce.transformers.apply; DeepSpeed ZeRO-3 on gloo only.

    FUSEDCE_LIBRARY=build/libfusedce.so python -m pytest -q bindings/python/tests/test_sharded.py

test_nccl_sharded runs the same cases (not ZeRO-3) in 2 processes, rank r on cuda:r with NCCL
(NCCL_NVLS_ENABLE=0; float32 GEMMs without TF32 in torch's references), on a machine with at
least 2 GPUs and a library built with the CUDA backend:

    FUSEDCE_LIBRARY=<cuda build>/libfusedce.so PYTHONPATH=bindings/python python3 -m pytest -q bindings/python/tests/test_sharded.py

Tests skip with their reason where torch, gloo, NCCL, 2 GPUs, transformers or a 0.5 library is
missing. Each test asserts the number of comparisons every case made, so that none passes
without running.
"""

import datetime
import os
import sys

import pytest

from fusedce import _lib

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
except Exception:  # pragma: no cover - depends on the environment
    torch = None

try:
    import transformers  # noqa: F401
    HAS_HF = True
except Exception:  # pragma: no cover - depends on the environment
    HAS_HF = False


def _has_vp_linear_ce():
    try:
        return _lib.has_vp_linear_ce()
    except Exception:
        return False


needs_gloo = pytest.mark.skipif(
    torch is None or not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available")
needs_vp_linear_ce = pytest.mark.skipif(
    not _has_vp_linear_ce(), reason="the loaded libfusedce has no fce_vp_linear_ce (needs 0.5)")


def _tol(dtype):
    return 2e-5 if dtype == torch.float32 else 1.5e-2


_COMPARED = {}  # case name -> the number of _close calls it made (in this process)
_CASE = [None]


def _close(actual, expected, dtype, what):
    _COMPARED[_CASE[0]] = _COMPARED.get(_CASE[0], 0) + 1
    tol = _tol(dtype)
    actual, expected = actual.detach().float(), expected.detach().float()
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(scale, 1e-6),
                               msg=lambda m: f"{what}: {m}")


def _same_on_every_rank(t, group=None):
    t = t.detach().reshape(-1).contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    for p in parts:
        assert torch.equal(p, parts[0]), "the loss differs between ranks"


def _problem(n, d, vocab, dtype, seed, dev, ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen).to(dtype)
    w = (torch.randn(vocab, d, generator=gen) * 0.3).to(dtype)
    y = torch.randint(0, vocab, (n,), generator=gen)
    y[1] = y[n // 2] = ignore_index
    up = torch.randn(n, generator=gen)
    return h.to(dev), w.to(dev), y.to(dev), up.to(dev)


def _reference(h, w, y, reduction, up, ignore_index=-100, bias=None):
    from fusedce.torch import linear_cross_entropy
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    br = bias.clone().requires_grad_() if bias is not None else None
    loss = linear_cross_entropy(hr, wr, y, linear_bias=br, reduction=reduction,
                                ignore_index=ignore_index)
    (loss * up if reduction == "none" else loss * 0.7).sum().backward()
    f64 = F.cross_entropy(F.linear(h.double(), w.double(),
                                   bias.double() if bias is not None else None),
                          y, reduction=reduction, ignore_index=ignore_index)
    return loss, hr.grad, wr.grad, (br.grad if br is not None else None), f64


def _upstream(loss, reduction, up):
    return (loss * up if reduction == "none" else loss * 0.7).sum()


# ================================================================= DTensor weights ====
def _cases_dtensor(rank, world, dev):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from fusedce.torch import linear_cross_entropy
    mesh = init_device_mesh(dev.type, (world,))
    d = 16
    for vocab in (8 * world, 8 * world + 3):  # even, and DTensor's uneven split (⌈V/P⌉ rows)
        for reduction in ("mean", "sum", "none"):
            for dtype in (torch.float32, torch.bfloat16):
                h, w, y, up = _problem(12, d, vocab, dtype, seed=vocab, dev=dev)
                bias = (torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.2
                        ).to(dev, dtype) if reduction == "sum" else None
                ref, gh_ref, gw_ref, gb_ref, f64 = _reference(h, w, y, reduction, up, bias=bias)
                wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
                bd = (distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_()
                      if bias is not None else None)
                hh = h.clone().requires_grad_()
                loss = linear_cross_entropy(hh, wd, y, linear_bias=bd, reduction=reduction)
                assert not isinstance(loss, DTensor) and loss.dtype == torch.float32
                _same_on_every_rank(loss)
                _upstream(loss, reduction, up).backward()
                what = f"Shard(0) V={vocab} {reduction} {dtype} P={world}"
                _close(loss, ref, dtype, "loss " + what)
                if dtype == torch.float32:
                    _close(loss.double(), f64, dtype, "F " + what)
                _close(hh.grad, gh_ref, dtype, "grad_hidden " + what)
                assert isinstance(wd.grad, DTensor) and wd.grad.placements == (Shard(0),)
                assert wd.grad.to_local().shape == wd.to_local().shape
                _close(wd.grad.full_tensor(), gw_ref, dtype, "grad_weight " + what)
                if bias is not None:
                    assert isinstance(bd.grad, DTensor) and bd.grad.placements == (Shard(0),)
                    _close(bd.grad.full_tensor(), gb_ref, dtype, "grad_bias " + what)
    # Replicate: the local (whole) weight; each rank its own tokens; ∂W a Replicate DTensor
    h, _, y, up = _problem(10, d, 40, torch.float32, seed=100 + rank, dev=dev)
    w = _problem(10, d, 40, torch.float32, seed=100, dev=dev)[1]  # (distribute_tensor: rank 0's)
    ref, gh_ref, gw_ref, _, _ = _reference(h, w, y, "mean", up)
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    hh = h.clone().requires_grad_()
    loss = linear_cross_entropy(hh, wd, y)
    (loss * 0.7).backward()
    _close(loss, ref, torch.float32, "loss Replicate")
    _close(hh.grad, gh_ref, torch.float32, "grad_hidden Replicate")
    assert isinstance(wd.grad, DTensor) and wd.grad.placements == (Replicate(),)
    _close(wd.grad.to_local(), gw_ref, torch.float32, "grad_weight Replicate")
    # a DTensor hidden sharded over its rows (sequence parallelism) and a replicated one
    for placement in (Shard(0), Replicate()):
        for reduction in ("mean", "none"):
            h, w, y, up = _problem(6 * world, d, 8 * world + 1, torch.float32, seed=7, dev=dev)
            ref, gh_ref, gw_ref, _, _ = _reference(h, w, y, reduction, up)
            wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
            hd = distribute_tensor(h, mesh, [placement]).requires_grad_()
            loss = linear_cross_entropy(hd, wd, y, reduction=reduction)
            _same_on_every_rank(loss)
            _upstream(loss, reduction, up).backward()
            what = f"hidden {placement} {reduction} P={world}"
            _close(loss, ref, torch.float32, "loss " + what)
            assert isinstance(hd.grad, DTensor) and hd.grad.placements == (placement,)
            _close(hd.grad.full_tensor(), gh_ref, torch.float32, "grad_hidden " + what)
            _close(wd.grad.full_tensor(), gw_ref, torch.float32, "grad_weight " + what)
    # the lse and the entropy from the sharded weight, differentiable, against torch from the
    # whole logits (float32): H = lse − Σ p·a, ∂ through loss, lse and H together
    for reduction in ("mean", "none"):
        h, w, y, up = _problem(10, d, 8 * world + 3, torch.float32, seed=11, dev=dev)
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        z = F.linear(hr, wr)
        logp = torch.log_softmax(z, dim=-1)
        ref_loss = F.cross_entropy(z, y, reduction=reduction)
        ref_lse, ref_ent = torch.logsumexp(z, dim=-1), -(logp.exp() * logp).sum(-1)
        (_upstream(ref_loss, reduction, up) + (0.3 * ref_lse + 0.5 * ref_ent * up).sum()).backward()
        wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        hh = h.clone().requires_grad_()
        loss, lse, ent = linear_cross_entropy(hh, wd, y, reduction=reduction, return_lse=True,
                                              return_entropy=True)
        _same_on_every_rank(ent)
        (_upstream(loss, reduction, up) + (0.3 * lse + 0.5 * ent * up).sum()).backward()
        what = f"entropy Shard(0) {reduction} P={world}"
        _close(loss, ref_loss, torch.float32, "loss " + what)
        _close(lse, ref_lse, torch.float32, "lse " + what)
        _close(ent, ref_ent, torch.float32, what)
        _close(hh.grad, hr.grad, torch.float32, "grad_hidden " + what)
        _close(wd.grad.full_tensor(), wr.grad, torch.float32, "grad_weight " + what)
    # placements that raise (every rank alike): Shard(1), an empty shard
    h, w, y, _ = _problem(4, d, 8 * world, torch.float32, seed=9, dev=dev)
    with pytest.raises(ValueError, match="Shard\\(dim=1\\)"):
        linear_cross_entropy(h, distribute_tensor(w, mesh, [Shard(1)]), y)
    vocab = world + 1 if world > 2 else 1  # ⌈V/P⌉ rows per rank leave the last one none
    _, w, y, _ = _problem(4, d, vocab, torch.float32, seed=9, dev=dev)
    with pytest.raises(ValueError, match="no class"):
        linear_cross_entropy(h, distribute_tensor(w, mesh, [Shard(0)]), y % vocab)


# ======================================================= Megatron's fused linear CE ====
def _cases_megatron(rank, world, dev):
    from fusedce.torch.distributed import megatron_linear_cross_entropy as mlce
    group = dist.group.WORLD
    s, b, d = 4 * world, 3, 16
    vocab = 6 * world
    local = vocab // world
    for sp in (False, True):
        for reduction in ("mean", "sum", "none"):
            for ignore_index in (-100, 5):
                for dtype in (torch.float32, torch.bfloat16):
                    h, w, y, up = _problem(s * b, d, vocab, dtype, seed=31, dev=dev,
                                           ignore_index=ignore_index)
                    ref, gh_ref, gw_ref, _, f64 = _reference(h, w, y, reduction, up, ignore_index)
                    h3 = h.reshape(s, b, d)  # Megatron's [s, b, h]; labels [s, b]
                    if sp:
                        rows = s // world
                        hh = h3[rank * rows:(rank + 1) * rows].clone().requires_grad_()
                    else:
                        hh = h3.clone().requires_grad_()
                    ws = w[rank * local:(rank + 1) * local].clone().requires_grad_()
                    loss = mlce(hh, ws, y.reshape(s, b), group, reduction, ignore_index, sp)
                    assert loss.shape == ((s * b,) if reduction == "none" else ())
                    _same_on_every_rank(loss)
                    _upstream(loss, reduction, up).backward()
                    what = f"megatron sp={sp} {reduction} ignore={ignore_index} {dtype} P={world}"
                    _close(loss, ref, dtype, "loss " + what)
                    if dtype == torch.float32:
                        _close(loss.double(), f64, dtype, "F " + what)
                    gh = gh_ref.reshape(s, b, d)
                    if sp:
                        gh = gh[rank * rows:(rank + 1) * rows]
                    assert hh.grad.shape == hh.shape and hh.grad.dtype == dtype
                    _close(hh.grad, gh, dtype, "grad_hidden " + what)
                    _close(ws.grad, gw_ref[rank * local:(rank + 1) * local], dtype,
                           "grad_weight " + what)
    # tp_group None: the plain call on this rank's own tokens
    h, w, y, up = _problem(10, d, 30, torch.float32, seed=50 + rank, dev=dev)
    ref, gh_ref, gw_ref, _, _ = _reference(h, w, y, "sum", up)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = mlce(hh, ww, y, None, "sum")
    (loss * 0.7).backward()
    _close(loss, ref, torch.float32, "megatron tp_group=None")
    _close(hh.grad, gh_ref, torch.float32, "megatron tp_group=None grad_hidden")
    _close(ww.grad, gw_ref, torch.float32, "megatron tp_group=None grad_weight")
    # evaluation (no gradient) with sequence parallelism: the gather alone
    with torch.no_grad():
        h, w, y, _ = _problem(2 * world, d, vocab, torch.float32, seed=60, dev=dev)
        ref = mlce(h, w, y, None, "none")
        loss = mlce(h[2 * rank:2 * rank + 2], w[rank * local:(rank + 1) * local], y, group,
                    "none", -100, True)
    _close(loss, ref, torch.float32, "megatron sp no_grad")
    with pytest.raises(ValueError, match="elements"):
        mlce(h[:1], w[rank * local:(rank + 1) * local], y, group, "mean", -100, True)


# ============================================================ Hugging Face models ====
def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    model.config.use_cache = False
    return model


def _batches(world, steps, seed=0, b=2, t=10, vocab=96):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(world):
            ids = torch.randint(0, vocab, (b, t), generator=gen)
            labels = ids.clone()
            labels[0, :3] = -100
            step.append((ids, labels))
        out.append(step)
    return out


def _reference_steps(world, batches, averaged, dev):
    """Each step's per-rank losses and the parameters' gradients of the unsharded model with
    transformers' own loss (averaged over the ranks' batches, as FSDP reduce-scatters them)."""
    model = _tiny_llama().to(dev)
    model.train()
    result = []
    for step in batches:
        model.zero_grad(set_to_none=True)
        losses = []
        for ids, labels in (step if averaged else step[:1]):
            loss = model(input_ids=ids.to(dev), labels=labels.to(dev)).loss
            (loss / (world if averaged else 1)).backward()
            losses.append(loss.detach())
        result.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
    return result


def _full(g):
    from torch.distributed.tensor import DTensor
    return g.full_tensor() if isinstance(g, DTensor) else g


def _cases_fsdp(rank, world, dev):
    import fusedce.transformers as fh
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    mesh = init_device_mesh(dev.type, (world,))
    batches = _batches(world, steps=2)
    ref = _reference_steps(world, batches, averaged=True, dev=dev)
    for own_unit in (True, False):
        model = _tiny_llama().to(dev)
        fh.apply(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if own_unit:
            fully_shard(model.lm_head, mesh=mesh)  # its weight gathered by its own hooks
        fully_shard(model, mesh=mesh)
        assert isinstance(model, FSDPModule) and fh.is_applied(model)
        assert isinstance(model.lm_head, FSDPModule) == own_unit
        # its own unit: the loss inside lm_head's call, FSDP2's hooks around it
        assert fh._head_access(model.lm_head) == ("module" if own_unit else "direct")
        model.train()
        for (ids, labels), (losses, grads) in zip((s[rank] for s in batches), ref):
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids.to(dev), labels=labels.to(dev))
            assert out.logits is None, "the fused path"
            out.loss.backward()
            what = f"FSDP2 lm_head own unit={own_unit} P={world}"
            _close(out.loss, losses[rank], torch.float32, "loss " + what)
            for name, p in model.named_parameters():
                assert p.grad is not None, f"{name}: no gradient ({what})"
                _close(_full(p.grad), grads[name], torch.float32, f"grad {name} {what}")
        # evaluation (no labels): the original forward, the logits through FSDP's hooks
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=batches[0][rank][0].to(dev)).logits
        assert logits.shape == (2, 10, 96)


def _cases_tp(rank, world, dev):
    import fusedce.transformers as fh
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh(dev.type, (world,))
    batches = _batches(world, steps=1, seed=3)
    ref = _reference_steps(world, batches, averaged=False, dev=dev)  # every rank the same tokens
    model = _tiny_llama().to(dev)
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})
    assert isinstance(model.lm_head.weight, DTensor)
    fh.apply(model)
    model.train()
    ids, labels = batches[0][0]
    out = model(input_ids=ids.to(dev), labels=labels.to(dev))
    assert out.logits is None, "the fused path"
    _same_on_every_rank(out.loss)
    out.loss.backward()
    losses, grads = ref[0]
    what = f"TP lm_head P={world}"
    _close(out.loss, losses[0], torch.float32, "loss " + what)
    assert model.lm_head.weight.grad.placements == (Shard(0),)
    for name, p in model.named_parameters():
        _close(_full(p.grad), grads[name], torch.float32, f"grad {name} {what}")


def _cases_fsdp_tp(rank, world, dev):
    """FSDP2 over a tensor-parallel lm_head on a 2-D mesh (data-parallel × tensor-parallel, 2×2):
    the loss inside lm_head's call, FSDP2 gathering the weight over the data-parallel ranks into
    its tensor-parallel shard, the vocabulary-parallel path over the tensor-parallel ones."""
    import fusedce.transformers as fh
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh(dev.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    batches = _batches(world // 2, steps=2, seed=5)  # one batch per data-parallel rank
    ref = _reference_steps(world // 2, batches, averaged=True, dev=dev)
    model = _tiny_llama().to(dev)
    fh.apply(model)
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model.lm_head, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    assert fh._head_access(model.lm_head) == "module"
    model.train()
    for (ids, labels), (losses, grads) in zip((s[dp] for s in batches), ref):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids.to(dev), labels=labels.to(dev))
        assert out.logits is None, "the fused path"
        _same_on_every_rank(out.loss, mesh.get_group("tp"))
        out.loss.backward()
        what = f"FSDP2 x TP lm_head {world // 2}x2"
        _close(out.loss, losses[dp], torch.float32, "loss " + what)
        assert isinstance(model.lm_head.weight.grad, DTensor)
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{name}: no gradient ({what})"
            _close(_full(p.grad), grads[name], torch.float32, f"grad {name} {what}")


def _zero3_losses(rank, patched, steps=3):
    """Each step's loss of this rank under DeepSpeed ZeRO-3 (SGD, so that the later losses
    depend on the gradients of the earlier steps)."""
    import deepspeed
    import fusedce.transformers as fh
    model = _tiny_llama()
    if patched:
        fh.apply(model)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    head = model.lm_head
    assert head.weight.numel() == 0 and hasattr(head.weight, "ds_id"), "partitioned"
    if patched:
        assert fh._head_access(head) == "module"
    losses = []
    for (ids, labels) in (s[rank] for s in _batches(2, steps, seed=5)):
        out = engine(input_ids=ids, labels=labels)
        assert (out.logits is None) == patched
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.detach())
    return torch.stack(losses)


def _cases_zero3(rank, world, dev):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    plain = _zero3_losses(rank, patched=False)
    fused = _zero3_losses(rank, patched=True)
    _close(fused, plain, torch.float32, f"ZeRO-3 losses P={world}")


CASES = {"dtensor": _cases_dtensor, "megatron": _cases_megatron, "fsdp": _cases_fsdp,
         "tp": _cases_tp, "fsdp_tp": _cases_fsdp_tp, "zero3": _cases_zero3}


# _close calls per case (the same for every world size and device): a case that ran fewer did
# not run all of its comparisons
EXPECTED = {"dtensor": 71, "megatron": 88, "fsdp": 88, "tp": 22, "fsdp_tp": 44, "zero3": 1}


def _worker(rank, world, init_file, cases, backend, out_dir):
    import json
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        # torch's float32 GEMMs (the references, transformers' loss, the model) in full float32,
        # as fusedce's own (never TF32): the float32 bound stays 2e-5
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        dev = torch.device("cpu")
    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        for name in cases:
            _CASE[0] = name
            CASES[name](rank, world, dev)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"compared-{rank}.json"), "w") as f:
        json.dump({"device": str(dev), "compared": _COMPARED}, f)


def _spawn(world, cases, tmp_path, monkeypatch, backend="gloo"):
    """Runs `cases` in `world` processes; asserts that every rank made each case's comparisons."""
    import json
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    if backend == "nccl":
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    init_file = str(tmp_path / f"store-{backend}-{world}-{'-'.join(cases)}")
    out_dir = tmp_path / f"out-{backend}-{world}"
    out_dir.mkdir()
    if os.path.dirname(__file__) not in sys.path:  # the workers import this module
        sys.path.insert(0, os.path.dirname(__file__))
    import torch.multiprocessing as mp
    mp.start_processes(_worker, args=(world, init_file, tuple(cases), backend, str(out_dir)),
                       nprocs=world, join=True, start_method="spawn")
    for rank in range(world):
        path = out_dir / f"compared-{rank}.json"
        assert path.exists(), f"rank {rank} wrote no counts"
        got = json.loads(path.read_text())
        want_dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
        assert got["device"] == want_dev, got
        assert got["compared"] == {c: EXPECTED[c] for c in cases}, f"rank {rank}: {got}"


@needs_vp_linear_ce
@needs_gloo
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_sharded(world, tmp_path, monkeypatch):
    """`world` processes on gloo: DTensor weights and hidden states, Megatron's fused linear CE
    with and without sequence parallelism, and (with transformers) a tiny Llama under FSDP2 and
    with a tensor-parallel lm_head, against the unsharded call. One spawn per size (a process
    importing torch costs seconds): a failure names its case."""
    cases = ("dtensor", "megatron") + (("fsdp", "tp") if HAS_HF else ())
    cases += ("fsdp_tp",) if HAS_HF and world == 4 else ()  # a 2×2 mesh
    _spawn(world, cases, tmp_path, monkeypatch)


def _nccl_skip_reason():
    if torch is None or not dist.is_available():
        return "torch.distributed is not available"
    if not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend"
    count = torch.cuda.device_count()
    if count < 2:
        return f"needs 2 CUDA GPUs, {count} visible"
    try:
        if not _lib.cuda_available():
            return ("the loaded libfusedce has no usable CUDA backend "
                    "(FUSEDCE_LIBRARY=<cuda build>/libfusedce.so)")
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"libfusedce did not load: {e}"
    return None


_NCCL_SKIP = _nccl_skip_reason()


@needs_vp_linear_ce
@pytest.mark.skipif(_NCCL_SKIP is not None, reason=str(_NCCL_SKIP))
def test_nccl_sharded(tmp_path, monkeypatch):
    """The cases of test_gloo_sharded on 2 GPUs with NCCL, rank r on cuda:r (NCCL_NVLS_ENABLE=0),
    each against the unsharded call on the same GPU, with the same bounds (float32: 2e-5, torch's
    float32 GEMMs without TF32; bf16: 1.5e-2)."""
    cases = ("dtensor", "megatron") + (("fsdp", "tp") if HAS_HF else ())
    _spawn(2, cases, tmp_path, monkeypatch, backend="nccl")


def _has_deepspeed():
    try:
        import importlib.util
        return importlib.util.find_spec("deepspeed") is not None
    except Exception:  # pragma: no cover
        return False


@needs_vp_linear_ce
@needs_gloo
@pytest.mark.skipif(not (HAS_HF and _has_deepspeed()),
                    reason="DeepSpeed or transformers is not installed")
def test_gloo_zero3(tmp_path, monkeypatch):
    """A tiny Llama under DeepSpeed ZeRO-3 on 2 CPU processes (DS_ACCELERATOR=cpu, gloo):
    lm_head's partitioned weight gathered by ZeRO-3's own module hooks around the fused loss;
    three SGD steps' losses equal to the unpatched model's under ZeRO-3."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    _spawn(2, ("zero3",), tmp_path, monkeypatch)
