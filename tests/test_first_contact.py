"""bench/first_contact.py's verdicts, on hand-written run reports: what a GPU run must show to pass issue 17's
first step, and that a CPU run cannot pass it by accident. (Its launches are the launcher's own: the dry run,
`python -m bench.first_contact --dry-run`, is in bench/README.md with its measured time, not in the suite.)"""

from bench.first_contact import item, markdown, not_run, run_items

GPU_METRICS = {
    "status": "completed",
    "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 1},
    "peak_memory": {"device_allocated_bytes": 3 * 2**30, "device_reserved_bytes": 4 * 2**30,
                    "device_total_bytes": 80 * 2**30},
    "mfu": 0.12,
    "gates": {"verdict": "no gates", "peak_memory": None},
    "final_save_check": {"tensors": 28, "compared_with": "each rank's shards of the weights in memory"},
}
GPU_ARGS = {"patches_applied": [{"patch": "peft_fsdp.strip_fsdp1_wrapper_names"}]}


def results(items: list[dict]) -> dict[str, str]:
    return {it["item"]: it["result"] for it in items}


def test_a_good_gpu_run_passes_every_item():
    got = results(run_items("smoke x", 0, GPU_METRICS, GPU_ARGS, on_gpu=True))
    assert got == {
        "smoke x: exit code 0": "pass",
        "smoke x: status completed": "pass",
        "smoke x: device is CUDA": "pass",
        "smoke x: peak allocated/reserved memory and MFU recorded": "pass",
        "smoke x: gates' verdict recorded with the GPU's memory total": "pass",
        "smoke x: no CPU-only patch applied": "pass",
        "smoke x: final save checked": "pass",
    }


def test_each_missing_gpu_figure_or_cpu_patch_fails_its_item():
    cpu_patched = {"patches_applied": [{"patch": "cpu_fsdp.fsdp_state_on_cpu"}]}
    no_mfu = dict(GPU_METRICS, mfu=None, mfu_note="no peak known for this GPU")
    got = results(run_items("r", 0, no_mfu, cpu_patched, on_gpu=True))
    assert got["r: peak allocated/reserved memory and MFU recorded"] == "FAIL"
    assert got["r: no CPU-only patch applied"] == "FAIL"
    on_cpu = dict(GPU_METRICS, device={"type": "cpu", "name": "AMD EPYC"})
    assert results(run_items("r", 0, on_cpu, GPU_ARGS, on_gpu=True))["r: device is CUDA"] == "FAIL"
    no_capacity = dict(GPU_METRICS, peak_memory=dict(GPU_METRICS["peak_memory"], device_total_bytes=None))
    assert results(run_items("r", 0, no_capacity, GPU_ARGS, on_gpu=True))[
        "r: gates' verdict recorded with the GPU's memory total"] == "FAIL"
    unchecked = dict(GPU_METRICS, final_save_check=None)
    assert results(run_items("r", 0, unchecked, GPU_ARGS, on_gpu=True))["r: final save checked"] == "FAIL"


def test_a_preempted_run_is_judged_by_its_own_exit_code_and_status():
    preempted = dict(GPU_METRICS, status="preempted", final_save_check=None)
    got = results(run_items("d", 75, preempted, GPU_ARGS, on_gpu=True, expect_rc=75, expect_status="preempted"))
    assert got["d: exit code 75"] == "pass" and got["d: status preempted"] == "pass"
    assert "d: final save checked" not in got  # a preemption writes a checkpoint, not the final save
    got = results(run_items("d", 0, GPU_METRICS, GPU_ARGS, on_gpu=True, expect_rc=75, expect_status="preempted"))
    assert got["d: exit code 75"] == "FAIL" and got["d: status preempted"] == "FAIL"  # it ran to the end instead


def test_no_report_and_a_cpu_dry_run_never_count_as_passes():
    assert results(run_items("r", None, None, None, on_gpu=True)) == {
        "r: exit code 0": "FAIL", "r: metrics.json written": "FAIL"}
    dry = results(run_items("r", 0, dict(GPU_METRICS, device={"type": "cpu"}), GPU_ARGS, on_gpu=False))
    assert dry["r: device figures"] == "n/a" and dry["r: no CPU-only patch applied"] == "n/a"


def test_the_markdown_table_has_one_row_per_item():
    items = [item("a", True, "x | y"), item("b", False), item("c", None)]
    result = {"environment": {"device": {"name": "NVIDIA H100"}, "date": "2026-11-24T00:00:00+00:00",
                              "nvidia_smi": "NVIDIA H100, 81559 MiB, 580.159.04", "versions": {"torch": "2.11.0"}},
              "passed": 1, "failed": 1, "not_applicable": 1, "command": "python -m bench.first_contact",
              "duration_s": 12.0, "dry_run": False, "items": items}
    text = markdown(result)
    assert text.splitlines()[0] == "# First contact, NVIDIA H100: 1 passed, 1 failed, 1 n/a"
    assert "| a | pass | x \\| y |" in text and "| b | FAIL |  |" in text and "| c | n/a |  |" in text


def test_a_run_left_out_for_time_is_said_in_the_title():
    result = {"environment": {"device": {"name": "NVIDIA H100"}, "date": "d", "nvidia_smi": None, "versions": {}},
              "passed": 0, "failed": 0, "not_applicable": 0, "not_run": 1, "command": "c", "duration_s": 1.0,
              "dry_run": False, "items": [not_run("smoke x")]}
    text = markdown(result)
    assert text.splitlines()[0].endswith("0 passed, 0 failed, 0 n/a, 1 not run")
    assert "| smoke x | not run | time budget (--deadline-s)" in text


def test_an_fsdp1_lora_recipe_is_not_smoked_on_one_gpu_but_is_on_two():
    """The first GPU plan's smoke of mistral-small-lora on one H100 failed at its first save (FSDP1 is NO_SHARD on one
    process); the launcher now refuses that, and first_contact records it as n/a with the launcher's own line."""
    from bench.first_contact import refused_here

    assert "LoRA under FSDP1 with one process" in refused_here("mistral-small-lora", 1)
    assert refused_here("mistral-small-lora", 2) is None
    assert refused_here("llama-3.1-8b-lora", 1) is None  # FSDP2
    assert refused_here("mistral-7b-full", 1) is None  # no LoRA


def test_the_default_on_the_tiny_model_is_the_smoke_runs_model_of_it(cache_dir, tmp_path):
    """The GPU plan's first step ran no recipe in CI's dry run: random_smollm2 still called make smoke's model builder
    with its old arguments. The tiny model is the default's architecture, built where make smoke builds it."""
    import json

    from bench.first_contact import random_smollm2

    out = random_smollm2(tmp_path, tiny=True)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # SmolLM2-135M's
    assert config["num_hidden_layers"] == 2 and out.is_relative_to(cache_dir)
