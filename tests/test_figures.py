"""A logged or reported figure that is None, NaN or inf never crashes what prints it (issue 61, class 1): the
console's step lines, the end-of-run summary, `make report` and the Prometheus file. A GRPO reward function that
scores no completion makes TRL log None (reward_std, and the reward of that interval); a diverged run logs NaN."""

import copy
import json
import math
import re
import shutil
import subprocess

import pytest

from conftest import skip_or_fail
from fsdp_recipes.launch import summary
from fsdp_recipes.metrics import prometheus, run_comparison
from fsdp_recipes.metrics.figures import figure, percent
from fsdp_recipes.train import console
from test_report import GPU_METRICS, make_run

ODD = {"None": None, "NaN": math.nan, "inf": math.inf, "-inf": -math.inf}
FIELDS = ("loss", "learning_rate", "reward", "tokens_per_second")


def test_figure_says_na_for_what_is_not_a_number_and_nan_or_inf_for_what_is():
    assert [figure(v, ".3f") for v in (None, "x", True, math.nan, math.inf, -math.inf, 1.23456)] == [
        "n/a", "n/a", "n/a", "nan", "inf", "-inf", "1.235"]
    assert figure(1234567, ",") == "1,234,567" and figure(None, ",", missing="-") == "-"
    assert [percent(v) for v in (0.4123, None, math.nan)] == ["41.2%", "n/a", "nan%"]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("odd", ODD)
def test_the_step_line_takes_any_figure_in_any_field(field, odd):
    logs = {"loss": 2.5, "learning_rate": 1e-3, "reward": 0.25, "tokens_per_second": 1500.0, field: ODD[odd]}
    line = console.progress_line(logs, 2, 10)
    shown = {"None": "n/a", "NaN": "nan", "inf": "inf", "-inf": "-inf"}[odd]
    name = {"loss": "loss ", "learning_rate": "lr ", "reward": "reward ", "tokens_per_second": ""}[field]
    assert f"{name}{shown}" in line and line.startswith("[train] step  2/10  loss ")


@pytest.mark.parametrize("odd", ODD)
def test_an_eval_line_and_the_progress_callback_take_any_loss(odd, capsys):
    assert console.progress_line({"eval_loss": ODD[odd]}, 4, 10).startswith("[train] eval at step 4/10: loss ")
    lines = console.ProgressLines(divergence_factor=2.0)

    class State:
        global_step, max_steps, is_world_process_zero = 3, 10, True

    lines.on_log(None, State(), None, logs={"eval_loss": ODD[odd], "eval_runtime": 1.0})  # an eval log: no loss
    assert capsys.readouterr().out.startswith("[train] eval at step 3/10: loss ") and lines.losses == []
    lines.on_log(None, State(), None, logs={"loss": ODD[odd], "reward": None, "reward_std": None})
    out = capsys.readouterr().out
    assert out.startswith("[train] step  3/10  loss ")
    if odd == "None":  # no loss to judge: nothing kept, nothing said about divergence
        assert lines.losses == [] and "DIVERGING" not in out
    else:  # a non-finite loss is said on its line
        assert "DIVERGING: a logged training loss was" in out


def fake_run(tmp_path, **odd):
    run = tmp_path / "run"
    run.mkdir()
    metrics = {"recipe": "grpo-run", "status": "completed", "wall_clock_s": 10.0, "tokens_per_second": 2000.0,
               "tokens_per_second_per_device": 1000.0, "steps": 4, "tokens": {"non_padding": 8000},
               "first_train_loss": 0.5, "final_train_loss": 0.25, "final_eval_loss": 0.3, "mfu": 0.2,
               "peak_flops_source": "(measured)", "peak_memory": {"host_rss_bytes": 2**30},
               "sharding_strategy": "FULL_SHARD", "fsdp_version": 2, "world_size": 2, "num_nodes": 1,
               "device": {"type": "cpu", "name": "CPU"}, **odd}
    (run / "metrics.json").write_text(json.dumps(metrics))
    return run, metrics


@pytest.mark.parametrize("field", ["wall_clock_s", "first_train_loss", "final_train_loss", "final_eval_loss",
                                   "tokens_per_second", "tokens_per_second_per_device", "mfu"])
@pytest.mark.parametrize("odd", ["None", "NaN", "inf"])
def test_the_summary_takes_any_figure(field, odd, tmp_path):
    run, metrics = fake_run(tmp_path, **{field: ODD[odd]})
    if odd != "None":  # as it comes back from metrics.json (NaN and Infinity are what json writes)
        metrics = json.loads((run / "metrics.json").read_text())
    text = summary.render(run, metrics, None)
    assert text.startswith("== grpo-run: completed in ")
    shown = {"None": "n/a", "NaN": "nan", "inf": "inf"}[odd]
    if field == "tokens_per_second" and odd == "None":
        assert "throughput  n/a" in text
    elif field == "first_train_loss" and odd == "None":  # nothing logged: no loss line at all
        assert "\nloss " not in text
    elif field == "final_eval_loss" and odd == "None":  # no eval: the loss line says the train losses only
        assert "loss        0.500 -> 0.250 (train)\n" in text
    else:
        assert shown in text


@pytest.mark.parametrize("odd", ["NaN", "inf"])
def test_make_report_and_prometheus_take_nan_and_inf(odd, tmp_path):
    odd_metrics = {**copy.deepcopy(GPU_METRICS), "mfu": ODD[odd], "tokens_per_second": ODD[odd],
                   "final_train_loss": ODD[odd]}
    runs = [make_run(tmp_path / "runs" / "good", GPU_METRICS, None), make_run(tmp_path / "runs" / "odd", odd_metrics,
                                                                               None)]
    run_comparison.write_report(runs)
    assert (tmp_path / "runs" / "report.md").exists()
    text = prometheus.render({str(r): json.loads((r / "metrics.json").read_text()) for r in runs})
    samples = [line for line in text.splitlines() if line.startswith("training_mfu{")]
    assert len(samples) == 2 and re.search(r" (nan|inf)$", samples[1]), samples
    promtool = shutil.which("promtool")
    if promtool is None:
        skip_or_fail("promtool is not installed (scripts/install_promtool.sh: Debian's prometheus package)")
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert "error" not in (checked.stdout + checked.stderr).lower(), checked.stdout + checked.stderr
