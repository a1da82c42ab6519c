"""make report, the Prometheus textfile and the example alert rules, on fake run directories (no training).

The fake runs copy the structure the run report writes (docs/run-report.md; runs/tiny-cpu-lora from
`make finetune` was the model): metrics.json, run_args.json and log_history.json ({"log_history": [...]}).
prometheus_client's parser and promql-parser come with `pip install -e .[test]`; without them those tests skip
locally and fail in CI (CI=true).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import need_module
from fsdp_recipes.errors import UserError
from fsdp_recipes.metrics import prometheus, run_comparison

REPO = Path(__file__).resolve().parent.parent
GIB, MIB = 1024**3, 1024**2


# An 8 x H100 full fine-tune: every figure present.
GPU_METRICS = {
    "schema_version": 1, "status": "completed", "error": None, "recipe": "mistral-7b-full", "resumed_from": None,
    "started_at": "2026-11-21T10:00:00+00:00", "finished_at": "2026-11-21T11:00:00+00:00",
    "wall_clock_s": 3600.0, "train_time_s": 3400.0, "time_to_first_step_s": 42.04, "steps": 1200,
    "samples": 76800, "tokens": {"non_padding": 419_753_180, "padded": 440_000_000, "scope": "all_ranks"},
    "tokens_per_second": 123456.8176, "tokens_per_second_per_device": 15432.1022,
    "world_size": 8, "num_nodes": 1, "sharding_strategy": "FULL_SHARD", "fsdp_version": 2,
    "mixed_precision": "bf16", "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 8},
    "peak_memory": {"device_allocated_bytes": 40 * GIB, "device_reserved_bytes": 44 * GIB, "device_note": None,
                    "host_rss_bytes": 12 * GIB + 512 * MIB, "host_rss_at_train_start_bytes_per_rank": [9 * GIB] * 8,
                    "scope": "max_over_ranks"},
    "params": {"total": 7_248_023_552, "trainable": 7_248_023_552},
    "param_shards": {"dtensor_params": 291, "global_numel": 7_248_023_552, "local_numel_per_rank": [906_002_944] * 8},
    "load_check": None, "final_save_check": {"tensors": 291},
    "flops_per_token": 4.4e10, "flops_seq_len": 2048.0, "peak_flops_per_device": 989e12,
    "mfu": 0.41234, "mfu_note": None,
    "first_train_loss": 1.9, "final_train_loss": 0.123456, "final_eval_loss": 0.2345,
}
# The tiny recipe on 2 CPU processes, as `make finetune` wrote it: no MFU, no device memory.
CPU_NOTE = "device is a CPU (AMD EPYC): no dense bf16 peak to compare against"
CPU_METRICS = {
    **copy.deepcopy(GPU_METRICS), "recipe": "tiny-cpu-lora", "steps": 300, "time_to_first_step_s": 5.841,
    "tokens_per_second": 3352.3467, "tokens_per_second_per_device": 1676.1733, "world_size": 2,
    "mixed_precision": "no", "device": {"type": "cpu", "name": "AMD EPYC", "count": 2},
    "peak_memory": {"device_allocated_bytes": None, "device_reserved_bytes": None,
                    "device_note": "CPU run: no device memory; see host_rss_bytes", "host_rss_bytes": 625623040,
                    "host_rss_at_train_start_bytes_per_rank": [510783488, 492818432], "scope": "max_over_ranks"},
    "peak_flops_per_device": None, "mfu": None, "mfu_note": CPU_NOTE,
    "final_train_loss": 0.02103973, "final_eval_loss": 0.0247033,
}
# A 2-node HSDP run that crashed before the ranks combined their counts.
FAILED_METRICS = {
    **copy.deepcopy(GPU_METRICS), "status": "failed", "error": "RuntimeError: NCCL timeout",
    "recipe": "mistral-large-hsdp", "steps": 37, "world_size": 16, "num_nodes": 2,
    "sharding_strategy": "HYBRID_SHARD (replicate 2 x shard 8)", "tokens_per_second": 20480.0,
    "tokens_per_second_per_device": 1280.0, "mfu": 0.3, "final_eval_loss": None,
    "tokens": {"non_padding": 1_000_000, "padded": 1_100_000, "scope": "rank0_only"},
}


def history(first: float, last: float, steps: int, eval_every: int | None) -> dict:
    """A log history shaped like the Trainer's: a train entry every 10 steps, optional eval entries."""
    entries = []
    for step in range(10, steps + 1, 10):
        loss = first * (last / first) ** ((step - 10) / max(steps - 10, 1))
        entries.append({"loss": loss, "grad_norm": 1.0, "learning_rate": 3e-3, "epoch": step / 125, "step": step})
        if eval_every and step % eval_every == 0:
            entries.append({"eval_loss": loss * 1.1, "eval_runtime": 1.2, "epoch": step / 125, "step": step})
    return {"log_history": entries}


