"""The FSDP1 settings the seeds use (use_orig_params, sync_module_states with cpu_ram_efficient_loading, backward
prefetch), through the real launcher on 2 CPU processes: sharded checkpoints that resume on another world size.
(Elsewhere: a trained LM head under FSDP1 against one process in test_grad_accumulation.py; preemption and exact
resume under FSDP1 in test_preemption.py, whose full fine-tuning run also checks the loaded weights and the plain
final model; LoRA final saves under FSDP1 in test_smoke.py's mistral-small-lora runs.)"""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import fsdp1_recipe, launch

COMMON = ["--max_steps", "8", "--save_strategy", "steps", "--save_steps", "4", "--logging_steps", "1",
          "--eval_strategy", "no", "--save_merged_model", "false"]


def losses(run):
    history = json.loads((run / "log_history.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


@pytest.mark.slow
def test_fsdp1_sharded_checkpoint_resumes_on_four_processes(tmp_path, cache_dir):
    # Not 1: with one process FSDP1 switches to NO_SHARD, whose sharded state dict of a LoRA model fails in
    # torch's own post-hook ("FSDP assumes ...base_layer.weight is in the state_dict"); the launcher refuses
    # that setting (config_check.check_fsdp_with_peft, tests/test_bad_input.py).
    two = fsdp1_recipe(tmp_path / "two", fsdp_state_dict_type="SHARDED_STATE_DICT")
    out = tmp_path / "two-ranks"
    res = launch([str(two), *COMMON, "--output_dir", str(out)], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoint-4" / "pytorch_model_fsdp_0").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own shard

    four = fsdp1_recipe(tmp_path / "four", fsdp_state_dict_type="SHARDED_STATE_DICT")
    acc = yaml.safe_load((four / "accelerate.yaml").read_text())
    acc["num_processes"] = 4
    (four / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    resumed = tmp_path / "resumed"
    res = launch([str(four), *COMMON, "--per_device_train_batch_size", "8",  # the same 32 samples per step
                  "--resume_from_checkpoint", str(out / "checkpoint-4"), "--output_dir", str(resumed)], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((resumed / "metrics.json").read_text())["world_size"] == 4
    resume_check = json.loads((resumed / "metrics.json").read_text())["resume_check"]
    assert resume_check["step"] == 4 and resume_check["optimizer_states_checked"] > 0  # AdamW restored (optim_resume.py)
    a, b = losses(out), losses(resumed)
    for step in range(5, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-3), (step, a[step], b[step])
    wa, wb = load_file(out / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert len(wa) == 56
    for key in wa:
        assert torch.allclose(wa[key], wb[key], rtol=1e-3, atol=1e-5), key


def test_resume_check_refuses_an_optimizer_that_was_not_restored(tmp_path):
    """What FSDP1 + SHARDED_STATE_DICT resumes gave before optim_resume.py: no state, or only the zero-step init."""
    from fsdp_recipes.checkpoint.resume_check import verify_optimizer_steps

    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    param = torch.nn.Parameter(torch.ones(3))
    optim = torch.optim.AdamW([param])
    with pytest.raises(RuntimeError, match="optimizer has no state"):
        verify_optimizer_steps(optim, tmp_path)
    param.grad = torch.zeros(3)
    optim.step()  # step 1: initialised, not loaded
    with pytest.raises(RuntimeError, match="1 of 1 optimizer states have step 1 .* saved at step 10"):
        verify_optimizer_steps(optim, tmp_path)
    for _ in range(9):
        optim.step()
    assert verify_optimizer_steps(optim, tmp_path) == {"optimizer_states_checked": 1, "step": 10}
