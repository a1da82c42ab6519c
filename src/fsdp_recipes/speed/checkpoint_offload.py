"""`activation_checkpointing_offload: true`: the inputs activation checkpointing saves wait for the backward in
pinned host memory instead of on the GPU.

With every layer checkpointed, what a long row leaves on the GPU is each layer's input, layers x tokens x hidden x
2 bytes (bf16): 8 GiB for a 131,072-token row of Llama 3.1 8B, most of its activations. transformers 5.23's
`activation_checkpointing_enable(offload=True)` (TrainingArguments' `activation_checkpointing_kwargs` key `offload`,
which its Trainer pops and passes on) runs each checkpointed layer under torch's `save_on_cpu(pin_memory=True)`: the
saved inputs are copied to host memory in the forward and back in the backward, on the compute stream (slower,
never different: the same tensors come back). accelerate's `fsdp_activation_checkpointing_offload` does the same
for accelerate's own FSDP2 checkpointing, which the pack does not use (TrainingArguments' checkpointing applies the
policies, speed/activation_checkpointing.py), so this option sets the Trainer's key.

On a CPU it cannot run: transformers asks save_on_cpu for pinned memory, which a machine without an accelerator
has no allocator for ("pin_memory=True requires a CUDA or other accelerator backend", in the first forward); and
there the activations are in host memory already. So the launcher refuses it on a CPU in one line, `make smoke`
turns it off there and says so, and tests/test_long_rows.py checks on CPU that transformers' offload path (its
save_on_cpu around each checkpoint, unpinned) gives the loss and every gradient of the run without it, bit for bit.

Checked before launch: checkpointing must be on (a policy other than none; offload of nothing is a mistake), and the
installed transformers must take `offload` (its activation_checkpointing_enable; the lowest transformers the pack
allows may not). `make plan` moves the checkpointed layers' inputs from the GPU's activations to a host-memory line
(planning/memory_budget.py `host_bytes`); the run report records it under speed_options.
"""

from __future__ import annotations

import inspect

from fsdp_recipes.config.argv import as_bool
from fsdp_recipes.errors import UserError
from fsdp_recipes.speed import activation_checkpointing as ac
from fsdp_recipes.speed import attention

FIELDS = ("activation_checkpointing_offload",)  # its own setting (config/option_registry.py)
KEY = "offload"  # the key of TrainingArguments' activation_checkpointing_kwargs transformers' Trainer pops


def enabled(cfg) -> bool:
    return bool(cfg.option("checkpoint_offload").activation_checkpointing_offload)


def checkpointing_off(cfg) -> bool:
    name = ac.policy(cfg)
    return name == "none" or (name is None and not ac.checkpointed(cfg.training))


def check_config(cfg) -> None:
    if enabled(cfg) and checkpointing_off(cfg):
        raise UserError("activation_checkpointing_offload: true offloads the inputs activation checkpointing saves, "
                        "and this recipe checkpoints no layer. Fix: activation_checkpointing_policy full (or "
                        "every_<k>, ops, auto), or activation_checkpointing_offload: false.")


def check_installed(cfg) -> None:
    if not enabled(cfg):
        return
    import transformers
    from transformers import PreTrainedModel

    if KEY not in inspect.signature(PreTrainedModel.activation_checkpointing_enable).parameters:
        raise UserError(f"activation_checkpointing_offload: true needs transformers' activation_checkpointing_enable"
                        f"(offload=...), which transformers {transformers.__version__} lacks. Fix: transformers "
                        "5.23 or newer, or activation_checkpointing_offload: false.")


def check_launch(cfg, acc: dict, path) -> None:
    if enabled(cfg) and attention.on_cpu_in_launcher(cfg, acc):
        raise UserError("activation_checkpointing_offload: true moves saved activations from a GPU to pinned host "
                        "memory; these ranks train on CPU, where they are in host memory already and torch has no "
                        "pinned allocator. Fix: --activation_checkpointing_offload false on CPU.")


def smoke(field, gpus: int) -> tuple[list[str], str | None]:
    if as_bool("activation_checkpointing_offload", field("activation_checkpointing_offload", False)) and not gpus:
        return (["--activation_checkpointing_offload", "false"],
                "activation checkpointing offload: pinned host memory needs a GPU -> off")
    return [], None


def settle(cfg) -> None:
    """After activation_checkpointing's settle (the registry's order): `offload` into the kwargs it wrote, in both
    spellings the installed TrainingArguments has."""
    if not enabled(cfg):
        return
    training = cfg.training
    for flag, args in (("activation_checkpointing", "activation_checkpointing_kwargs"),
                       ("gradient_checkpointing", "gradient_checkpointing_kwargs")):
        if getattr(training, flag, False):
            setattr(training, args, {**(getattr(training, args) or {}), KEY: True})


def planner_settings(cfg) -> dict:
    return {"checkpoint_offload": enabled(cfg)}


def planner_note(cfg, config) -> str:
    return ("activation checkpointing offload: the checkpointed layers' inputs wait in pinned host memory (the "
            "\"host memory\" line), copied out in the forward and back in the backward")


def prepare_trainer(trainer, cfg) -> dict:
    kwargs = ac.kwargs_of(trainer.args)
    trainer.accelerator.print(f"[train] activation checkpointing offload: {bool(kwargs.get(KEY))} (saved inputs in "
                              "pinned host memory)")
    return {"offload": bool(kwargs.get(KEY))}