def make_run(path: Path, metrics: dict, log: dict | None, commit: str = "c3e1aa1d310b95917f236738b59634292e712be2"):
    path.mkdir(parents=True)
    (path / "metrics.json").write_text(json.dumps(metrics, indent=2))
    run_args = {"schema_version": 1, "recipe": metrics["recipe"], "git_commit": commit,
                "launcher": {"world_size": metrics["world_size"], "num_nodes": metrics["num_nodes"]}}
    (path / "run_args.json").write_text(json.dumps(run_args, indent=2))
    if log is not None:
        (path / "log_history.json").write_text(json.dumps(log, indent=2))
    return path


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    root = tmp_path / "runs"
    return [
        make_run(root / "gpu-full", GPU_METRICS, history(1.9, 0.123456, 1200, eval_every=200)),
        make_run(root / "cpu-lora", CPU_METRICS, history(3.87, 0.021, 300, eval_every=100)),
        make_run(root / "nightly" / "hsdp", FAILED_METRICS, history(2.5, 1.7, 37, eval_every=None), commit="ab12"),
    ]


def table(markdown: str, first_cell: str = "run") -> dict[str, dict[str, str]]:
    """The report.md table whose header starts with `first_cell`, as {first column: {column: cell}}."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_cell} |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[start:end]]
    header, body = rows[0], rows[2:]
    assert all(len(r) == len(header) for r in body), rows
    return {r[0]: dict(zip(header, r)) for r in body}


def test_report_table_has_each_runs_figures(runs):
    paths = run_comparison.write_report(runs)
    assert [p.parent for p in paths] == [runs[0].parent] * 4  # the common parent of runs/ and runs/nightly/
    text = (runs[0].parent / "report.md").read_text()
    rows = table(text)
    assert list(rows) == ["gpu-full", "cpu-lora", "nightly/hsdp"]  # input order; names unique below the parent

    gpu, cpu, failed = rows["gpu-full"], rows["cpu-lora"], rows["nightly/hsdp"]
    assert gpu == {
        "run": "gpu-full", "recipe": "mistral-7b-full", "status": "completed", "steps": "1,200", "world size": "8",
        "nodes": "1", "sharding": "FULL_SHARD", "FSDP": "2", "mixed precision": "bf16",
        "device": "cuda: NVIDIA H100 80GB HBM3", "tokens/s": "123,457", "tokens/s per device": "15,432",
        "MFU": "41.2%", "peak device memory (allocated)": "40.0 GiB", "peak host RSS": "12.5 GiB",
        "time to first step": "42.0 s", "final train loss": "0.1235", "final eval loss": "0.2345",
        "held-out answer loss": "n/a", "exact match": "n/a", "commit": "c3e1aa1d",
    }
    assert (cpu["MFU"], cpu["peak device memory (allocated)"], cpu["peak host RSS"]) == ("n/a", "n/a", "596.6 MiB")
    assert (cpu["tokens/s"], cpu["tokens/s per device"], cpu["time to first step"]) == ("3,352", "1,676", "5.8 s")
    assert (cpu["final train loss"], cpu["final eval loss"], cpu["device"]) == ("0.0210", "0.0247", "cpu: AMD EPYC")
    # A failed run is still a row, with its status, and says its figures are rank 0's alone.
    assert failed["status"] == "failed (rank-0 figures)"
    assert (failed["sharding"], failed["nodes"], failed["world size"]) == ("HYBRID_SHARD (replicate 2 x shard 8)",
                                                                          "2", "16")
    assert (failed["final eval loss"], failed["commit"]) == ("n/a", "ab12")
    assert f"- MFU n/a for cpu-lora: {CPU_NOTE}" in text


def test_report_names_the_settings_that_differ(tmp_path):
    """What changed between runs, from their run_args.json: a setting, a library version; never the output path."""
    def args(out: str, float8: bool, lr: float, trl: str) -> dict:
        return {"pack_args": {"recipe_name": "mistral-7b-full", "float8": float8},
                "sft_config": {"output_dir": out, "learning_rate": lr, "bf16": True},
                "versions": {"torch": "2.13.0", "trl": trl}, "lora_config": None}

    root = tmp_path / "runs"
    runs = [make_run(root / "bf16", GPU_METRICS, None), make_run(root / "float8", GPU_METRICS, None)]
    for run, a in zip(runs, (args("runs/bf16", False, 1e-5, "1.16.0"), args("runs/float8", True, 1e-5, "1.17.0"))):
        (run / "run_args.json").write_text(json.dumps({**json.loads((run / "run_args.json").read_text()), **a}))
    run_comparison.write_report(runs)
    text = (root / "report.md").read_text()
    assert table(text, "setting") == {
        "pack_args.float8": {"setting": "pack_args.float8", "bf16": "false", "float8": "true"},
        "versions.trl": {"setting": "versions.trl", "bf16": "1.16.0", "float8": "1.17.0"},
    }
    (runs[1] / "run_args.json").write_text((runs[0] / "run_args.json").read_text())
    run_comparison.write_report(runs)
    assert "the runs' recorded settings (run_args.json) are the same" in (root / "report.md").read_text()


def test_report_compares_an_sft_run_with_a_dpo_run_on_what_both_recorded(tmp_path):
    """An SFT run beside a DPO run: the table was 40 `dpo_config.*` rows `(not recorded)` for the SFT run and "... and
    235 more", never the learning rate, the model or the trainer. Now: the kind first, the settings both recorded
    that differ (the TRL configs' shared fields under one name), and one line per kind for its own fields."""
    shared = {f"field_{i:02d}": i for i in range(50)}  # TrainingArguments' fields, alike in both

    def args(kind: str, model: str, lr: float, own: dict) -> dict:
        return {"pack_args": {"recipe_name": f"my-{kind}", "trainer": kind},
                "model_args": {"model_name_or_path": model},
                f"{kind}_config": {**shared, "output_dir": f"runs/{kind}", "learning_rate": lr, **own},
                "versions": {"trl": "1.16.0"}, "lora_config": None}

    root = tmp_path / "runs"
    runs = [make_run(root / "sft", GPU_METRICS, None), make_run(root / "dpo", GPU_METRICS, None)]
    own = ({f"sft_only_{i}": i for i in range(3)}, {f"dpo_only_{i:02d}": i for i in range(40)})
    for run, a in zip(runs, (args("sft", "base", 2e-4, own[0]), args("dpo", "runs/sft/merged", 5e-6, own[1]))):
        (run / "run_args.json").write_text(json.dumps({**json.loads((run / "run_args.json").read_text()), **a}))
    run_comparison.write_report(runs)
    text = (root / "report.md").read_text()
    rows = table(text, "setting")
    assert list(rows) == ["trainer", "model_args.model_name_or_path", "sft_config/dpo_config.learning_rate",
                          "pack_args.recipe_name"], text
    assert rows["trainer"] == {"setting": "trainer", "sft": "sft", "dpo": "dpo"}
    assert rows["sft_config/dpo_config.learning_rate"]["dpo"] == "5e-06"
    assert "(not recorded)" not in text and "more (compare" not in text
    assert "- dpo_config: 40 fields only the DPO run (dpo) has, a trainer kind's own" in text
    assert "- sft_config: 3 fields only the SFT run (sft) has, a trainer kind's own" in text


def test_report_same_modules_in_another_printed_order_are_the_same_setting(tmp_path):
    """An older run_args.json holds a set as its printed form, in an order that varies between processes; a newer
    one as a sorted list. The same modules are the same setting in any of these forms."""
    root = tmp_path / "runs"
    runs = [make_run(root / name, GPU_METRICS, None) for name in ("a", "b", "c", "d")]
    modules = ["{'down_proj', 'q_proj', 'v_proj'}", "{'v_proj', 'down_proj', 'q_proj'}",
               ["down_proj", "q_proj", "v_proj"], "{'q_proj', 'v_proj'}"]
    for run, target in zip(runs, modules):
        args = json.loads((run / "run_args.json").read_text())
        args["lora_config"] = {"r": 8, "target_modules": target}
        (run / "run_args.json").write_text(json.dumps(args))
    run_comparison.write_report(runs[:3])
    assert "the runs' recorded settings (run_args.json) are the same" in (root / "report.md").read_text()
    run_comparison.write_report(runs)  # d targets fewer modules: that one is a difference
    rows = table((root / "report.md").read_text(), "setting")
    assert list(rows) == ["lora_config.target_modules"]
    assert rows["lora_config.target_modules"]["d"] == '["q_proj", "v_proj"]'


def test_report_refuses_a_common_parent_of_root_or_home(tmp_path, monkeypatch, capsys):
    """runs/x and /tmp/y have / as their common parent: the report would go to /report.md. Refused in one line
    naming --out; with --out it is written there."""
    with pytest.raises(UserError, match=r"common parent is /: .*ARGS=\"--out DIR\""):
        run_comparison.default_out(Path("/"))
    monkeypatch.setenv("HOME", str(tmp_path))
    runs = [make_run(tmp_path / "x", CPU_METRICS, None), make_run(tmp_path / "elsewhere" / "y", CPU_METRICS, None)]
    with pytest.raises(SystemExit) as exit_:
        run_comparison.main([*map(str, runs)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "common parent is your home folder" in err and "--out DIR" in err
    assert not (tmp_path / "report.md").exists()
    run_comparison.main([*map(str, runs), "--out", str(tmp_path / "report")])
    assert (tmp_path / "report" / "report.md").is_file()


def test_report_plots_are_real_pngs(runs, tmp_path):
    image = need_module("PIL.Image")  # Pillow comes with matplotlib
    out = tmp_path / "elsewhere"
    run_comparison.main([*map(str, runs), "--out", str(out)])
    for name in ("loss.png", "throughput.png", "memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        with image.open(out / name) as png:
            png.verify()  # checks the chunks' CRCs: a truncated or corrupt file fails
    with image.open(out / "loss.png") as png:
        colors = {c for _, c in png.convert("RGB").getcolors(maxcolors=1 << 20)}
    # matplotlib's first three cycle colours: each run's curves were drawn, the third one (failed) too.
    assert {(31, 119, 180), (255, 127, 14), (44, 160, 44)} <= colors
    assert not (runs[0].parent / "report.md").exists()  # --out wins over the default


def test_report_single_run_goes_next_to_it(tmp_path):
    run = make_run(tmp_path / "runs" / "only", CPU_METRICS, None)  # no log_history.json: still a report
    run_comparison.write_report([run])
    assert (tmp_path / "runs" / "report.md").is_file() and (tmp_path / "runs" / "loss.png").is_file()
    assert not (run / "report.md").exists()


def cli(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("module", ["fsdp_recipes.metrics.run_comparison", "fsdp_recipes.metrics.prometheus"])
def test_a_directory_without_metrics_is_one_error_line(runs, tmp_path, module):
    not_a_run = tmp_path / "runs" / "half-written"
    not_a_run.mkdir()
    (not_a_run / "run_args.json").write_text("{}")
    out = cli(module, runs[0], not_a_run, "--out", tmp_path / "out.prom")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    assert f"{not_a_run} has no metrics.json" in out.stderr
    assert not (tmp_path / "runs" / "report.md").exists() and not (tmp_path / "out.prom").exists()


def test_corrupt_metrics_is_one_error_line(runs):
    (runs[1] / "metrics.json").write_text('{"status": "comp')
    out = cli("fsdp_recipes.metrics.run_comparison", *runs)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {runs[1] / 'metrics.json'} is not valid JSON")
    assert "Traceback" not in out.stderr


def parse_textfile(path: Path) -> dict[str, dict[str, tuple[dict, float]]]:
    """{family: {run: (labels, value)}} through prometheus_client's own parser, which raises on bad syntax."""
    parser = need_module("prometheus_client.parser")
    families = {}
    for family in parser.text_string_to_metric_families(path.read_text()):
        assert family.name not in families, f"{family.name} appears twice"  # the Go parser refuses that
        assert family.type == "gauge", family
        samples = {s.labels["run"]: (s.labels, s.value) for s in family.samples}
        assert len(samples) == len(family.samples), "two samples with the same run label"
        families[family.name] = samples
    return families


def test_write_textfile_one_run(runs):
    path = prometheus.write_textfile(GPU_METRICS, runs[0] / "metrics.prom")
    families = parse_textfile(path)
    labels = {"recipe": "mistral-7b-full", "run": "gpu-full", "output_dir": str(runs[0].resolve()),
              "device": "NVIDIA H100 80GB HBM3", "world_size": "8"}
    assert families == {
        "training_mfu": {"gpu-full": (labels, 0.41234)},
        "training_tokens_per_second": {"gpu-full": (labels, 123456.8176)},
        "training_peak_device_memory_bytes": {"gpu-full": (labels, 40 * GIB)},
        "training_peak_host_rss_bytes": {"gpu-full": (labels, 12 * GIB + 512 * MIB)},
        "training_step": {"gpu-full": (labels, 1200)},
        "training_running": {"gpu-full": (labels, 0)},  # status "completed": the report is final
        "training_last_update_timestamp_seconds": {"gpu-full": (labels, 1795258800)},  # finished_at, in Unix time
    }
    assert oct(path.stat().st_mode & 0o777) == "0o644"  # readable by node_exporter's own user
    assert sorted(p.name for p in runs[0].iterdir() if "prom" in p.name) == ["metrics.prom"]  # no temp file left


def test_cpu_run_omits_mfu_and_device_memory_with_a_comment(runs):
    path = prometheus.write_textfile(CPU_METRICS, runs[1] / "metrics.prom")
    text = path.read_text()
    assert set(parse_textfile(path)) == {"training_tokens_per_second", "training_peak_host_rss_bytes", "training_step",
                                         "training_running", "training_last_update_timestamp_seconds"}
    assert f"# training_mfu omitted for run '{runs[1].resolve()}': {CPU_NOTE}\n" in text
    assert f"# training_peak_device_memory_bytes omitted for run '{runs[1].resolve()}': CPU run" in text
    assert "nan" not in text.lower() and "HELP training_mfu" not in text  # no NaN, no empty family


def test_cli_collects_several_runs_into_one_file(runs, tmp_path):
    out = cli("fsdp_recipes.metrics.prometheus", *runs, "--out", tmp_path / "textfile" / "fsdp.prom")
    assert out.returncode == 0, out.stderr
    families = parse_textfile(tmp_path / "textfile" / "fsdp.prom")
    assert {run: v for run, (_, v) in families["training_tokens_per_second"].items()} == {
        "gpu-full": 123456.8176, "cpu-lora": 3352.3467, "hsdp": 20480.0}
    assert set(families["training_mfu"]) == {"gpu-full", "hsdp"}  # the CPU run has none
    assert families["training_peak_host_rss_bytes"]["hsdp"][0] == {
        "recipe": "mistral-large-hsdp", "run": "hsdp", "output_dir": str(runs[2].resolve()),
        "device": "NVIDIA H100 80GB HBM3", "world_size": "16"}

    # Two users' runs of one recipe share the directory name (the default output_dir is runs/<recipe>): the
    # output_dir label keeps their series apart, where the same labels twice would break node_exporter's gather.
    twin = make_run(tmp_path / "other" / "gpu-full", GPU_METRICS, None)
    out = cli("fsdp_recipes.metrics.prometheus", runs[0], twin, "--out", tmp_path / "twins.prom")
    assert out.returncode == 0, out.stderr
    parser = need_module("prometheus_client.parser")
    samples = [s for f in parser.text_string_to_metric_families((tmp_path / "twins.prom").read_text())
               for s in f.samples if s.name == "training_mfu"]
    assert sorted(s.labels["output_dir"] for s in samples) == sorted([str(runs[0].resolve()), str(twin.resolve())])
    out = cli("fsdp_recipes.metrics.prometheus", runs[0], runs[0], "--out", tmp_path / "same.prom")
    assert out.returncode == 2 and out.stderr.startswith(f"error: {runs[0]} is given twice"), out.stderr


def test_label_values_are_escaped(tmp_path):
    odd = {**GPU_METRICS, "recipe": 'say "hi"', "device": {"name": "back\\slash\nnewline"}}
    families = parse_textfile(prometheus.write_textfile(odd, tmp_path / "odd-run" / "metrics.prom"))
    labels, _ = families["training_mfu"]["odd-run"]
    assert (labels["recipe"], labels["device"]) == ('say "hi"', "back\\slash\nnewline")


# ------------------------------------------------------------------ the example alert rules


def test_alert_rules_structure_and_promql():
    # Prometheus's own promtool checks and unit-tests the rules in tests/test_gates.py. Here: the YAML style, the
    # rule-group structure Prometheus expects, every `for` as a Prometheus duration, and every expression through
    # promql-parser (a Rust port of Prometheus's parser that also checks function argument types).
    promql = need_module("promql_parser")
    path = REPO / "monitoring" / "alerts.yaml"
    lint = subprocess.run([str(Path(sys.executable).parent / "yamllint"), "-c", str(REPO / ".yamllint"), "--strict",
                           str(path)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout

    doc = yaml.safe_load(path.read_text())
    assert list(doc) == ["groups"] and len(doc["groups"]) == 1
    group = doc["groups"][0]
    assert set(group) == {"name", "rules"} and group["name"]
    rules = {r["alert"]: r for r in group["rules"]}
    assert set(rules) == {"TrainingMFUDrop", "TrainingThroughputStalled", "TrainingStalled"}
    gauges = {name for name, *_ in prometheus.GAUGES}
    for rule in rules.values():
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
        assert promql.parse_duration(rule["for"]).total_seconds() >= 600
        names = []
        promql.walk(promql.parse(rule["expr"]),
                    pre_visit=lambda n: names.append(n.name) if isinstance(n, promql.VectorSelector) else None)
        assert names and set(names) <= gauges, names  # only metrics that prometheus.py writes

    # The MFU rule is what it says: current < 0.8 x the 1 h average ending 10 min ago, held for 15 min.
    expr = promql.parse(rules["TrainingMFUDrop"]["expr"])
    assert (str(expr.op), expr.lhs.name, str(expr.rhs.op), expr.rhs.lhs.val) == ("<", "training_mfu", "*", 0.8)
    window = expr.rhs.rhs.args[0]
    assert expr.rhs.rhs.func.name == "avg_over_time" and window.vector_selector.name == "training_mfu"
    assert (window.range.total_seconds(), window.vector_selector.offset.total_seconds()) == (3600, 600)
    assert rules["TrainingMFUDrop"]["for"] == "15m"

    # The stall rule's value is the age of the last training log (what its description prints), kept only for
    # series whose run still says it is training.
    expr = promql.parse(rules["TrainingStalled"]["expr"])
    assert str(expr.op) == "and" and str(expr.lhs.op) == ">" and expr.lhs.rhs.val == 1800
    assert expr.lhs.lhs.lhs.func.name == "time" and expr.lhs.lhs.rhs.name == "training_last_update_timestamp_seconds"
    assert (expr.rhs.lhs.name, str(expr.rhs.op), expr.rhs.rhs.val) == ("training_running", "==", 1)

    with pytest.raises(ValueError):  # the parser does reject what promtool would: a range function on a vector
        promql.parse("training_mfu < 0.8 * avg_over_time(training_mfu offset 10m)")


# The summary's `eval` section as launch/summary.py writes it into metrics.json (evaluation/scoring.py eval_section):
# the held-out loss of the reference answers and the exact match with its Wilson interval.
EVAL_SECTION = {
    "prompts": 100, "held_out": True, "base_correct": 0, "trained_correct": 93,
    "held_out_loss": {"rows": 100, "tokens": 457, "base": 2.727, "trained": 0.0556},
    "stages": [{"stage": "base", "correct": 0, "n": 100, "wilson95": [0.0, 0.037]},
               {"stage": "sft", "correct": 93, "n": 100, "wilson95": [0.863, 0.966]}],
}


def test_report_shows_the_summarys_held_out_loss_and_exact_match_where_recorded(tmp_path):
    """Both trial runs had an `eval` section; the table showed only TRL's final eval loss (2026-11-29)."""
    root = tmp_path / "runs"
    scored = make_run(root / "scored", {**CPU_METRICS, "eval": EVAL_SECTION}, None)
    long_answers = make_run(root / "long", {**CPU_METRICS, "eval": {
        **EVAL_SECTION, "trained_correct": None, "base_correct": None,
        "stages": [{"stage": "base", "correct": None}, {"stage": "sft", "correct": None}]}}, None)
    unscored = make_run(root / "unscored", CPU_METRICS, None)  # generations skipped: no `eval`
    run_comparison.write_report([scored, long_answers, unscored])
    text = (root / "report.md").read_text()
    rows = table(text)
    assert (rows["scored"]["held-out answer loss"], rows["scored"]["exact match"]) == ("0.0556", "93/100 (86.3-96.6%)")
    assert (rows["long"]["held-out answer loss"], rows["long"]["exact match"]) == ("0.0556", "n/a")
    assert (rows["unscored"]["held-out answer loss"], rows["unscored"]["exact match"]) == ("n/a", "n/a")
    assert rows["scored"]["final eval loss"] == "0.0247"  # TRL's, beside it, and said which tokens each counts
    assert "Final eval loss: TRL's" in text and "the reference answers' tokens alone" in text


def test_report_says_what_it_replaced(runs, capsys):
    """`make report` twice into one folder replaced report.md and the plots without a word (2026-11-29)."""
    run_comparison.write_report(runs)
    assert "replacing" not in capsys.readouterr().out
    run_comparison.write_report(runs)
    said = [line for line in capsys.readouterr().out.splitlines() if "replacing" in line]
    assert said == [f"[report] replacing the earlier report.md, loss.png, throughput.png, memory.png in "
                    f"{runs[0].parent}"]


@pytest.mark.parametrize("case", ["file", "folder-of-runs", "missing"])
def test_a_path_that_is_not_a_run_says_what_it_is(runs, case):
    """`prometheus runs/*` said `run directory runs/loss.png does not exist` of a file, and runs/smoke (a folder of
    runs) `has no metrics.json` (2026-11-29)."""
    root = runs[0].parent
    path = {"file": root / "loss.png", "folder-of-runs": root / "nightly", "missing": root / "nowhere"}[case]
    if case == "file":
        path.write_bytes(b"png")
    with pytest.raises(UserError) as err:
        run_comparison.load_metrics(path)
    said = str(err.value)
    assert "\n" not in said
    assert said.startswith({
        "file": f"{path} is a file, not a run's folder. Fix: ",
        "folder-of-runs": f"{path} is a folder of 1 run(s) ({root / 'nightly' / 'hsdp'}), not a run itself "
                          f"(no metrics.json). Fix: pass its runs ({path}/*), or leave it out.",
        "missing": f"run directory {path} does not exist. Fix: ",
    }[case]), said


def test_prometheus_over_a_glob_skips_files_and_folders_of_runs_with_a_line_each(runs, tmp_path, capsys):
    """docs/monitoring.md's `fsdp-recipes prometheus runs/* --out ...` once runs/ holds report.md and a folder of
    runs: those are skipped, each said; the runs are written."""
    root = runs[0].parent
    (root / "report.md").write_text("earlier report")
    out = tmp_path / "all.prom"
    assert prometheus.main([*map(str, sorted(root.iterdir())), "--out", str(out)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[:2] == [f"[prometheus] skipped {root / 'nightly'} is a folder of 1 run(s) ({root / 'nightly' / 'hsdp'}),"
                        f" not a run itself (no metrics.json); its runs: {root / 'nightly'}/*",
                        f"[prometheus] skipped {root / 'report.md'} is a file, not a run's folder"]
    assert said[2].startswith("[prometheus] 2 run(s) -> ")
    text = out.read_text()
    assert "gpu-full" in text and "cpu-lora" in text
    with pytest.raises(SystemExit) as code:  # nothing left: one line
        prometheus.main([str(root / "report.md"), "--out", str(out)])
    assert code.value.code == 2
