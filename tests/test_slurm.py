"""slurm/*.sbatch against a real Slurm: a throw-away cluster of 3 slurmd nodes on 127.0.0.1 (tests/slurm_cluster.py).

Each test submits the sbatch files as a user would (sbatch, the #SBATCH headers unchanged, including
--gpus-per-node=8 served by fake GPU devices) on the tiny CPU recipe, polls `scontrol show job`, and checks
the job's state and exit code, the log under slurm-logs/ and the run report (metrics.json).

Slurm comes from Debian (scripts/install_slurm.sh). Without it, or without root, the tests skip with the
reason -- except in CI (CI=true), where they fail: they must never silently not run there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, pack_env, skip_or_fail
from fsdp_recipes.checkpoint import markers as checkpoints
from slurm_cluster import Cluster, missing_tools, wait_for

ONE_NODE, MULTI_NODE = REPO / "slurm" / "fsdp_1node.sbatch", REPO / "slurm" / "fsdp_multinode.sbatch"
QUICK = ["--eval_strategy", "no", "--save_merged_model", "false", "--logging_steps", "5"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_tools()
    reason = (f"Slurm is not installed ({', '.join(missing)} not found). Fix: sudo scripts/install_slurm.sh"
              if missing else
              "needs root: starts munged and slurmd, makes fake GPU device files, edits /etc/hosts"
              if os.geteuid() != 0 else None)
    if reason:
        skip_or_fail(reason)
    c = Cluster(tmp_path_factory.mktemp("slurm"), nodes=3).start()
    yield c
    c.stop()


@pytest.fixture
def submit(cluster, cache_dir, tmp_path):
    """sbatch a script from tmp_path (its slurm-logs/ is there) with RECIPE/ARGS as environment."""
    (tmp_path / "slurm-logs").mkdir()

    def _submit(script, args, *opts, recipe="tiny-cpu-lora", **env):
        job_env = pack_env(cache_dir, RECIPE=recipe, ARGS=shlex.join(args), FSDP_RECIPES_HOME=str(REPO),
                           PYTHON=sys.executable, **env)
        job = cluster.sbatch(script, *opts, cwd=tmp_path, env=job_env)
        log = tmp_path / "slurm-logs" / f"{'fsdp-1node' if script == ONE_NODE else 'fsdp-multinode'}-{job}.out"
        return job, log

    return _submit


def finished(cluster, job, log, timeout, state="COMPLETED", code="0:0"):
    info = cluster.wait_job(job, timeout)
    # errors="replace": two nodes' progress bars share the log and can split a multi-byte character
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    assert (info["JobState"], info["ExitCode"]) == (state, code), f"{info}\n{text[-4000:]}"
    return info, text


@pytest.mark.slow
def test_one_node(cluster, submit, tmp_path):
    """`RECIPE=llama-3.1-8b-lora-dpo sbatch slurm/fsdp_1node.sbatch`, as its smoke run (FSDP_RECIPES_SMOKE=1: a tiny
    Llama, synthetic preference pairs): a DPO recipe goes through the same sbatch script and launcher as an SFT one.
    This is also that recipe's smoke test (tests/test_smoke.py leaves it to this one); the SFT recipe tiny-cpu-lora
    runs through Slurm in the tests below."""
    out = tmp_path / "run"
    # --min_gpus 0, as the smoke run sets it: else the sbatch script would start one process per GPU that this test
    # cluster's node advertises (fake ones: 8 CPU processes on 2 cores)
    job, log = submit(ONE_NODE, ["--max_steps", "10", "--eval_strategy", "no", "--save_merged_model", "false",
                                 "--logging_steps", "5", "--min_gpus", "0", "--output_dir", str(out)],
                      recipe="llama-3.1-8b-lora-dpo", FSDP_RECIPES_SMOKE="1")
    info, text = finished(cluster, job, log, 180)
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "completed" and m["steps"] == 10 and m["trainer"] == "dpo"
    assert (m["world_size"], m["num_nodes"]) == (2, 1) and m["sharding_strategy"] == "FULL_SHARD"
    assert m["final_save_check"]["lora_b_checked"] > 0 and m["dpo"]["rewards/accuracies"]["last"] is not None
    assert info["NumNodes"] == "1" and f"[slurm] job {job} on" in text
    assert "== llama-3.1-8b-lora-dpo: completed in" in text  # the pack's summary, in slurm-logs/


@pytest.mark.slow
def test_multinode_two_nodes(cluster, submit, tmp_path):
    """2 nodes x 1 process (a CPU recipe): one launcher per node, joined by the c10d rendezvous."""
    out = tmp_path / "run"
    textfile = tmp_path / "textfile"  # a node_exporter collector directory; the job id is expanded in the job
    textfile.mkdir()
    # LOGLEVEL=INFO: torchrun prints the launch config it really used (run id, rendezvous endpoint, timeouts)
    job, log = submit(MULTI_NODE, ["--max_steps", "10", *QUICK, "--output_dir", str(out),
                                   "--prometheus_textfile", f"{textfile}/fsdp-$SLURM_JOB_ID.prom"], LOGLEVEL="INFO")
    info, text = finished(cluster, job, log, 180)
    (prom,) = textfile.iterdir()  # rank 0 alone writes it, named after the job
    assert prom.name == f"fsdp-{job}.prom"
    assert re.search(r'^training_running\{.*world_size="2"\} 0$', prom.read_text(), flags=re.M), prom.read_text()
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "completed" and m["steps"] == 10
    # torchrun's own output goes to output_dir/logs/launch.log, not the terminal: both nodes' launchers append to it
    launch_log = (out / "logs" / "launch.log").read_text()
    assert len(re.findall(rf"run_id +: {job}\n", launch_log)) == 2, launch_log[-4000:]  # --rdzv_id=$SLURM_JOB_ID
    assert len(re.findall(r"rdzv_endpoint +: fsdpn1:\d+\n", launch_log)) == 2
    assert launch_log.count("'join_timeout': '300'") == 2
    assert "run_id" not in text  # the terminal (the Slurm log) shows the pack's lines and the ranks' output only
    assert (m["world_size"], m["num_nodes"]) == (2, 2)  # num_nodes = WORLD_SIZE / LOCAL_WORLD_SIZE
    assert m["sharding_strategy"] == "FULL_SHARD"  # world 2 = the recipe's shard group: one replica
    assert info["NumNodes"] == "2" and info["NodeList"] == "fsdpn[1-2]"
    for rank in (0, 1):  # both launchers ran, with their machine rank from SLURM_NODEID
        assert f"--machine_rank {rank} --rdzv_conf join_timeout=300,is_host={int(rank == 0)}" in text, text[-4000:]


@pytest.mark.slow
def test_multinode_hsdp(cluster, submit, tmp_path):
    """2 nodes x 2 processes: 2 replicas of the recipe's 2-way sharding, i.e. HSDP."""
    out = tmp_path / "run"
    job, log = submit(MULTI_NODE, ["--max_steps", "10", *QUICK, "--output_dir", str(out)], PROCS_PER_NODE="2")
    finished(cluster, job, log, 240)
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "completed"
    assert (m["world_size"], m["num_nodes"]) == (4, 2)
    assert m["sharding_strategy"] == "HYBRID_SHARD (replicate 2 x shard 2)"


