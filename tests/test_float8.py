"""`float8: true`: torchao float8 training as a recipe setting (float8.py).

On CPU, torch 2.13 has a reference float8 matmul, so the whole path runs here: the conversion, FSDP2 over two
processes, a checkpoint, a resume and the final save. Not the speed: that is the GPU ladder's rung 4.
torchao lives in its own directory (FLOAT8_SITE, see the Makefile), put on the path only for these tests.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from test_bad_input import assert_one_line_error

import conftest
from conftest import REPO, launcher_checks, run


@pytest.fixture(scope="module")
def torchao_site():
    return conftest.torchao_site()


# torch's CPU float8 matmul is a reference implementation whose speed depends on the CPU: on the 2-core AMD EPYC VM
# the probe below (one float8 linear's forward and backward, 1 thread, median of 4 new token counts) takes 7.8 ms
# (2026-11-26, a CI run beside it), and the full fine-tune below under 2 minutes; on the 2-core Intel Xeon (AMX, CPU
# family 6 model 167) the probe takes 32-33 ms (3 quiet runs, 2026-11-28) and the full fine-tune ran 702 s, the
# compiled one over 600 s (a whole `make test` there, 2026-11-28; issue 47 saw 717 s). The limit sits between the
# two, 2x the AMD figure: the runs go ahead under it and are skipped, with the figure, above it.
FLOAT8_PROBE_LIMIT_S = 0.015
FLOAT8_PROBE = """
import time, torch
from torchao.float8 import convert_to_float8_training
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False))
convert_to_float8_training(m)
m(torch.randn(32, 64, requires_grad=True)).sum().backward()  # warm-up: one-time set-up stays out
times = []
for n in (37, 41, 43, 47):  # a new token count each time, as unpacked and packed batches bring
    x = torch.randn(n, 64, requires_grad=True)
    t = time.perf_counter(); m(x).sum().backward(); times.append(time.perf_counter() - t)
print(sorted(times)[len(times) // 2])  # the median call
"""


@pytest.fixture(scope="module")
def float8_fast_enough(torchao_site):
    """Skips a multi-process float8 run where this CPU's float8 matmul is too slow for the suite (see above)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=torchao_site, OMP_NUM_THREADS="1")
    try:
        res = subprocess.run([sys.executable, "-c", FLOAT8_PROBE], capture_output=True, text=True, env=env,
                             timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("this CPU's float8 matmul is emulated slowly: 5 calls of one float8 linear took over 120 s")
    assert res.returncode == 0, res.stderr[-2000:]
    median = float(res.stdout.strip().splitlines()[-1])
    if median > FLOAT8_PROBE_LIMIT_S:
        pytest.skip(f"this CPU's float8 matmul is emulated slowly: one float8 linear's forward and backward took "
                    f"(median of 4 new token counts) "
                    f"{median:.2f} s (limit {FLOAT8_PROBE_LIMIT_S} s); the 2-process float8 runs would take minutes")
    return median


def tiny_model():
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from fsdp_recipes.assets.tiny_assets import TINY_SHAPE

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=268, **TINY_SHAPE, tie_word_embeddings=False))


def test_conversion_takes_the_decoder_linears_and_computes_in_float8(torchao_site, monkeypatch):
    import torch

    monkeypatch.syspath_prepend(torchao_site)
    from torchao.float8.float8_linear import Float8Linear

    from fsdp_recipes.speed import float8

    model = tiny_model()
    ids = torch.randint(6, 268, (2, 37))  # 74 tokens: not a multiple of 16, pad_inner_dim's case on CUDA
    before = model(input_ids=ids, labels=ids).loss
    converted, linears = float8.convert(model)
    layers = model.config.num_hidden_layers
    assert (converted, linears) == (7 * layers, 7 * layers + 1)
    assert type(model.lm_head) is torch.nn.Linear  # TRL's fused head reads its weight: left as it is
    assert isinstance(model.model.layers[0].self_attn.q_proj, Float8Linear)
    after = model(input_ids=ids, labels=ids).loss
    after.backward()  # the weight-gradient matmul runs over the 74 tokens (CPU's reference matmul takes any count)
    assert model.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    # float8 rounding changes the loss a little, not a lot: evidence the matmuls really ran in float8
    assert after.item() != before.item() and abs(after.item() - before.item()) < 0.05 * before.item()
    keys = set(tiny_model().state_dict())
    assert set(model.state_dict()) == keys  # checkpoints and the saved model keep the plain layout


def test_layers_whose_dimensions_scaled_mm_refuses_are_left_alone(torchao_site, monkeypatch):
    import torch

    monkeypatch.syspath_prepend(torchao_site)
    from fsdp_recipes.speed import float8

    net = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 40))  # 40: not a multiple of 16
    assert float8.convert(net) == (1, 2)
    assert type(net[1]) is torch.nn.Linear


