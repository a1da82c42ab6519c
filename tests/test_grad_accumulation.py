"""Gradient accumulation under FSDP2: gradients are reduced once per optimizer step (on the last micro-batch),
and accumulated micro-batches give the same update as one batch of the same samples, and as one process.

The three runs see the same 16 samples per optimizer step: 1 process x 16; 2 ranks x 8; 2 ranks x 4
micro-batches x 2. Plain SGD with a constant learning rate, so equal gradients mean equal weights. The default
recipe trains the LM head through PEFT `modules_to_save`, which needs the pack's workaround (peft_fsdp.py):
without it the 2-rank runs drift from the 1-process run.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import conftest

pytestmark = pytest.mark.slow
PROBES = Path(__file__).resolve().parent / "probes"
COMMON = ["--max_steps", "4", "--optim", "sgd", "--learning_rate", "0.05", "--warmup_steps", "0",
          "--lr_scheduler_type", "constant", "--eval_strategy", "no", "--save_merged_model", "false"]


def recipe_with_processes(tmp_path, n):
    dst = tmp_path / f"recipe-{n}proc"
    if dst.exists():
        return dst
    shutil.copytree(conftest.REPO / "recipes" / "tiny-cpu-lora", dst)
    acc = yaml.safe_load((dst / "accelerate.yaml").read_text())
    acc["num_processes"] = n
    (dst / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    return dst


def run(tmp_path, cache_dir, name, batch, accumulation, processes=2):
    out = tmp_path / name
    counts = tmp_path / f"{name}.reduce_scatters"
    cmd = [sys.executable, "-m", "fsdp_recipes.launch.launcher", str(recipe_with_processes(tmp_path, processes)), *COMMON,
           "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(accumulation),
           "--output_dir", str(out)]
    res = conftest.run(cmd, cache_dir, PYTHONPATH=f"{PROBES}:{os.environ.get('PYTHONPATH', '')}",
                       REDUCE_SCATTER_COUNT_FILE=str(counts))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    per_rank = [int(Path(f"{counts}.{rank}").read_text()) for rank in range(processes)]
    return load_file(out / "adapter_model.safetensors"), per_rank


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), (key, (a[key] - b[key]).abs().max().item())


def test_accumulation_reduces_once_per_step_and_matches_one_big_batch(tmp_path, cache_dir):
    reference, _ = run(tmp_path, cache_dir, "one-process", batch=16, accumulation=1, processes=1)
    big, big_calls = run(tmp_path, cache_dir, "big", batch=8, accumulation=1)
    acc, acc_calls = run(tmp_path, cache_dir, "accumulated", batch=2, accumulation=4)
    # 4 optimizer steps either way: 4x the micro-batches must not mean 4x the reduce-scatters
    assert big_calls[0] > 0 and acc_calls == big_calls, (big_calls, acc_calls)
    assert_same_weights(big, acc)
    assert_same_weights(reference, big)
