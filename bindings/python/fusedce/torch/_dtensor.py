"""DTensor arguments of :func:`fusedce.torch.linear_cross_entropy` (``torch.distributed.tensor``:
weights from ``parallelize_module``, or any DTensor a caller holds).

* a weight replicated on every mesh dimension: its local tensor (the whole weight), the plain
  call; its gradient is a DTensor with the same placements (``to_local``'s backward);
* a weight sharded over the vocabulary (``Shard(0)``) on ONE mesh dimension, replicated on the
  others (``ColwiseParallel``'s output layer): the vocabulary-parallel call over that dimension's
  process group, ``vocab_start`` the shard's offset (DTensor's split: ⌈V/P⌉ rows per rank, the
  last ones shorter; an empty shard raises on every rank alike), ``vocab_total`` the global
  size; ∂weight comes back as a DTensor ``Shard(0)``, ∂hidden is all-reduced over the group;
* hidden: a plain tensor (the same on every rank of the group, as tensor parallelism has it) or
  a DTensor on the weight's mesh, replicated, or sharded over its rows (``Shard(0)``, equal
  shares) on the vocabulary's mesh dimension: sequence parallelism (all-gather, then
  reduce-scatter of ∂hidden); another placement on that dimension is redistributed to
  ``Replicate`` by DTensor (its autograd gives the gradient back in that placement);
* anything else (``Shard(1)``: a weight sharded over the hidden dimension; ``Partial``; a weight
  sharded on two mesh dimensions, e.g. FSDP2 + TP outside the module's forward) raises
  ValueError naming the placement.

A DTensor weight sharded by FSDP2 (``fully_shard``) looks like a tensor-parallel ``Shard(0)``
weight, but each rank has its own tokens: it must be used inside the module's forward, where
FSDP2 has gathered it (:func:`fusedce.torch.module_linear_cross_entropy` does that; so does
``fusedce.transformers.apply``).

torch.distributed.tensor is never imported here: a DTensor exists only once it is loaded.
"""

from __future__ import annotations

import sys


def dtensor_type():
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def any_dtensor(*tensors) -> bool:
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def _is(t) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def _kind(p) -> str:
    """'replicate', 'shard0' (a plain Shard(0)), or the placement's repr (unsupported)."""
    if p.is_replicate():
        return "replicate"
    if p.is_shard() and type(p).__name__ == "Shard" and p.dim == 0:
        return "shard0"
    return repr(p)


