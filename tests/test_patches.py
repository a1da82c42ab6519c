"""Patches of private library functions refuse to apply when their target changed, and say which ran."""

import pytest
from packaging.specifiers import SpecifierSet

from fsdp_recipes.patches import guard


class Library:
    @staticmethod
    def private(module, state, offload_to_cpu):
        return offload_to_cpu


def test_a_patch_applies_to_the_signature_it_was_written_for():
    fn = guard.target(Library, "private", ("module", "state", "offload_to_cpu"), patch="demo", checked_on={})
    assert fn(1, 2, 3) == 3


def test_a_changed_signature_refuses_with_one_line_naming_the_patch():
    with pytest.raises(guard.PatchTargetChanged) as err:
        guard.target(Library, "private", ("module", "state", "offload_to_cpu", "with_grads"),
                     patch="demo", checked_on={})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("patch demo: ") and "('module', 'state', 'offload_to_cpu')" in message
    assert "Fix: install the versions it was checked on ()" in message


def test_a_library_outside_the_checked_range_refuses_with_one_line(monkeypatch):
    """Same signature, another release: the code behind it may differ, so the patch refuses before applying."""
    from fsdp_recipes.patches import versions

    monkeypatch.setattr(versions, "version", lambda lib: {"torch": "2.16.0+cu130", "accelerate": "1.15.0"}[lib])
    ranges = {"torch": ">=2.11,<2.16", "accelerate": ">=1.15,<1.16"}
    with pytest.raises(guard.PatchTargetChanged) as err:
        guard.target(Library, "private", ("module", "state", "offload_to_cpu"), patch="demo", checked_on=ranges)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("patch demo: torch 2.16.0+cu130 is outside the versions it was checked on "
                              "(torch>=2.11,<2.16, accelerate>=1.15,<1.16)"), message
    # a local build and a release candidate of a release inside the range are inside it
    monkeypatch.setattr(versions, "version", lambda lib: {"torch": "2.15.0rc1", "accelerate": "1.15.0"}[lib])
    assert versions.outside(ranges) == []
    monkeypatch.setattr(versions, "version", lambda lib: {"torch": "2.11.0+cu128", "accelerate": "1.14.2"}[lib])
    assert versions.outside(ranges) == ["accelerate 1.14.2"]


def test_pyproject_allows_exactly_the_ranges_the_patches_were_checked_on():
    """Widening a dependency in pyproject.toml without checking the patches (make test-compat, then versions.py)
    would let users install releases no patch was checked on; narrowing one would leave a checked range unused."""
    import tomllib

    from packaging.requirements import Requirement

    from conftest import REPO
    from fsdp_recipes.patches.versions import CHECKED

    deps = {r.name: r.specifier for r in map(Requirement,
                                             tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])}
    for lib, spec in CHECKED.items():
        assert deps[lib] == SpecifierSet(spec), f"pyproject.toml has {lib}{deps[lib]}, versions.py {lib}{spec}"


def test_a_missing_target_refuses():
    with pytest.raises(guard.PatchTargetChanged, match=r"patch demo: .*\.gone no longer exists"):
        guard.target(Library, "gone", ("x",), patch="demo", checked_on={})


