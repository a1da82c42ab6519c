"""An interrupted run still leaves a run report, saying so."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import BIN, REPO, pack_env
from fsdp_recipes import cpu_fsdp
from fsdp_recipes.errors import UserError

RECIPE = REPO / "recipes" / "tiny-cpu-lora"


@pytest.mark.slow
def test_sigterm_during_training_writes_status_interrupted(tmp_path, cache_dir):
    out = tmp_path / "run"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(RECIPE / "accelerate.yaml"),
           "--main_process_port", "0", "-m", "fsdp_recipes.train_sft", "--config", str(RECIPE / "sft.yaml"),
           "--max_steps", "100000", "--eval_strategy", "no", "--output_dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=pack_env(cache_dir), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not (out / "run_args.json").exists():  # written at on_train_begin
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.5)
    time.sleep(3)  # a few steps in
    proc.send_signal(signal.SIGTERM)  # what a scheduler sends; torchrun forwards it to the ranks
    proc.wait(timeout=120)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "interrupted", metrics
    assert metrics["tokens"]["scope"] == "rank0_only" and metrics["tokens"]["non_padding"] > 0
    assert proc.returncode != 0


def test_cpu_fsdp_adapter_is_inactive_outside_an_fsdp_launch(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert cpu_fsdp.needed() is False and cpu_fsdp.enable() is False


def test_cpu_fsdp_adapter_refuses_fsdp1(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(UserError, match="FSDP1 .* cannot run on CPU"):
        cpu_fsdp.enable()