def _vocab_split(vocab: int, size: int, coord: int):
    """DTensor's Shard(0) split (torch.chunk's): ⌈V/P⌉ rows per rank, the last ones shorter."""
    chunk = -(-vocab // size)
    start = min(coord * chunk, vocab)
    return start, max(0, min(vocab, start + chunk) - start), chunk


def _replicated_local(t, what: str):
    if not _is(t):
        return t
    bad = [p for p in t.placements if not p.is_replicate()]
    if bad:
        raise ValueError(f"fusedce.torch.linear_cross_entropy: {what} is a DTensor with "
                         f"placements {tuple(t.placements)}; with a replicated weight it must be "
                         "replicated too (or a plain tensor)")
    return t.to_local()


def _global(t):
    """Targets or class weights given as a DTensor: the whole tensor (no gradient)."""
    return t.full_tensor() if _is(t) else t


def linear_cross_entropy(input, linear_weight, target, linear_bias, weight, kwargs: dict):
    """fusedce.torch.linear_cross_entropy with a DTensor among input, linear_weight and
    linear_bias (``kwargs``: its other keywords)."""
    from . import linear_cross_entropy as plain
    from .distributed import vocab_parallel_linear_cross_entropy
    target, weight = _global(target), _global(weight)
    if not _is(linear_weight):
        raise ValueError("fusedce.torch.linear_cross_entropy: input or linear_bias is a DTensor "
                         "but linear_weight is not: pass plain tensors, or the weight as a "
                         "DTensor too")
    mesh, placements = linear_weight.device_mesh, tuple(linear_weight.placements)
    kinds = [_kind(p) for p in placements]
    if linear_bias is not None and _is(linear_bias):
        if tuple(linear_bias.placements) != placements:
            raise ValueError(f"linear_bias has placements {tuple(linear_bias.placements)}, "
                             f"linear_weight {placements}: they must match")
        linear_bias = linear_bias.to_local()
    if all(k == "replicate" for k in kinds):
        return plain(_replicated_local(input, "input"), linear_weight.to_local(), target,
                     linear_bias=linear_bias, weight=weight, **kwargs)
    bad = [(i, placements[i]) for i, k in enumerate(kinds) if k not in ("replicate", "shard0")]
    shard_dims = [i for i, k in enumerate(kinds) if k == "shard0"]
    if bad or len(shard_dims) != 1:
        what = (f"placement {bad[0][1]} on mesh dimension {bad[0][0]}" if bad else
                f"Shard(0) on {len(shard_dims)} mesh dimensions")
        raise ValueError(
            f"fusedce.torch.linear_cross_entropy: linear_weight is a DTensor with placements "
            f"{placements} ({what}). Supported: Replicate, or Shard(0) (sharded over the "
            "vocabulary: the vocabulary-parallel path) on one mesh dimension and Replicate on "
            "the others. Redistribute it (DTensor.redistribute) or, for a weight sharded by "
            "FSDP2, compute the loss inside the module's forward "
            "(fusedce.torch.module_linear_cross_entropy)")
    k = shard_dims[0]
    group, size = mesh.get_group(k), mesh.size(k)
    vocab, coord = linear_weight.shape[0], mesh.get_local_rank(k)
    start, local_rows, chunk = _vocab_split(vocab, size, coord)
    if chunk * (size - 1) >= vocab:  # the last rank's shard is empty: every rank raises
        raise ValueError(
            f"fusedce.torch.linear_cross_entropy: a vocabulary of {vocab} as Shard(0) over "
            f"{size} ranks leaves the last rank(s) no class (DTensor gives {chunk} per rank); "
            "the vocabulary-parallel path needs every shard non-empty")
    w_local = linear_weight.to_local()
    if w_local.shape[0] != local_rows:
        raise ValueError(f"linear_weight's local shard has {w_local.shape[0]} rows where "
                         f"DTensor's Shard(0) split gives {local_rows}")
    sequence_parallel = False
    if _is(input):
        if input.device_mesh != mesh:
            raise ValueError("input is a DTensor on another mesh than linear_weight")
        ip = tuple(input.placements)
        for i, p in enumerate(ip):
            if i != k and not p.is_replicate():
                raise ValueError(
                    f"input is a DTensor with placements {ip}: on the mesh dimensions other than "
                    f"the vocabulary's ({k}) it must be replicated, as the weight is")
        p = ip[k]
        if _kind(p) == "shard0" and input.shape[0] % size == 0 and input.dim() >= 2:
            sequence_parallel = True  # this rank's rows: gathered, ∂hidden reduce-scattered
        elif not p.is_replicate():
            from torch.distributed.tensor import Replicate
            input = input.redistribute(mesh, [Replicate()] * mesh.ndim)
        input = input.to_local()
    return vocab_parallel_linear_cross_entropy(
        input, w_local, target, group=group, bias=linear_bias, vocab_start=start,
        vocab_total=vocab, weight=weight, sequence_parallel=sequence_parallel, **kwargs)


def is_tp_hook(hook) -> bool:
    """An input or output hook of torch.distributed.tensor's distribute_module
    (parallelize_module): it only redistributes the layer's input and output."""
    return getattr(hook, "__qualname__", "").startswith("distribute_module.")


def module_forward(module, fn, *args):
    """``module(*args)`` with ``module.forward`` replaced by ``fn`` for this one call: the
    module's forward hooks run around ``fn`` (FSDP2's unshard before it and its reshard and
    backward hooks after it, DeepSpeed ZeRO-3's parameter fetch and release), and ``fn`` reads
    the module's parameters as its own forward would. A tensor-parallel plan's hooks
    (parallelize_module: they turn the input into a DTensor and the output logits into the
    plan's layout) are set aside for the call: ``fn`` returns a loss, not logits, and reads the
    DTensor weight itself (FSDP2 over a tensor-parallel head: the 2-D case)."""
    own = vars(module).get("forward")
    hook_dicts = (module._forward_pre_hooks, module._forward_hooks)
    saved = [dict(d) for d in hook_dicts]
    for d in hook_dicts:
        for key in [key for key, hook in d.items() if is_tp_hook(hook)]:
            del d[key]
    module.forward = fn
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
        for d, kept in zip(hook_dicts, saved):  # in their order, FSDP2's added ones kept
            added = {key: hook for key, hook in d.items() if key not in kept}
            d.clear()
            d.update(kept)
            d.update(added)
