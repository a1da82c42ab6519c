"""Benchmark: host RSS per rank while loading a model (with and without cpu_ram_efficient_loading), and while
saving the final model of a full fine-tuning run (FULL_STATE_DICT gathered on rank 0 vs SHARDED_STATE_DICT
written by every rank; sharded_save.py).

    python -m bench.loading          # make bench-loading

Builds a randomly initialised Mistral of about 400 MB (float32) beside the tiny assets, then runs the default
recipe's real launch path (accelerate launch, 2 processes, FSDP2) for two steps: with
`fsdp_cpu_ram_efficient_loading: false`; with `true` and transformers' own loading on every rank
(FSDP_RECIPES_EMPTY_REPLICAS=0, which reads the whole file on rank 1 too: transformers issue 43749); and with `true`
as the pack runs it (rank 1 builds an empty model, speed/ram_efficient_loading.py). Both runs turn on `verify_loaded_weights`, so every
rank's weights are checked against the file. The figure is each rank's peak RSS once the model is loaded and
sharded, before the first step (`peak_memory.host_rss_at_train_start_bytes_per_rank` in metrics.json).
The final-save part trains the same model for one step under FSDP2, in full and with LoRA, once per state-dict
type, and reads
each rank's anonymous-RSS rise during the save and during its completeness check (`peak_memory.host_rss_rise_final_*` in
metrics.json; sampled every 20 ms by rss_watch.py, so lower bounds).
Results go to bench/results/loading-<date>T<HHMM>Z.json and tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from fsdp_recipes.api import (
    build_tiny_model,
    cache_dir,
    device_info,
    ensure_tiny_assets,
    file_stamp,
    now_iso,
    versions,
    write_json_atomic,
)

BENCH_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=8, head_dim=128)
RECIPE = Path("recipes/tiny-cpu-lora")


def bench_model() -> Path:
    out = cache_dir() / "bench-mistral-400mb"
    if not (out / "model.safetensors").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ensure_tiny_assets()["model"])
        print(f"[bench-loading] building {out}", flush=True)
        build_tiny_model(tok, out, shape=BENCH_SHAPE)
    return out


def launch_variant(model_dir: Path, fsdp_config: dict, work: Path, name: str, extra: list[str]) -> dict:
    """The default recipe's accelerate YAML with `fsdp_config` changes, 2 processes; returns metrics.json."""
    acc = yaml.safe_load((RECIPE / "accelerate.yaml").read_text())
    acc["fsdp_config"].update(fsdp_config)
    acc_path = work / f"accelerate-{name}.yaml"
    acc_path.write_text(yaml.safe_dump(acc))
    out = work / f"run-{name}"
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(acc_path),
           "--main_process_port", "0", "-m", "fsdp_recipes.train.entry", "--config", str(RECIPE / "sft.yaml"),
           "--model_name_or_path", str(model_dir), "--eval_strategy", "no", "--save_strategy", "no",
           "--save_merged_model", "false", "--output_dir", str(out), *extra]
    print(f"[bench-loading] {name}: running 2 processes", flush=True)
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        first_error = next((l for l in log.read_text().splitlines() if "Error:" in l), "see the log")
        sys.exit(f"[bench-loading] the run failed ({first_error.strip()}); full log: {log}")
    return json.loads((out / "metrics.json").read_text())


def run_variant(model_dir: Path, efficient: bool, work: Path, empty_replicas: bool = True) -> dict:
    """empty_replicas=False: transformers' own loading on every rank (FSDP_RECIPES_EMPTY_REPLICAS=0), which reads the
    whole file on every rank (speed/ram_efficient_loading.py)."""
    os.environ["FSDP_RECIPES_EMPTY_REPLICAS"] = "1" if empty_replicas else "0"
    m = launch_variant(model_dir, {"fsdp_cpu_ram_efficient_loading": efficient}, work,
                       f"loading-{efficient}-{empty_replicas}", ["--max_steps", "2", "--verify_loaded_weights", "true"])
    return {
        "cpu_ram_efficient_loading": efficient,
        "empty_replicas": efficient and empty_replicas,
        "rss_at_train_start_bytes_per_rank": m["peak_memory"]["host_rss_at_train_start_bytes_per_rank"],
        "peak_rss_bytes_max_over_ranks": m["peak_memory"]["host_rss_bytes"],
        "load_check": m["load_check"],
        "time_to_first_step_s": m["time_to_first_step_s"],
    }


def run_final_save(model_dir: Path, state_dict_type: str, work: Path, lora: bool = False) -> dict:
    method = ["--learning_rate", "1e-3"] if lora else ["--use_peft", "false", "--learning_rate", "1e-5"]
    m = launch_variant(model_dir, {"fsdp_state_dict_type": state_dict_type}, work,
                       f"save-{'lora' if lora else 'full'}-{state_dict_type}", ["--max_steps", "1", *method])
    return {
        "method": "lora" if lora else "full",
        "state_dict_type": state_dict_type,
        "save_rise_bytes_per_rank": m["peak_memory"]["host_rss_rise_final_save_bytes_per_rank"],
        "check_rise_bytes_per_rank": m["peak_memory"]["host_rss_rise_final_check_bytes_per_rank"],
        "final_save_check": m["final_save_check"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    model_dir = bench_model()
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    work = Path(tempfile.mkdtemp(prefix="bench-loading-"))
    rows = [run_variant(model_dir, False, work), run_variant(model_dir, True, work, empty_replicas=False),
            run_variant(model_dir, True, work)]
    saves = [run_final_save(model_dir, kind, work, lora) for lora in (False, True)
             for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")]
    result = {
        "benchmark": "loading",
        "date": now_iso(),
        "host": platform.node(),
        "cpu": device_info()["name"],
        "versions": versions(),
        "model_file_bytes": size,
        "world_size": 2,
        "runs": rows,
        "final_save": saves,
    }
    path = args.results / f"loading-{file_stamp(result['date'])}.json"
    write_json_atomic(path, result)
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    print(f"\nmodel file {mib(size)}, 2 ranks, FSDP2 on CPU; peak RSS once loaded and sharded:")
    print("| cpu_ram_efficient_loading | ranks but 0 | rank 0 | rank 1 | weights verified |")
    print("|---|---|---|---|---|")
    for r in rows:
        r0, r1 = r["rss_at_train_start_bytes_per_rank"]
        replicas = "empty (speed/ram_efficient_loading.py)" if r["empty_replicas"] else "loaded by transformers"
        print(f"| {str(r['cpu_ram_efficient_loading']).lower()} | {replicas} | {mib(r0)} | {mib(r1)} | "
              f"{r['load_check']['parameters_checked']} parameters |")
    print("\nfinal save (FSDP2, 1 step), anonymous RSS (RssAnon) rise above its level at the "
          "start of each phase:")
    print("| method | state dict | save: rank 0 | save: rank 1 | check: rank 0 | check: rank 1 | tensors verified |")
    print("|---|---|---|---|---|---|---|")
    for r in saves:
        (s0, s1), (c0, c1) = r["save_rise_bytes_per_rank"], r["check_rise_bytes_per_rank"]
        print(f"| {r['method']} | {r['state_dict_type']} | {mib(s0)} | {mib(s1)} | {mib(c0)} | {mib(c1)} | "
              f"{r['final_save_check']['tensors']} |")
    print(f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