def test_the_cpu_adapters_targets_match_the_installed_libraries(monkeypatch):
    """Every patch of the CPU FSDP adapter finds its target with the signature it was written for (the versions
    pinned for CI), and records itself once."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import _init_utils, _optim_utils
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    from fsdp_recipes.patches import cpu_fsdp

    saved = [(AcceleratorState, "__init__"), (FullyShardedDataParallelPlugin, "__post_init__"),
             (_init_utils, "_check_module_states_for_sync_module_states"),
             (FlatParamHandle, "flat_param_to"), (_optim_utils, "_unflatten_orig_param_states")]
    for owner, name in saved:  # monkeypatch restores the originals after the test
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(guard, "APPLIED", [])
    for patch in (cpu_fsdp.fsdp_state_on_cpu, cpu_fsdp.fsdp1_param_init_on_cpu,
                  cpu_fsdp.fsdp1_sync_module_states_over_gloo, cpu_fsdp.fsdp1_offload_moves_copy_on_cpu,
                  cpu_fsdp.fsdp1_optimizer_states_without_offload):
        patch()
    assert [p["patch"] for p in guard.APPLIED] == [
        "cpu_fsdp.fsdp_state_on_cpu", "cpu_fsdp.fsdp1_param_init_on_cpu", "cpu_fsdp.fsdp1_sync_module_states_over_gloo",
        "cpu_fsdp.fsdp1_offload_moves_copy_on_cpu", "cpu_fsdp.fsdp1_optimizer_states_without_offload"]


def test_the_peft_and_resume_patches_targets_match_the_installed_libraries(monkeypatch):
    """The patches every run applies (peft_fsdp.py, optim_resume.py) find their targets with the signatures they
    were written for, and record themselves."""
    import inspect

    import accelerate.accelerator
    import accelerate.utils
    import accelerate.utils.fsdp_utils
    import peft
    import transformers.trainer
    from peft.tuners import tuners_utils
    from peft.utils.other import ModulesToSaveWrapper

    from fsdp_recipes.patches import optim_resume, peft_fsdp

    for owner, name in [(tuners_utils, "_get_tuner_state_dict_key_prefixes"), (peft, "set_peft_model_state_dict"),
                        (transformers.trainer, "update_fsdp_plugin_peft"), (ModulesToSaveWrapper, "adapter_state_dict"),
                        (accelerate.utils.fsdp_utils, "load_fsdp_optimizer"), (accelerate.utils, "load_fsdp_optimizer"),
                        (accelerate.accelerator, "load_fsdp_optimizer"), (transformers.trainer, "load_fsdp_optimizer")]:
        if hasattr(owner, name):  # the library's own function, also when an earlier test in this process patched it
            monkeypatch.setattr(owner, name, inspect.unwrap(getattr(owner, name)))
    monkeypatch.setattr(guard, "APPLIED", [])
    monkeypatch.setattr(optim_resume, "_PATCHED", False)
    peft_fsdp.strip_fsdp1_wrapper_names()
    peft_fsdp.load_adapter_through_fsdp1_root()
    peft_fsdp.keep_fsdp1_output_layer_in_root()
    optim_resume.init_state_before_fsdp1_sharded_load()
    assert [p["patch"] for p in guard.APPLIED] == [
        "peft_fsdp.strip_fsdp1_wrapper_names", "peft_fsdp.load_adapter_through_fsdp1_root",
        "peft_fsdp.keep_fsdp1_output_layer_in_root", "optim_resume.init_state_before_fsdp1_sharded_load"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP1 at world size 1 runs NO_SHARD, and says so
def test_fsdp1s_move_to_the_cpu_is_a_copy_as_from_a_gpu(world_of_one, monkeypatch):
    """torch's offload branch frees the unsharded storage right after moving the flat parameter to the CPU
    (FlatParamHandle.to_cpu). From a GPU the move is new memory; on CPU, without the patch, it is the same storage."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    from conftest import tiny_lora_model
    from fsdp_recipes.patches import cpu_fsdp

    handle = FullyShardedDataParallel(tiny_lora_model(), device_id=torch.device("cpu"), use_orig_params=True)._handle
    before = handle.flat_param.data_ptr()
    handle.flat_param_to(torch.device("cpu"))
    assert handle.flat_param.data_ptr() == before  # torch alone: no copy, the bug's cause

    monkeypatch.setattr(FlatParamHandle, "flat_param_to", FlatParamHandle.flat_param_to)
    monkeypatch.setattr(guard, "APPLIED", [])
    cpu_fsdp.fsdp1_offload_moves_copy_on_cpu()
    values = handle.flat_param.detach().clone()
    handle.flat_param_to(torch.device("cpu"))
    assert handle.flat_param.data_ptr() != before
    assert torch.equal(handle.flat_param.detach(), values)