def test_float8_with_lora_is_refused_before_launch(cache_dir, monkeypatch, capsys):
    res = launcher_checks(["tiny-cpu-lora", "--float8", "true"], monkeypatch, capsys)
    assert_one_line_error(res, "float8: true is for full fine-tuning")


def recipe_with(float8: bool, use_peft: bool):
    """The parsed recipe as the float8 option reads it: its own setting and the model's use_peft."""
    from types import SimpleNamespace

    return SimpleNamespace(option=lambda name: SimpleNamespace(float8=float8), model=SimpleNamespace(use_peft=use_peft))


def test_float8_without_torchao_names_the_install(monkeypatch):
    import importlib.util

    from fsdp_recipes.errors import UserError
    from fsdp_recipes.speed import float8

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"needs torchao.*Fix: `pip install -e \.\[gpu\]`"):
        float8.check_installed(recipe_with(float8=True, use_peft=False))
    float8.check_installed(recipe_with(float8=False, use_peft=True))  # off: nothing to check
    float8.check_config(recipe_with(float8=False, use_peft=True))


def test_a_gpu_older_than_ada_is_refused(monkeypatch):
    import torch

    from fsdp_recipes.errors import UserError
    from fsdp_recipes.speed import float8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"A100-SXM4-80GB has 8\.0\. Fix: set float8: false"):
        float8.check_device()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    float8.check_device()  # H100: fine


