"""Three gaps between the libraries' context parallel and the all-to-all form the pack runs where torch's ring cannot
(speed/context_parallel.py, which keeps the form itself; docs/training.md, "Long sequences: context parallel").
Found making tiny-cpu-lora train with cp 2 on CPU over gloo; checked on the versions of versions.py.

1. The step's context (accelerate 1.15). `Accelerator._prepare_cp`, which `prepare` calls under a cp mesh, sets
   `_cp_context` to torch's `context_parallel` (the ring: SDPA's CUDA kernels only) and puts
   `big_modeling._attach_context_parallel_hooks` on the model (the padding mask dropped for is_causal);
   `maybe_context_parallel` then enters `_cp_context(buffers=, buffer_seq_dims=, no_restore_buffers=)` around each
   step. accelerate has no public way to give its "torch" cp backend another form. The pack replaces `_prepare_cp` on
   the run's accelerator only (not the class): the same hooks, the pack's step context.

2. The attention's name (transformers 5.17-5.24). The Trainer refuses any attn_implementation but "sdpa" under cp
   (`_prepare_context_parallel_inputs`), and the model looks its attention function up by that name at every
   forward (`AttentionInterface.get_interface`). So while a step runs, "sdpa" names the all-to-all attention
   (`AttentionInterface.register`, the mapping's own setter) and the library's function is put back after.

3. The split's order (torch 2.13). The order in which torch's ring cuts a row (its head-tail load balancer, rank r of
   N holding chunks r and 2N-1-r of 2N) is private: `_create_default_load_balancer` and the balancer's
   `_generate_indices`. The all-to-all form cuts rows the same way, so that a cp run splits a row alike on CUDA and
   elsewhere and load-balances the causal work as torch does.

Each refuses in one line (guard.target) when its target changed or a library is outside the checked versions.
"""

from __future__ import annotations

import contextlib

from fsdp_recipes.patches.guard import PatchTargetChanged, record, target
from fsdp_recipes.patches.versions import checked_on

_PATCH = "context_parallel."
# the targets checked in this process, by (patch, owner, name): points 2 and 3 run at every step, and a check reads
# the installed versions' metadata
_CHECKED: dict[tuple, object] = {}


def _target(owner, name: str, params: tuple[str, ...], *, patch: str, checked_on: dict[str, str]):
    key = (patch, owner, name)
    if key not in _CHECKED:
        _CHECKED[key] = target(owner, name, params, patch=patch, checked_on=checked_on)
    return _CHECKED[key]


def step_context_on(accelerator, step_context) -> None:
    """Point 1: `prepare` gives this accelerator's steps `step_context(buffers=..., buffer_seq_dims=...,
    no_restore_buffers=...)` (a context manager) and accelerate's mask hooks on each prepared model."""
    import accelerate.big_modeling
    from accelerate import Accelerator

    patch, libs = _PATCH + "step_context_on", checked_on("accelerate", "torch")
    target(Accelerator, "_prepare_cp", ("self", "args"), patch=patch, checked_on=libs)
    # the caller of _cp_context, whose keywords step_context takes
    target(Accelerator, "maybe_context_parallel", ("self", "buffers", "buffer_seq_dims", "no_restore_buffers"),
           patch=patch, checked_on=libs)
    attach_hooks = target(accelerate.big_modeling, "_attach_context_parallel_hooks", ("model",), patch=patch,
                          checked_on=libs)

    def prepare_cp(*args):
        import torch

        accelerator._cp_context = step_context
        for arg in args:
            if isinstance(arg, torch.nn.Module):
                attach_hooks(arg)
        return args

    accelerator._prepare_cp = prepare_cp
    record(patch, "accelerate.Accelerator._prepare_cp (on the run's accelerator)",
           "accelerate's cp backend 'torch' runs torch's ring only, which needs SDPA's CUDA kernels")


@contextlib.contextmanager
def sdpa_is(attention):
    """Point 2: inside, the attention transformers' models call for attn_implementation "sdpa" is `attention`."""
    from transformers.modeling_utils import AttentionInterface

    register = _sdpa_register()
    library = AttentionInterface()["sdpa"]  # a new interface has no local entries: the global mapping's
    register("sdpa", attention)
    try:
        yield
    finally:
        register("sdpa", library)


def _sdpa_register():
    """AttentionInterface.register, once the lookup it feeds is the one point 2 was written for."""
    from transformers.modeling_utils import AttentionInterface

    patch = _PATCH + "sdpa_is"
    libs = checked_on("transformers")
    _target(AttentionInterface, "get_interface", ("self", "attn_implementation", "default"), patch=patch,
            checked_on=libs)
    register = _target(AttentionInterface, "register", ("key", "value"), patch=patch, checked_on=libs)
    if "sdpa" not in AttentionInterface():
        raise PatchTargetChanged(f"patch {patch}: transformers' AttentionInterface no longer has 'sdpa'. Fix: "
                                 f"install transformers{libs['transformers']}, or update "
                                 "fsdp_recipes/patches/context_parallel.py")
    record(patch, "transformers AttentionInterface 'sdpa' (while a cp step runs)",
           "transformers' Trainer requires attn_implementation 'sdpa' under context parallel")
    return register


def check_step_patches(cp: int) -> None:
    """Points 2 and 3, which run inside each step, checked when the run is set up: a changed target refuses before
    training, and run_args.json (written before the first step) lists them."""
    _sdpa_register()
    ring_order(2 * cp, cp)


def ring_order(seq_len: int, cp: int):
    """Point 3: the positions of a row of `seq_len` tokens in the order torch's ring splits it over `cp` ranks (its
    default load balancer: head-tail when seq_len is a multiple of 2 x cp), or None where torch cuts contiguously."""
    from torch.distributed.tensor.experimental._context_parallel import _load_balancer

    patch, libs = _PATCH + "ring_order", checked_on("torch")
    create = _target(_load_balancer, "_create_default_load_balancer", ("seq_length", "world_size", "device"),
                    patch=patch, checked_on=libs)
    balancer = create(seq_len, cp, "cpu")
    if balancer is None:
        return None
    generate = _target(type(balancer), "_generate_indices", ("self", "restore"), patch=patch, checked_on=libs)
    record(patch, "torch _context_parallel._load_balancer._create_default_load_balancer",
           "torch's order of a row split for its ring is private")
    return generate(balancer)[0]
