"""Where the processes go on a machine with GPUs (config/placement.py, launch/smoke.py), checked on CPU with the GPU
count faked: what the launcher would hand `accelerate launch` and the ranks. What happens on the GPUs is issue 17's
first-contact run (bench/first_contact.py)."""

import pytest
import yaml

from conftest import REPO, RanksWouldStart, launcher_checks, launcher_until_ranks
from fsdp_recipes.config import placement
from fsdp_recipes.errors import UserError
from fsdp_recipes.launch import smoke


def recipe_yamls(name: str) -> tuple[dict, dict]:
    folder = REPO / "recipes" / name
    return (yaml.safe_load((folder / "sft.yaml").read_text()), yaml.safe_load((folder / "accelerate.yaml").read_text()))


def test_the_default_on_one_gpu_keeps_its_global_batch_and_trains_in_bf16():
    raw, acc = recipe_yamls("smollm2-135m-lora")
    assert (acc["num_processes"], raw["per_device_train_batch_size"], raw["bf16"]) == (2, 8, False)  # as written
    placed = placement.place("smollm2-135m-lora", raw, acc, gpus=1, overrides=[], launch_args=[])
    assert placed.processes == 1
    # 2 processes x 8 sequences = 16 per step, on one GPU 1 x 16
    assert placed.overrides == ["--per_device_train_batch_size", "16", "--bf16", "true"]
    assert "FSDP_RECIPES_DEVICE=cpu" in placed.notes[0]


def test_the_default_on_eight_gpus_takes_two_and_a_gpu_without_bf16_stays_float32():
    raw, acc = recipe_yamls("smollm2-135m-lora")
    placed = placement.place("smollm2-135m-lora", raw, acc, gpus=8, overrides=[], launch_args=[])
    assert (placed.processes, placed.overrides) == (2, ["--bf16", "true"])
    placed = placement.place("smollm2-135m-lora", raw, acc, gpus=1, overrides=[], launch_args=[], bf16_ok=False)
    assert placed.overrides == ["--per_device_train_batch_size", "16"]


def test_the_users_own_settings_win_and_a_cpu_machine_changes_nothing():
    raw, acc = recipe_yamls("smollm2-135m-lora")
    mine = ["--bf16=false", "--per_device_train_batch_size", "4"]
    placed = placement.place("smollm2-135m-lora", raw, acc, gpus=1, overrides=mine, launch_args=[])
    assert (placed.processes, placed.overrides) == (1, [])
    assert placement.place("smollm2-135m-lora", raw, acc, gpus=0, overrides=[], launch_args=[]) == placement.Placement()


@pytest.mark.parametrize("wrapper", [["--num_processes", "1"], ["--num-processes=1"],
                                     ["--num-machines", "1", "--num-processes", "1"]])
def test_a_wrapper_that_placed_the_job_is_left_alone(wrapper):
    raw, acc = recipe_yamls("smollm2-135m-lora")
    assert placement.place("smollm2-135m-lora", raw, acc, gpus=1, overrides=[], launch_args=wrapper) == \
        placement.Placement()


def test_use_cpu_keeps_the_run_on_cpu_and_an_uneven_batch_is_said():
    raw, acc = recipe_yamls("smollm2-135m-lora")
    assert placement.place("smollm2-135m-lora", raw, acc, gpus=1, overrides=["--use_cpu", "true"],
                           launch_args=[]) == placement.Placement()
    three = dict(acc, num_processes=3)  # 3 processes x 5 sequences = 15 per step: no even split over 2 GPUs
    placed = placement.place("smollm2-135m-lora", dict(raw, per_device_train_batch_size=5), three, gpus=2,
                             overrides=[], launch_args=[])
    assert placed.processes == 2 and "--per_device_train_batch_size" not in placed.overrides  # 15 over 2: uneven
    assert "per_device_train_batch_size stays 5: 10 sequences per step instead of 15" in placed.notes[0]


def test_a_gpu_container_without_nvidia_smi_leaves_the_count_to_torch(monkeypatch):
    from fsdp_recipes.config import hardware

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert hardware.gpu_count_hint() is None
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: [])
    assert hardware.gpu_count_hint() == 0


def test_more_gpu_processes_than_gpus_is_one_line_before_any_rank():
    raw, acc = recipe_yamls("mistral-7b-full")
    assert acc["num_processes"] == 8
    with pytest.raises(UserError) as err:  # min_gpus lowered by hand: the 8 processes would not fit
        placement.place("mistral-7b-full", raw, acc, gpus=1, overrides=["--min_gpus", "1"], launch_args=[])
    assert "starts 8 GPU process(es) on this node, which has 1 GPU(s)" in str(err.value)
    assert "--num_processes 1" in str(err.value)
    wrapped = ["--num_machines", "2", "--num_processes", "16"]  # 8 per node: fits 8 GPUs
    assert placement.place("mistral-7b-full", raw, acc, gpus=8, overrides=[], launch_args=wrapped).processes is None