def test_the_cpu_adapter_is_for_machines_without_any_accelerator(monkeypatch):
    """Inside an FSDP launch it switches on without an accelerator, and stays off with one, whichever kind (an XPU
    machine has no CUDA, and must not be forced onto the CPU)."""
    import torch

    from fsdp_recipes.patches import cpu_fsdp

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what an XPU/NPU/MPS machine says
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert cpu_fsdp.needed() is False
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert cpu_fsdp.needed() is True
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert cpu_fsdp.needed() is False  # not an FSDP launch


def test_the_recipes_checkpointing_names_reach_a_release_that_has_only_the_old_ones():
    """transformers 5.17 knows only gradient_checkpointing(_kwargs); the recipes say activation_checkpointing(_kwargs),
    the newest releases' names. versions.py parses the new names beside such an SFTConfig and copies them over."""
    from dataclasses import dataclass

    from fsdp_recipes.patches import versions

    @dataclass
    class OldSFTConfig:
        gradient_checkpointing: bool = False
        gradient_checkpointing_kwargs: dict | None = None

    assert versions.new_training_field_names(OldSFTConfig) is versions.NewTrainingFieldNames
    training = OldSFTConfig()
    given = versions.NewTrainingFieldNames(activation_checkpointing=True,
                                           activation_checkpointing_kwargs='{"use_reentrant": false}')  # CLI: JSON
    versions.apply_new_training_field_names(given, training, {"activation_checkpointing",
                                                              "activation_checkpointing_kwargs"})
    assert training.gradient_checkpointing is True and training.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert training.activation_checkpointing is True  # what the planner and the launcher read
    untouched = OldSFTConfig(gradient_checkpointing=True)  # a recipe that still uses the old name keeps it
    versions.apply_new_training_field_names(versions.NewTrainingFieldNames(), untouched, set())
    assert untouched.gradient_checkpointing is True and untouched.activation_checkpointing is True


def test_the_context_parallel_patches_targets_match_the_installed_libraries(monkeypatch):
    """patches/context_parallel.py (a cp mesh without CUDA: the all-to-all form) finds its targets with the signatures
    it was written for, records itself, puts the library's SDPA back after a step, and refuses in one line when
    accelerate's _prepare_cp changed."""
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator
    from transformers.modeling_utils import AttentionInterface

    from fsdp_recipes.patches import context_parallel

    monkeypatch.setattr(guard, "APPLIED", [])
    monkeypatch.setattr(context_parallel, "_CHECKED", {})
    accelerator = SimpleNamespace()
    step = object()
    context_parallel.step_context_on(accelerator, step)
    context_parallel.check_step_patches(2)  # what runs in each step, checked and recorded before the first
    library_sdpa = AttentionInterface()["sdpa"]
    attention = lambda *args, **kwargs: None  # noqa: E731
    with context_parallel.sdpa_is(attention):
        assert AttentionInterface()["sdpa"] is attention
    assert AttentionInterface()["sdpa"] is library_sdpa
    # torch's head-tail order: 8 tokens over 2 ranks, rank 0 the first and last chunk of 2; 6 tokens: contiguous
    assert context_parallel.ring_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert context_parallel.ring_order(6, 2) is None
    assert [p["patch"] for p in guard.APPLIED] == [
        "context_parallel.step_context_on", "context_parallel.sdpa_is", "context_parallel.ring_order"]
    model = torch.nn.Linear(1, 1)  # no attention layers: accelerate's hooks find none to attach
    assert accelerator._prepare_cp(model, "optimizer") == (model, "optimizer") and accelerator._cp_context is step

    monkeypatch.setattr(Accelerator, "_prepare_cp", lambda self, *args, mesh=None: args)
    with pytest.raises(guard.PatchTargetChanged) as err:
        context_parallel.step_context_on(SimpleNamespace(), step)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("patch context_parallel.step_context_on: accelerate.accelerator.Accelerator."
                                     "_prepare_cp now takes ('self', 'args', 'mesh')"), str(err.value)
