"""What `dist.gathered_parameters(trainable_only=True)` unshards under FSDP1: the units that hold trainable weights,
not the model. One process, FSDP1 over gloo with a world of one (no ranks to start): FSDP1 then runs NO_SHARD, so
nothing is really gathered, but every unit `summon_full_params` is asked for is counted at its full size, which is
what it unshards in a real sharded run. A real two-rank gather is left to the GPU session's FSDP1 runs: a
torch.multiprocessing.spawn test here could not import this module in its children."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_lora_model as lora_model
from fsdp_recipes.dist import gathered_parameters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # FSDP1 at world size 1, mixed units


def fsdp1(model, policy: str, use_orig_params: bool):
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    # "peft": what the Trainer installs for a PEFT model (transformers' update_fsdp_plugin_peft): every LoRA leaf is
    # a unit. "layers": decoder layers only, so a unit mixes the frozen base with its LoRA weights.
    wrap = fsdp_auto_wrap_policy(model) if policy == "peft" else ModuleWrapPolicy({MistralDecoderLayer})
    return FullyShardedDataParallel(model, auto_wrap_policy=wrap, device_id=torch.device("cpu"),
                                    use_orig_params=use_orig_params)


def full_numel(unit) -> int:
    """The unsharded size of the FlatParameter one FSDP1 unit manages (0 without one); torch 2.13 internals."""
    flat = unit._flat_param
    return 0 if flat is None else flat._unpadded_unsharded_size.numel()


def count_unsharded(monkeypatch) -> list[int]:
    """Record, for every summon_full_params call, the numel of the FlatParameters it unshards."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    calls: list[int] = []
    original = FullyShardedDataParallel.summon_full_params

    def counting(module, recurse=True, *args, **kwargs):
        units = FullyShardedDataParallel.fsdp_modules(module) if recurse else [module]
        calls.append(sum(full_numel(u) for u in units))
        return original(module, recurse, *args, **kwargs)

    monkeypatch.setattr(FullyShardedDataParallel, "summon_full_params", staticmethod(counting))
    return calls


def gather_trainable(wrapped) -> dict[str, torch.Tensor]:
    with gathered_parameters(wrapped, trainable_only=True) as params:
        return {name: full.detach().clone() for name, full in params}


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_trainable_gather_scales_with_the_adapter_not_the_model(world_of_one, monkeypatch, use_orig_params):
    unsharded = {}
    for size in (128, 1024):  # the larger model has ~4x the frozen weights and the same adapter
        model = lora_model(size)
        expected = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        total = sum(p.numel() for p in model.parameters())
        wrapped = fsdp1(model, "peft", use_orig_params)
        calls = count_unsharded(monkeypatch)
        got = gather_trainable(wrapped)
        assert sorted(got) == sorted(expected)  # the names summon_full_params(root) gave: no FSDP wrapper names
        assert all(torch.equal(got[n], expected[n]) for n in expected)
        unsharded[size] = sum(calls)
        assert unsharded[size] == sum(t.numel() for t in expected.values()) < total / 100, (size, calls)
    assert unsharded[128] == unsharded[1024]


def test_fsdp1_trainable_gather_skips_units_without_trainable_weights(world_of_one, monkeypatch):
    """Decoder layers as units: each holds LoRA weights and is gathered whole, one at a time; the root (embeddings,
    final norm, LM head, all frozen) is not gathered."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = lora_model(128)
    expected = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    wrapped = fsdp1(model, "layers", use_orig_params=True)
    layers = [full_numel(u) for u in FullyShardedDataParallel.fsdp_modules(wrapped) if u is not wrapped]
    calls = count_unsharded(monkeypatch)
    got = gather_trainable(wrapped)
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)
    assert calls == layers, (calls, layers, full_numel(wrapped))