@pytest.mark.slow
def test_preempted_job_requeues_and_resumes(cluster, submit, tmp_path):
    """USR1 to the job's step (what `--signal=USR1@300` sends before the time limit): save, exit 75, requeue, resume.
    The job's command carries --overwrite_output_dir true: the requeue keeps its own run (launch/output_dir.py
    requeued), where it once emptied the checkpoint and started again at step 0."""
    out = tmp_path / "run"
    job, log = submit(MULTI_NODE, ["--max_steps", "30", *QUICK, "--save_strategy", "steps", "--save_steps", "5",
                                   "--output_dir", str(out), "--overwrite_output_dir", "true"])
    wait_for("the first checkpoint", lambda: checkpoints.is_complete(out / "checkpoint-5"), 150, log=log)
    res = subprocess.run(["scancel", "--signal=USR1", str(job)], env=cluster.env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    info, text = finished(cluster, job, log, 240)
    assert info["Restarts"] == "1", info
    assert "preempted: checkpoint saved; requeueing" in text
    assert f"overwrite_output_dir: kept the run that Slurm job {job} left in {out} before its requeue" in text, text
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "completed" and m["steps"] == 30
    assert m["resumed_from"] and m["resumed_from"].startswith(str(out / "checkpoint-")), m
    assert m["resumed_from"] != str(out / "checkpoint-30")  # it resumed mid-run, not after the end


def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    return lines[0]


def test_bad_input_is_one_line(cluster, submit):
    jobs = [
        submit(ONE_NODE, [], recipe="no-such-recipe"),
        submit(MULTI_NODE, [], "--nodes=3"),  # 3 x 1 process cannot hold the recipe's 2-way shard groups
        submit(MULTI_NODE, [], "--nodes=1"),
    ]
    lines = [one_error_line(finished(cluster, job, log, 60, "FAILED", "2:0")[1]) for job, log in jobs]
    assert "unknown recipe 'no-such-recipe'" in lines[0]
    assert "3 nodes x 1 process(es) = 3 is not a multiple of 2" in lines[1]
    assert "got 1 node" in lines[2] and "fsdp_1node.sbatch" in lines[2]