def test_device_setting(monkeypatch):
    monkeypatch.setenv(placement.ENV, "gpu")
    with pytest.raises(UserError, match="FSDP_RECIPES_DEVICE='gpu' is not a device setting"):
        placement.gpus_here()
    monkeypatch.setenv(placement.ENV, "CPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert placement.gpus_here() == 0
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # what the ranks inherit


@pytest.mark.parametrize("gpus, processes, hsdp", [(1, 1, None), (2, 2, None), (3, 3, None), (4, 4, (2, 2)),
                                                    (8, 8, (2, 4)), (16, 16, (2, 8))])
def test_smoke_on_gpus_scales_the_hsdp_recipe(gpus, processes, hsdp):
    _, acc = recipe_yamls("mistral-large-hsdp")
    assert acc["num_processes"] == 16 and acc["parallelism_config"]["parallelism_config_dp_replicate_size"] == 2
    scaled = smoke.scale_accelerate(acc, gpus)
    assert scaled["num_processes"] == processes
    got = scaled.get("parallelism_config")
    sizes = (got["parallelism_config_dp_replicate_size"], got["parallelism_config_dp_shard_size"]) if got else None
    assert sizes == hsdp
    assert scaled["fsdp_config"] == acc["fsdp_config"] and scaled["mixed_precision"] == acc["mixed_precision"]


def test_smoke_on_one_gpu_through_the_launcher(cache_dir, tmp_path, monkeypatch, capsys):
    """What `make smoke RECIPE=mistral-large-hsdp` hands accelerate on a 1-GPU machine: one process, plain FSDP2, no
    --use_cpu, the recipe's bf16."""
    monkeypatch.setenv("FSDP_RECIPES_SMOKE", "1")
    monkeypatch.setattr(placement, "gpus_here", lambda: 1)
    with pytest.raises(RanksWouldStart) as started:
        launcher_until_ranks(["mistral-large-hsdp", "--output_dir", str(tmp_path / "run")], monkeypatch, capsys,
                             checks_first=False)  # TrainingArguments would refuse bf16 on this machine's CPU
    cmd = started.value.cmd
    scaled = yaml.safe_load(open(cmd[cmd.index("--config_file") + 1]))
    assert scaled["num_processes"] == 1 and "parallelism_config" not in scaled
    assert scaled["fsdp_config"]["fsdp_version"] == 2 and scaled["mixed_precision"] == "bf16"
    assert "--use_cpu" not in started.value.overrides and "--num_processes" not in cmd  # the scaled YAML says so
    out = capsys.readouterr().out
    assert "-> 1 on this one's 1 GPU(s)" in out and "HSDP needs 4 GPUs for both dimensions: plain FSDP here" in out
    assert "runs anywhere" not in out  # the smoke run placed itself


def test_a_portable_recipe_on_one_gpu_through_the_launcher(cache_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(placement, "gpus_here", lambda: 1)
    monkeypatch.setattr(placement.hardware, "bf16_supported", lambda: True)
    with pytest.raises(RanksWouldStart) as started:
        launcher_until_ranks(["tiny-cpu-lora", "--output_dir", str(tmp_path / "run"), "--max_steps", "2"],
                             monkeypatch, capsys, checks_first=False)
    cmd = started.value.cmd
    assert cmd[cmd.index("--num_processes") + 1] == "1"
    after = started.value.overrides  # the recipe's GPU settings, then the user's overrides
    assert after == ["--per_device_train_batch_size", "32", "--bf16", "true", "--output_dir", str(tmp_path / "run"),
                     "--max_steps", "2"]
    assert "1 GPU(s) here and recipe tiny-cpu-lora runs anywhere (min_gpus 0): 1 process(es) on GPUs instead of " \
           "accelerate.yaml's 2" in capsys.readouterr().out


def test_a_gpu_recipe_asking_for_more_processes_than_gpus(cache_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(placement, "gpus_here", lambda: 2)
    monkeypatch.setattr(placement.hardware, "gpu_count", lambda: 2)  # the min_gpus check's count
    res = launcher_checks(["qwen3-8b-full", "--min_gpus", "2"], monkeypatch, capsys)
    assert res.returncode != 0 and "starts 8 GPU process(es) on this node, which has 2 GPU(s)" in res.stderr


def test_on_a_cpu_with_bf16_arithmetic_the_default_trains_with_bf16_autocast_and_says_so():
    raw, _ = recipe_yamls("smollm2-135m-lora")
    assert raw["cpu_bf16"] == "auto" and raw["bf16"] is False
    placed = placement.cpu_precision("smollm2-135m-lora", raw, [], ["avx512_bf16"])
    assert placed.overrides == ["--bf16", "true", "--use_cpu", "true"]  # TrainingArguments: bf16 on CPU needs use_cpu
    assert placed.notes == ["recipe smollm2-135m-lora: bf16 autocast on this CPU (avx512_bf16): bf16 matmuls, "
                            "float32 master weights (cpu_bf16: auto; --cpu_bf16 false trains in float32)"]
    placed = placement.cpu_precision("smollm2-135m-lora", raw, [], [])  # neither AVX-512 BF16 nor AMX
    assert placed.overrides == [] and "float32 on this CPU" in placed.notes[0] and "emulated" in placed.notes[0]
    # the user's word wins, and a recipe without the field (every other) trains as written, silently
    for overrides in (["--bf16", "false"], ["--cpu_bf16", "false"], ["--fp16=false"]):
        assert placement.cpu_precision("smollm2-135m-lora", raw, overrides, ["amx_bf16"]) == placement.Placement()
    # fp16 is refused: accelerate's loss scaler is for GPUs, and FSDP still computes in float16 on a CPU
    for overrides, written in ((["--fp16=true"], raw), ([], {**raw, "fp16": True})):
        with pytest.raises(UserError, match=r"fp16 on a CPU computes in float16 with no loss scaler.*Fix: --fp16 "
                                            r"false --bf16 true"):
            placement.cpu_precision("smollm2-135m-lora", written, overrides, ["amx_bf16"])
    # the fix it names passes: the recipe's fp16 off, bf16 on
    fixed = placement.cpu_precision("smollm2-135m-lora", {**raw, "fp16": True}, ["--fp16", "false", "--bf16", "true"],
                                    ["amx_bf16"])
    assert fixed == placement.Placement()
    smoke = placement.cpu_precision("smollm2-135m-lora", raw, ["--fp16", "true"], [], smoke=True)
    assert smoke.overrides == [] and "checks the plumbing, not the numbers" in smoke.notes[0]
    tiny, _ = recipe_yamls("tiny-cpu-lora")
    assert placement.cpu_precision("tiny-cpu-lora", tiny, [], ["amx_bf16"]) == placement.Placement()
    with pytest.raises(UserError, match=r"cpu_bf16 'yes' is not a setting. Fix: cpu_bf16: auto"):
        placement.cpu_precision("smollm2-135m-lora", raw, ["--cpu_bf16", "yes"], [])


def test_the_cpus_bf16_flags_are_read_from_cpuinfo():
    from fsdp_recipes.config import hardware

    zen4 = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512vl\n"
    spr = "flags\t\t: avx512f amx_bf16 amx_tile amx_int8 avx512_bf16\n"
    assert hardware.cpu_bf16_flags(zen4) == ["avx512_bf16"]
    assert hardware.cpu_bf16_flags(spr) == ["avx512_bf16", "amx_bf16"]
    assert hardware.cpu_bf16_flags("flags\t\t: fpu sse2 avx2 fma\n") == [] and hardware.cpu_bf16_flags("") == []


def test_the_launcher_hands_the_cpu_precision_to_the_ranks_before_the_users_settings(cache_dir, tmp_path,
                                                                                        monkeypatch, capsys):
    monkeypatch.setattr(placement, "gpus_here", lambda: 0)
    monkeypatch.setattr(placement.hardware, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    with pytest.raises(RanksWouldStart) as started:
        launcher_until_ranks(["tiny-cpu-lora", "--output_dir", str(tmp_path / "run"), "--cpu_bf16", "auto"],
                             monkeypatch, capsys, checks_first=False)
    assert started.value.overrides == ["--bf16", "true", "--use_cpu", "true", "--output_dir", str(tmp_path / "run"),
                                       "--cpu_bf16", "auto"]
    assert "recipe tiny-cpu-lora: bf16 autocast on this CPU (avx512_bf16)" in capsys.readouterr().out


def test_placements_default_batch_is_the_trainers():
    """Placement rescales the per-device batch before the recipe is parsed: for a recipe that sets none it must assume
    the default TrainingArguments will use, not a copy that drifts from it."""
    import dataclasses

    from transformers import TrainingArguments

    default = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}["per_device_train_batch_size"]
    assert placement.TRAINER_DEFAULT_BATCH == default