@pytest.mark.slow
def test_float8_full_finetune_trains_checkpoints_resumes_and_saves_a_plain_model(torchao_site, float8_fast_enough,
                                                                                 cache_dir, tmp_path):
    """2 processes, FSDP2 over gloo, full fine-tuning in float8: 4 steps with a checkpoint at 2 and 4, then the
    same command with max_steps 6 resumes from checkpoint-4; the final model loads without torchao."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "float8"
    args = [sys.executable, "-m", "fsdp_recipes.launch.launcher", "tiny-cpu-lora", "--use_peft", "false", "--float8", "true",
            "--learning_rate", "1e-3", "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "2",
            "--logging_steps", "1", "--save_merged_model", "false", "--output_dir", str(out)]
    first = run([*args, "--max_steps", "4"], cache_dir, **conftest.library_server(torchao_site))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "[train] float8: 28 of 29 linear layers converted" in first.stdout
    second = run([*args, "--max_steps", "6"], cache_dir, **conftest.library_server(torchao_site))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout and "checkpoint-4" in second.stdout

    run_args = json.loads((out / "run_args.json").read_text())
    assert run_args["speed_args"]["float8"] is True
    assert run_args["speed_options"]["float8"] == {"converted": 28, "linear": 29}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["steps"] == 6 and metrics["resumed_from"]
    losses = [e["loss"] for e in json.loads((out / "log_history.json").read_text())["log_history"] if "loss" in e]
    assert len(losses) == 6 and losses[-1] < losses[0]  # steps 1-4 kept from the first run, 5-6 after the resume
    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers: no torchao on this path
    base = AutoModelForCausalLM.from_pretrained(run_args["model_args"]["model_name_or_path"])
    assert set(model.state_dict()) == set(base.state_dict())
    changed = [n for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert len(changed) == 39


@pytest.mark.parametrize("installed", [False, True])
def test_smoke_keeps_float8_only_where_torchao_is_installed(installed, cache_dir, tmp_path, monkeypatch, capsys):
    import importlib.util
    import shutil

    import yaml

    from fsdp_recipes.launch import smoke

    recipe = tmp_path / "mistral-7b-full"
    shutil.copytree(REPO / "recipes" / "mistral-7b-full", recipe)
    sft = yaml.safe_load((recipe / "sft.yaml").read_text())
    (recipe / "sft.yaml").write_text(yaml.safe_dump({**sft, "float8": True}))
    real = importlib.util.find_spec
    found = object()  # smoke only asks whether torchao is found
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (found if installed else None) if name == "torchao" else real(name, *a))
    from fsdp_recipes.config import recipes

    loaded = recipes.load(recipe)
    smoke.prepare(loaded)
    overrides = loaded.overrides
    turned_off = "[smoke] float8: torchao is not installed here -> off" in capsys.readouterr().out
    assert turned_off is not installed
    assert (overrides[overrides.index("--float8") + 1] == "false") if not installed else "--float8" not in overrides


def fake_nvidia_smi(tmp_path, monkeypatch, output: str, rc: int = 0):
    """An nvidia-smi on PATH that answers the compute-capability query with `output`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/smi-args\nprintf '{output}'\nexit {rc}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_the_launcher_refuses_an_old_gpu_from_nvidia_smi(torchao_site, cache_dir, tmp_path, monkeypatch, capsys):
    from fsdp_recipes.config import hardware
    from fsdp_recipes.errors import UserError
    from fsdp_recipes.speed import float8

    fake_nvidia_smi(tmp_path, monkeypatch, "9.0\\n8.0\\n")
    assert hardware.gpu_capabilities() == [(9, 0), (8, 0)]
    with pytest.raises(UserError, match=r"nvidia-smi reports 8\.0 here\. Fix: set float8: false"):
        float8.check_launch(recipe_with(float8=True, use_peft=False), {}, "accelerate.yaml")
    monkeypatch.syspath_prepend(torchao_site)
    res = launcher_checks(["tiny-cpu-lora", "--use_peft", "false", "--float8", "true"], monkeypatch, capsys)
    assert_one_line_error(res, "nvidia-smi reports 8.0 here. Fix: set float8: false")  # the launcher's own check
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # only the GPUs the job may use are asked about
    hardware.gpu_capabilities()
    assert (tmp_path / "smi-args").read_text().splitlines()[-1].endswith("-i 0")


def test_an_nvidia_smi_that_cannot_say_leaves_the_check_to_the_ranks(tmp_path, monkeypatch):
    from fsdp_recipes.config import hardware

    fake_nvidia_smi(tmp_path, monkeypatch, "Field \"compute_cap\" is not a valid field to query.\\n", rc=2)
    assert hardware.gpu_capabilities() is None


@pytest.mark.slow
def test_float8_under_accelerates_regional_compile(torchao_site, float8_fast_enough, cache_dir, tmp_path):
    """The GPU ladder's rung 4 builds on rung 3 when compile measured fastest: float8 layers inside accelerate's
    regionally compiled decoder layers (AOT_EAGER here: dynamo and AOTAutograd, no inductor), with packing and
    activation checkpointing, 2 processes of FSDP2."""
    import shutil

    import yaml

    recipe = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", recipe)
    acc = yaml.safe_load((recipe / "accelerate.yaml").read_text())
    acc["dynamo_config"] = {"dynamo_backend": "AOT_EAGER", "dynamo_use_regional_compilation": True,
                            "dynamo_use_dynamic": True}
    (recipe / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    out = tmp_path / "run"
    res = run([sys.executable, "-m", "fsdp_recipes.launch.launcher", str(recipe), "--use_peft", "false", "--float8", "true",
               "--packing", "true", "--activation_checkpointing", "true", "--max_steps", "3", "--eval_strategy", "no",
               "--logging_steps", "1", "--save_merged_model", "false", "--output_dir", str(out)],
              cache_dir, **conftest.library_server(torchao_site))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[train] float8: 28 of 29 linear layers converted" in res.stdout
    run_args = json.loads((out / "run_args.json").read_text())
    assert run_args["accelerate_env"]["ACCELERATE_DYNAMO_BACKEND"] == "AOT_EAGER"
    assert run_args["accelerate_env"]["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"].lower() == "true"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["steps"] == 3 and math.isfinite(metrics["final_train_loss"])
