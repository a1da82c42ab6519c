"""make bench: structure and honesty of the results, not speed (no timing thresholds anywhere).

The overhead and data benchmarks really run here, at tiny sizes; the time-to-first-step benchmark launches the
default recipe twice (~40 s), so its phase arithmetic is checked on recorded clocks instead.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics

import pytest

from bench import compare as bench_compare
from bench import data as bench_data
from bench import first_step as bench_first_step
from bench import overhead as bench_overhead
from bench import plot as bench_plot
from bench import suite as bench
from fsdp_recipes.records import file_stamp

TINY = dict(batch=2, seq=16, warmup=1, steps=2, reps=2)


@pytest.fixture(scope="module")
def overhead(tmp_path_factory, cache_dir):
    return bench_overhead.run(tmp_path_factory.mktemp("overhead"), TINY, layouts=(1,), shape=bench_overhead.QUICK_SHAPE)


@pytest.fixture(scope="module")
def data(tmp_path_factory, cache_dir):
    return bench_data.run(tmp_path_factory.mktemp("data"), examples=200, reps=1)


def first_step_record() -> dict:
    """Clocks as the probed runs record them (seconds from the command's start), in both start orders."""
    names = ["process_created", "probe_start", "imports_done", "through_gate", "configured", "data_loaded",
             "model_load_start", "model_load_end", "peft_wrap_start", "peft_wrap_end",
             "dataset_prep_start", "dataset_prep_end", "sft_trainer_init_end", "fsdp_wrap_and_optimizer_end",
             "first_step_end_end"]
    probed = {}
    for order, start in (("serial", 4.0), ("overlap", 1.0)):
        probed[order] = {"order": order, "total_s": 20.0 + start, "launcher_first_output_s": 0.5,
                         "launcher_starts_ranks_s": start, "launcher_checks_s": 3.0, "launcher_checks_done_s": 3.5,
                         "rank0_marks_s": {n: start + 1.0 + i for i, n in enumerate(names)}}
    return {"probed_runs": probed, "phases_s": {o: bench_first_step.phases(r) for o, r in probed.items()},
            "first_step_end_s": {o: r["rank0_marks_s"]["first_step_end_end"] for o, r in probed.items()},
            "unprobed_total_s": {"serial": 24.0, "overlap": 21.0}}


@pytest.mark.slow
def test_overhead_is_the_median_of_the_measured_pair_ratios(overhead):
    layout = overhead["layouts"]["1proc"]
    runs = layout["runs"]
    # one paired run per repetition: the pack's steps and the bare step run after each, both recorded step by step
    assert layout["design"] == "paired"
    assert [(r["rep"], r["side"]) for r in runs] == [(0, "pack"), (0, "bare"), (1, "pack"), (1, "bare")]
    assert all(len(r["step_times_s"]) == TINY["steps"] and all(t > 0 for t in r["step_times_s"]) for r in runs)
    ratios = [p / b for rep in range(TINY["reps"]) for p, b in zip(runs[2 * rep]["step_times_s"],
                                                                  runs[2 * rep + 1]["step_times_s"])]
    s = layout["summary"]
    assert s["overhead_pct"] == pytest.approx(100 * (statistics.median(ratios) - 1))
    assert s["median_step_s"] == {side: statistics.median(t for r in runs if r["side"] == side
                                                          for t in r["step_times_s"]) for side in ("bare", "pack")}
    assert len(s["per_rep_ratio"]) == TINY["reps"]
    # CPU time: measured per step too; a step cannot use more CPU than 1 thread x wall time (+ a little slack for
    # the clock reads), since the 1-process layout runs torch on 1 thread
    assert all(0 < c <= w * 1.5 + 0.01 for r in runs for c, w in zip(r["step_cpu_s"], r["step_times_s"]))
    cpu_ratios = [p / b for rep in range(TINY["reps"]) for p, b in zip(runs[2 * rep]["step_cpu_s"],
                                                                      runs[2 * rep + 1]["step_cpu_s"])]
    assert s["cpu_time"]["overhead_pct"] == pytest.approx(100 * (statistics.median(cpu_ratios) - 1))
    # the model really is the configured one: the parameter formula against the saved config's real module
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(overhead["model"]["path"])
    assert overhead["model"]["parameters"] == sum(p.numel() for p in model.parameters())


def synthetic_layout(pack_factor: float, rep_drift: list[float], noise: float = 0.01, steps: int = 8,
                     step_drift: float = 0.0, design: str | None = "paired") -> dict:
    """Step times of a known overhead: every repetition has its own machine speed, and within it every step its own
    (drift of +-step_drift, shared by the pair measured together); pack = bare x factor, each x (1 +- noise)."""
    import random

    rng = random.Random(1)
    runs = []
    for rep, speed in enumerate(rep_drift):
        machine = [speed * (1 + rng.uniform(-step_drift, step_drift)) for _ in range(steps)]
        for side, factor in (("pack", pack_factor), ("bare", 1.0)):
            times = [m * factor * (1 + rng.uniform(-noise, noise)) for m in machine]
            runs.append({"rep": rep, "side": side, "step_times_s": times, "median_step_s": statistics.median(times),
                         "step_cpu_s": [t * 0.9 for t in times]})
    layout = {"runs": runs, "reps": len(rep_drift), "batch_per_rank": 1, "seq_len": 8, "world_size": 1}
    return {**layout, "design": design} if design else layout


@pytest.mark.parametrize("factor, expected", [(1.01, "within goal"), (1.12, "over goal")])
def test_overhead_interval_holds_the_true_overhead_and_decides_the_goal(factor, expected):
    s = bench_overhead.summarize(synthetic_layout(factor, [0.40, 0.42, 0.41, 0.43]))
    lo, hi = s["overhead_pct_ci95"]
    assert lo <= 100 * (factor - 1) <= hi and hi - lo < 3  # tight when every repetition agrees
    assert s["verdict"] == expected


def test_pairing_cancels_the_machines_drift_that_separate_runs_cannot():
    # the machine's speed swings +-25% from step to step (the VM's 0.43-0.62 s for the same step): a pair measured
    # together shares the swing, so the paired statistic still decides a 1% overhead; the same numbers read as two
    # unpaired sides (the earlier design's statistic) cannot
    layout = synthetic_layout(1.01, [0.40, 0.55, 0.45, 0.60], step_drift=0.25)
    paired = bench_overhead.summarize(layout)
    assert paired["verdict"] == "within goal" and paired["overhead_pct"] == pytest.approx(1.0, abs=1.0)
    unpaired = bench_overhead.summarize({**layout, "design": None})
    lo, hi = unpaired["overhead_pct_ci95"]
    assert unpaired["verdict"].startswith("undecided") and hi - lo > 10


def test_files_of_the_earlier_design_keep_their_statistic():
    # bench/results/*T1131Z..T1346Z.json: separate runs per side; their published figures are ratios of medians
    layout = synthetic_layout(1.03, [0.40, 0.50], design=None)
    s = bench_overhead.summarize(layout)
    med = {side: statistics.median(t for r in layout["runs"] if r["side"] == side for t in r["step_times_s"])
           for side in ("bare", "pack")}
    assert s["overhead_pct"] == pytest.approx(100 * (med["pack"] / med["bare"] - 1))
    assert s["statistic"] == "ratio of the sides' medians"


def test_one_repetition_decides_nothing():
    # a single repetition's steps agree closely with each other (the interval is narrow), but only repetitions carry
    # the drift between runs: `make bench --quick` (1 repetition) must not say "within goal"
    s = bench_overhead.summarize(synthetic_layout(1.01, [0.40]))
    assert s["overhead_pct_ci95"][1] < 5 and s["verdict"].startswith("undecided: one repetition")


def test_overhead_interval_widens_when_repetitions_disagree():
    # the 11:31 FSDP2 run's shape: repetitions at 0.82, 1.14 and 1.03 cannot settle a 5% goal
    layout = synthetic_layout(1.0, [0.5, 0.5, 0.5])
    for run, factor in zip((r for r in layout["runs"] if r["side"] == "pack"), (0.82, 1.14, 1.03)):
        run["step_times_s"] = [t * factor for t in run["step_times_s"]]
    s = bench_overhead.summarize(layout)
    lo, hi = s["overhead_pct_ci95"]
    assert lo < 0 < 5 < hi
    assert s["verdict"].startswith("undecided")


def test_default_overhead_model_is_tens_of_millions_of_parameters(tmp_path, cache_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mistral", vocab_size=268, **bench_overhead.SHAPE)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    # by hand: hidden 512, 8 heads (and 8 kv heads) x 64 = 512, intermediate 1536, 6 layers, vocabulary 268, untied:
    # per layer 4 x 512 x 512 (q, k, v, o) + 3 x 512 x 1536 (gate, up, down) + 2 x 512 (norms) = 3,408,896
    assert n == 6 * (4 * 512 * 512 + 3 * 512 * 1536 + 2 * 512) + 512 + 2 * 268 * 512 == 20_728_320
    assert 20e6 <= n <= 40e6


@pytest.mark.slow
def test_data_bench_records_every_run_and_its_medians(data):
    assert len(data["runs"]) == 6  # 3 paths x packing off/on x 1 repetition
    for key, path, packing in (("pack", "pack", False), ("trl_default_packing", "trl_default", True)):
        sel = [r for r in data["runs"] if r["path"] == path and r["packing"] == packing]
        assert data["summary"][key]["median_examples_per_s"] == statistics.median(
            200 / (r["load"] + r["prepare"]) for r in sel)
    lengths = {path: {r["max_length"] for r in data["runs"] if r["path"] == path} for path in bench_data.PATHS}
    # the recipe's setting, TRL's default, and TRL at the recipe's setting
    assert lengths == {"pack": {64}, "trl_default": {1024}, "trl_recipe_length": {64}}
    assert data["summary"]["ratio_pack_over_trl"] == pytest.approx(
        data["summary"]["pack"]["median_examples_per_s"] / data["summary"]["trl_default"]["median_examples_per_s"])
    assert data["summary"]["ratio_pack_over_trl_recipe_length_packing"] == pytest.approx(
        data["summary"]["pack_packing"]["median_examples_per_s"]
        / data["summary"]["trl_recipe_length_packing"]["median_examples_per_s"])


def test_first_step_phases_add_up_to_the_first_step():
    rec = first_step_record()
    for order, phases in rec["phases_s"].items():
        assert sum(phases.values()) == pytest.approx(rec["first_step_end_s"][order])
        assert all(v >= 0 for v in phases.values())
    # by hand from first_step_record's clocks (mark i at start + 1 + i s; the ranks start at 4 s serial, 1 s overlap):
    # the launcher's share is the start; each phase spans one mark, but the LoRA wrap (model_load_end to
    # peft_wrap_end) and dataset preparation (peft_wrap_end to dataset_prep_end) span two
    rest = [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 1, 1, 1]
    assert list(rec["phases_s"]["serial"].values()) == [4.0, *rest]
    assert list(rec["phases_s"]["overlap"].values()) == [1.0, *rest]
    assert list(rec["phases_s"]["serial"]) == list(rec["phases_s"]["overlap"])  # one table row per phase


def test_json_schema_table_and_gpu_pending(tmp_path, monkeypatch, capsys, overhead, data):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_overhead, "run", lambda *a, **k: overhead)
    monkeypatch.setattr(bench_first_step, "run", lambda *a, **k: first_step_record())
    monkeypatch.setattr(bench_data, "run", lambda *a, **k: data)
    assert bench.main(["--results", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("bench-cpu-*-quick.json")
    res = json.loads(path.read_text())
    assert res["device"]["type"] == "cpu" and res["device"]["name"] and res["device"]["cores"] >= 1
    for pkg in ("python", "torch", "transformers", "trl", "peft", "accelerate", "datasets"):
        assert res["versions"][pkg], pkg
    assert dt.datetime.fromisoformat(res["date"]).tzinfo is not None
    assert path.name == f"bench-cpu-{file_stamp(res['date'])}-quick.json"
    assert len(res["load_average_before"]) == 3 and len(res["load_average_after"]) == 3
    assert res["overhead"]["layouts"]["1proc"]["runs"] and res["data"]["runs"]
    assert res["gpu"] == bench.GPU_PENDING
    # the table shows the measured medians and ratio, and the GPU line says pending instead of figures
    s = overhead["layouts"]["1proc"]["summary"]
    assert f"{s['median_step_s']['pack']:.3f}" in out and f"{s['overhead_pct']:+.1f}%" in out
    assert f"{data['summary']['pack']['median_examples_per_s']:,.0f}" in out
    assert bench.GPU_PENDING in out
    # and its picture beside it: a PNG with the three panels' worth of height
    height, width, _ = matplotlib_shape(path.with_suffix(".png"))
    assert height > width > 500 and f"{path.with_suffix('.png').name}" in out


def test_first_step_phases_are_all_in_one_plot_group():
    record = first_step_record()
    for order, phases in record["phases_s"].items():
        groups = bench_plot.grouped_phases(phases)  # asserts that no phase is left out of every group
        assert [g for g, _ in groups] == [g for g, _ in bench_plot.PHASE_GROUPS]
        assert sum(v for _, v in groups) == pytest.approx(record["first_step_end_s"][order])


def test_plot_of_a_stored_run_without_the_newer_fields(tmp_path, overhead, data):
    # files written before the interval and the CPU time existed (bench/results/*T1131Z.json) still plot
    old = json.loads(json.dumps(overhead))
    for layout in old["layouts"].values():
        for run in layout["runs"]:
            del run["step_cpu_s"]
        del layout["summary"]
    src = tmp_path / "bench-cpu-old.json"
    src.write_text(json.dumps({"device": {"name": "cpu", "cores": 2}, "date": "2026-11-22T11:31:30+00:00",
                               "overhead": old, "first_step": first_step_record(), "data": data}))
    assert bench_plot.main([str(src)]) == 0
    assert matplotlib_shape(src.with_suffix(".png"))[0] > 500


def matplotlib_shape(path):
    import matplotlib.image

    return matplotlib.image.imread(path).shape


def test_gpu_branch_never_invents_figures(monkeypatch):
    """A CUDA setup that is broken (available, no device) gets the pending line and no figure. Where a device is
    seen, the ladder runs instead (tests/test_bench_gpu.py)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    msg = bench.gpu_part()
    assert msg == bench.GPU_NO_DEVICE and "pending" in msg and not any(ch.isdigit() for ch in msg)


@pytest.fixture(scope="module")
def compared(tmp_path_factory, cache_dir):
    """make compare's machinery on the tiny model, 2 steps, the two strategies whose collectives differ most."""
    results = tmp_path_factory.mktemp("compare")
    assert bench_compare.main(["--tiny", "--variants", "ddp,fsdp2-full-shard", "--steps", "2",
                               "--results", str(results)]) == 0
    return json.loads(next(results.glob("compare-tiny-*.json")).read_text()), results


def test_compare_measures_every_rank_and_sets_the_plan_beside_it(compared, cache_dir):
    from safetensors import safe_open

    result, results = compared
    ddp, fsdp = result["rows"]
    with safe_open(str(cache_dir / "tiny-mistral" / "model.safetensors"), "pt") as f:
        model_bytes = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # float32, from the file's header
    for rank in range(2):
        d, s = ddp["ranks"][rank], fsdp["ranks"][rank]
        # DDP holds everything on each rank; FSDP over 2 ranks half of it; AdamW keeps two moments per weight
        assert (d["weights"], d["gradients"], d["optimizer_states"]) == (model_bytes, model_bytes, 2 * model_bytes)
        assert s["weights"] == pytest.approx(model_bytes / 2, rel=1e-3) and s["optimizer_states"] == 2 * s["weights"]
        # per step: DDP all-reduces every gradient once; FSDP reduce-scatters them once and all-gathers each layer
        # twice (forward, and backward after resharding) plus the root unit once
        assert d["collectives_per_step"]["all-reduce"]["payload"] == model_bytes
        assert s["collectives_per_step"]["reduce-scatter"]["payload"] == pytest.approx(model_bytes, rel=1e-3)
        gathered = s["collectives_per_step"]["all-gather"]["payload"]
        assert gathered > model_bytes  # the layers twice, the root unit once: make plan's count of the same
        assert gathered == pytest.approx(fsdp["planned"]["collectives"]["all-gather"]["payload"], rel=0.02)
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-4) and len(ddp["losses"]) == 2
    memory, speed, losses = result["expectations"]  # said in words, whatever the outcome
    assert memory.startswith("- Memory, fsdp2-full-shard against DDP: weights + gradients + optimizer states on rank "
                             "0 are 0.50x DDP's")
    assert speed.startswith("- Throughput, fsdp2-full-shard against DDP: ")
    assert losses.startswith("- Equal losses: the largest relative difference from ddp's per-step loss is ")
    stem = next(results.glob("compare-tiny-*.json")).with_suffix("")
    assert stem.with_suffix(".png").stat().st_size > 10_000 and "| fsdp2-full-shard | 1 |" in stem.with_suffix(
        ".md").read_text()


def test_speed_against_trl_is_the_median_of_the_ratios_within_each_pair():
    from bench.speed_vs_trl import summarize

    runs = [{"arm": "plain-trl", "pair": 0, "train_time_s": 180.0, "held_out_correct": 93, "final_loss": 0.05},
            {"arm": "pack", "pair": 0, "train_time_s": 90.0, "held_out_correct": 92, "final_loss": 0.06},
            {"arm": "plain-trl", "pair": 1, "train_time_s": 240.0, "held_out_correct": 93, "final_loss": 0.05},
            {"arm": "pack", "pair": 1, "train_time_s": 100.0, "held_out_correct": 94, "final_loss": 0.06},
            {"arm": "plain-trl", "pair": 2, "train_time_s": 150.0, "held_out_correct": 93, "final_loss": 0.05},
            {"arm": "pack", "pair": 2, "train_time_s": 100.0, "held_out_correct": 93, "final_loss": 0.06}]
    s = summarize(runs, ["plain-trl", "pack"])
    # per pair 2.0, 2.4, 1.5: their median 2.0; the ratio of the medians (180/100 = 1.8) would mix the pairs
    assert s["pack"]["speedup_over_plain_trl_per_pair"] == [2.0, 2.4, 1.5]
    assert s["pack"]["median_speedup_over_plain_trl"] == 2.0
    assert s["plain-trl"]["median_train_time_s"] == 180.0 and s["pack"]["held_out_correct"] == [92, 94, 93]


def test_paired_stages_intervals_and_exact_mcnemar_by_hand():
    """Wilson 95% for 93/100 is 86.25-96.57% (Newcombe 1998's formula by hand: centre 0.91409, half-width 0.05159);
    exact McNemar: 0 against 6 discordant rows is 2 x 0.5^6 = 0.03125, 4 against 5 is 1. The statistics are the
    package's (tests/test_intervals.py checks them against published values); the script pairs runs' stages."""
    from bench.paired_stages import report
    from fsdp_recipes.evaluation.intervals import mcnemar_exact, wilson

    lo, hi = wilson(93, 100)
    assert round(lo, 4) == 0.8625 and round(hi, 4) == 0.9657
    assert mcnemar_exact(0, 6) == 0.03125 and mcnemar_exact(4, 5) == 1.0
    sft = {"stages": [{"stage": "base"}, {"stage": "sft"}], "examples": [
        {"prompt": q, "expected": e, "base": "x", "trained": t} for q, e, t in
        (("1+4", "5", "5"), ("2+4", "6", "6"), ("3+5", "8", "9"), ("4+5", "9", "1"))]}
    kto = {"stages": [{"stage": "base"}, {"stage": "sft"}, {"stage": "kto"}], "examples": [
        {"prompt": q, "expected": e, "base": "x", "trained": t} for q, e, t in
        (("1+4", "5", "5"), ("2+4", "6", "7"), ("3+5", "8", "8"), ("4+5", "9", "9"))]}
    out = report([sft, kto])
    assert [(s["stage"], s["correct"]) for s in out["stages"]] == [("base", 0), ("sft", 2), ("kto", 3)]
    assert out["paired"][1] == {"from": "sft", "to": "kto", "only_before": 1, "only_after": 2, "mcnemar_exact_p": 1.0}
