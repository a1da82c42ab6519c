"""The experts speed option (speed/experts.py): what `auto` picks on each device, the kernels agreeing on CPU, and
what a run applies and records. In process, on a tiny Qwen3-MoE with LoRA on its experts."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_recipes.errors import UserError
from fsdp_recipes.speed import experts

# Same loss and gradients within float32 summation-order differences (measured: 0 and 4e-9 on this model)
RTOL, ATOL = 1e-5, 1e-6


def tiny_moe():
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    return AutoModelForCausalLM.from_config(config)


def test_auto_picks_grouped_mm_on_cuda_8_0_and_newer_else_what_runs_there():
    assert experts.resolve("auto", "cuda", (9, 0))[0] == "grouped_mm"
    assert experts.resolve("auto", "cuda", (8, 0))[0] == "grouped_mm"
    assert experts.resolve("auto", "cuda", (7, 5)) == ("eager", "auto: CUDA compute capability 7.5 < 8.0, no "
                                                                "grouped_mm kernel")
    assert experts.resolve("auto", "cpu")[0] == experts.CPU_CHOICE
    assert experts.resolve("batched_mm", "cuda", (9, 0)) == ("batched_mm", "as the recipe says")
    with pytest.raises(UserError, match=r"^experts_implementation: grouped_mm needs CUDA compute capability 8\.0\+; "
                                        r"this GPU has 7\.5 .* Fix: experts_implementation: auto \(eager here\)\.$"):
        experts.resolve("grouped_mm", "cuda", (7, 5))
    with pytest.raises(UserError, match=r"deepgemm is a CUDA kernel and this run is on cpu"):
        experts.resolve("deepgemm", "cpu")


def test_an_unknown_kernel_is_one_line_listing_transformers_kernels():
    cfg = SimpleNamespace(option=lambda name: SimpleNamespace(experts_implementation="grouped", expert_parallel_size=1))
    with pytest.raises(UserError, match=r"^experts_implementation: grouped is not one of transformers' experts "
                                        r"kernels\. Fix: use one of auto, eager, batched_mm, .*grouped_mm"):
        experts.check_config(cfg)


def test_the_kernels_that_run_on_cpu_give_eagers_loss_and_gradients_with_lora_on_the_experts():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_moe(), LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj"],
                                                  target_parameters=["mlp.experts.gate_up_proj",
                                                                     "mlp.experts.down_proj"]))
    with torch.no_grad():  # a trained adapter, so that its gradient path is not all zeros
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    results = {}
    for kernel in ("eager", "grouped_mm", "batched_mm"):
        model.get_base_model().set_experts_implementation(kernel)
        assert model.get_base_model().config._experts_implementation == kernel
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[kernel] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.requires_grad and "experts" in n})
    loss, grads = results["eager"]
    assert grads and all(g.abs().max() > 0 for g in grads.values())
    for kernel in ("grouped_mm", "batched_mm"):
        torch.testing.assert_close(results[kernel][0], loss, rtol=RTOL, atol=ATOL, msg=kernel)
        for name, grad in grads.items():
            torch.testing.assert_close(results[kernel][1][name], grad, rtol=RTOL, atol=ATOL, msg=f"{kernel} {name}")


def fake_trainer(model, printed):
    return SimpleNamespace(model=model, accelerator=SimpleNamespace(device=torch.device("cpu"),
                                                                    print=printed.append))


def cfg_with(value: str):
    return SimpleNamespace(option=lambda name: SimpleNamespace(experts_implementation=value))


def test_a_run_sets_the_kernel_on_the_model_prints_and_records_which_ran():
    from peft import LoraConfig, get_peft_model

    model, printed = get_peft_model(tiny_moe(), LoraConfig(r=2, target_modules=["q_proj"])), []
    model.get_base_model().set_experts_implementation("eager")
    record = experts.prepare_trainer(fake_trainer(model, printed), cfg_with("auto"))
    assert record == {"requested": "auto", "ran": experts.CPU_CHOICE, "why": experts.resolve("auto", "cpu")[1]}
    assert model.get_base_model().config._experts_implementation == experts.CPU_CHOICE
    assert printed == [f"[train] experts: {experts.CPU_CHOICE} ({record['why']})"]
    record = experts.prepare_trainer(fake_trainer(model, printed), cfg_with("batched_mm"))
    assert record["ran"] == "batched_mm" == model.get_base_model().config._experts_implementation


def test_a_dense_model_records_nothing_under_auto_and_refuses_a_named_kernel():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    assert experts.prepare_trainer(fake_trainer(dense, []), cfg_with("auto")) is None
    with pytest.raises(UserError, match=r"^experts_implementation: eager is for mixture-of-experts models, and "
                                        r"LlamaForCausalLM has no experts\. Fix: remove it \(auto\)\.$"):
        experts.prepare_trainer(fake_trainer(dense, []), cfg_with("eager"))


EXPERT_PARALLEL_REFUSED = (r"^error: expert_parallel_size 2: no release this pack allows trains expert parallelism "
                           r"resumably: accelerate 1\.15's FSDP2 has no expert mesh dimension, and transformers 5\.23's "
                           r"DistributedConfig\(ep_size=2\) trains but its Trainer refuses to checkpoint the optimizer "
                           r"of a model sharded at load time .* Fix: expert_parallel_size: 1 ")


def test_expert_parallelism_is_refused_in_one_line_before_any_rank_starts(checks):
    """The launcher, on the tiny recipe (the setting is checked whatever the model): exit 2, one line naming why
    (accelerate's mesh, transformers' Trainer) and the fix; 1, the default, trains (every other test)."""
    import re

    res = checks(["tiny-cpu-lora", "--expert_parallel_size", "2"])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and re.match(EXPERT_PARALLEL_REFUSED, lines[0]), res.stderr
    res = checks(["tiny-cpu-lora", "--expert_parallel_size", "0"])
    assert res.returncode == 2 and "expert_parallel_size 0: must be 1 or more" in res.stderr


def test_make_plan_refuses_expert_parallelism_in_the_same_line(monkeypatch, capsys):
    import re

    from test_plan_questions import run

    from conftest import REPO

    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "qwen3-30b-a3b-full", "--expert_parallel_size", "2")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and re.match(EXPERT_PARALLEL_REFUSED, lines[0]), err
