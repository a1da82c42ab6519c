"""Benchmark: FSDP against DDP and one process, the same training measured per rank.

    python -m bench.compare            # make compare: the real SmolLM2-135M, full fine-tuning, ~10 minutes on 2 cores
    python -m bench.compare --tiny     # the tiny assets' model: the machinery in seconds (tests/test_bench.py)

The Slurm design's promise: per-device memory well below DDP's, throughput similar or a little lower, the same
losses. Every variant runs the default recipe's model and data (recipes/smollm2-135m-lora, its own launch path:
`python -m fsdp_recipes.launch.launcher <folder>`), as **full fine-tuning** (LoRA's gradients and optimizer states are
too small to show a difference), with the same global batch, steps, seed, learning rate and data, under:

- `single`: one process, no distribution;
- `ddp`: DDP over 2 processes (accelerate's MULTI_GPU, on CPU its MULTI_CPU);
- `fsdp2-full-shard`, `fsdp2-shard-grad-op`: FSDP2 over 2 processes, resharding after forward or not;
- `fsdp1-full-shard`: FSDP1 FULL_SHARD over 2 processes (accelerate_configs/fsdp1_1node.yaml's settings);
- `hsdp` (with --hsdp): 2 replicas x 2 shards, 4 processes. On the 2-core machine 4 processes share 2 cores, so
  its memory compares and its speed does not; it is left out by default for that reason.

Measured per rank, not estimated:
- memory by the planner's components: weights, gradients, optimizer states (tensor bytes of the local shards) and
  the tensors autograd saved in the first step (`measure_memory`, metrics/memory_probe.py), the peak RSS
  (`ru_maxrss`), next to `make plan`'s estimate of each (planning/memory_budget.py, at the measured tokens per
  micro-batch) and its error;
- bytes moved by collectives per optimizer step: every `torch.distributed` all-gather, reduce-scatter, all-reduce
  and broadcast a rank calls inside `Trainer.training_step`, counted by a probe (a generated sitecustomize.py);
  DDP's gradient all-reduce reaches Python through torch's default `allreduce_hook`, registered by the probe (the
  reducer's built-in C++ hook does the same arithmetic). Payload = the full tensor (NCCL's convention); bytes sent
  per rank = the ring factor x payload, as planning/comms.py estimates them;
- time per step and tokens/s (metrics.json: `train_time_s`, `tokens_per_second`), and the per-step losses.

Results: bench/results/compare-<date>T<HHMM>Z.json, .md (the table and the three expectations checked in words) and
.png (memory per rank by component beside tokens/s).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fsdp_recipes.api import device_info, file_stamp, now_iso, versions, write_json_atomic

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / "recipes" / "smollm2-135m-lora"
TINY = REPO / "recipes" / "tiny-cpu-lora"
FSDP1 = REPO / "accelerate_configs" / "fsdp1_1node.yaml"
COMPONENTS = ("weights", "gradients", "optimizer_states", "activations")
LOSS_RTOL = 1e-3  # the same math in float32: only the order of the reductions differs between strategies

PROBE = '''
import os
import sys

# first the sitecustomize this one shadows, if any (the environment's own, a test harness's): both run, as alone
_here = os.path.dirname(os.path.abspath(__file__))
for _folder in sys.path:
    _other = os.path.join(_folder or os.getcwd(), "sitecustomize.py")
    if os.path.isfile(_other) and os.path.dirname(os.path.abspath(_other)) != _here:
        with open(_other) as _f:
            exec(compile(_f.read(), _other, "exec"), {"__name__": "sitecustomize", "__file__": _other})
        break
# a training process: torchrun's ranks have RANK; a single process started by `accelerate launch` has accelerate's
# environment instead (the launcher and accelerate's own process have neither)
if os.environ.get("COMPARE_PROBE") and ("RANK" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ):
    import atexit, json, resource
    import torch.distributed as dist
    _counts, _state = {}, {"in_step": 0, "steps": 0}
    # name: (op, index and keyword of the full tensor)
    # FSDP1 on CPU gathers into a list (torch 2.13's _flat_param.py: "HACK this should be handled by C10D")
    _OPS = {"all_gather_single": ("all-gather", 0, "output_tensor"), "all_gather": ("all-gather", 0, "tensor_list"),
            "reduce_scatter_single": ("reduce-scatter", 1, "input"),
            "all_reduce": ("all-reduce", 0, "tensor"), "broadcast": ("broadcast", 0, "tensor")}

    def _wrap(name, op, index, keyword):
        original = getattr(dist, name)
        def counted(*args, **kwargs):
            t = args[index] if len(args) > index else kwargs[keyword]
            size = sum(x.numel() * x.element_size() for x in t) if isinstance(t, list) else t.numel() * t.element_size()
            group = kwargs.get("group", args[3] if name in ("reduce_scatter_single", "broadcast") and len(args) > 3
                               else args[2] if name in ("all_gather_single", "all_gather") and len(args) > 2
                               else None)
            key = f"{op}/{dist.get_world_size(group)}/{'step' if _state['in_step'] else 'outside'}"
            c = _counts.setdefault(key, {"calls": 0, "payload": 0})
            c["calls"] += 1
            c["payload"] += size
            return original(*args, **kwargs)
        setattr(dist, name, counted)

    for _name, (_op, _index, _keyword) in _OPS.items():
        _wrap(_name, _op, _index, _keyword)

    import torch.nn.parallel as _parallel
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as _hooks
    _ddp_init = _parallel.DistributedDataParallel.__init__
    def _ddp_init_counted(self, *args, **kwargs):
        _ddp_init(self, *args, **kwargs)
        self.register_comm_hook(None, _hooks.allreduce_hook)  # the reducer's all-reduce, through dist.all_reduce
    _parallel.DistributedDataParallel.__init__ = _ddp_init_counted

    import transformers
    _training_step = transformers.Trainer.training_step
    def _counted_step(self, *args, **kwargs):
        _state["in_step"] += 1
        try:
            return _training_step(self, *args, **kwargs)
        finally:
            _state["in_step"] -= 1
            _state["steps"] += 1
    transformers.Trainer.training_step = _counted_step

    def _dump():
        with open(f"{os.environ['COMPARE_PROBE']}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
            json.dump({"collectives": _counts, "micro_batches": _state["steps"],
                       "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)
    atexit.register(_dump)
'''


@dataclass
class Variant:
    name: str
    processes: int
    strategy: str  # the planner's: single | DDP | FSDP | HSDP
    shard: int
    fsdp_version: int = 0
    reshard_after_forward: bool = True
    accelerate: dict = field(default_factory=dict)


def variants(base: dict, layer_cls: str, hsdp: bool, n: int = 2) -> list[Variant]:
    """Accelerate YAMLs for each strategy, derived from the default recipe's (FSDP2), on `n` processes (HSDP: 2
    replicas of max(n, 4) / 2 shards)."""
    plain = {k: v for k, v in base.items() if k not in ("fsdp_config", "parallelism_config")}
    fsdp2 = lambda reshard: {**base, "num_processes": n, "fsdp_config": {  # noqa: E731
        **base["fsdp_config"], "fsdp_reshard_after_forward": reshard}}
    fsdp1 = copy.deepcopy(yaml.safe_load(FSDP1.read_text()))
    fsdp1.update(num_processes=n, mixed_precision=base.get("mixed_precision", "no"))
    fsdp1["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = layer_cls
    out = [
        Variant("single", 1, "single", 1, accelerate={**plain, "distributed_type": "NO", "num_processes": 1}),
        Variant("ddp", n, "DDP", 1, accelerate={**plain, "distributed_type": "MULTI_GPU", "num_processes": n}),
        Variant("fsdp2-full-shard", n, "FSDP", n, 2, True, fsdp2(True)),
        Variant("fsdp2-shard-grad-op", n, "FSDP", n, 2, False, fsdp2(False)),
        Variant("fsdp1-full-shard", n, "FSDP", n, 1, True, fsdp1),
    ]
    if hsdp:
        world = max(n, 4)
        out.append(Variant("hsdp", world, "HSDP", world // 2, 2, True, {
            **fsdp2(True), "num_processes": world, "parallelism_config": {
                "parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": world // 2}}))
    return out


def recipe_copy(source: Path, v: Variant, work: Path) -> Path:
    folder = work / f"recipe-{v.name}"
    shutil.copytree(source, folder)
    (folder / "accelerate.yaml").write_text(yaml.safe_dump(v.accelerate, sort_keys=False))
    return folder


def run(v: Variant, source: Path, work: Path, steps: int, global_batch: int, extra: list[str]) -> dict:
    """One launch of the recipe under `v`; what it measured."""
    folder, out = recipe_copy(source, v, work), work / f"run-{v.name}"
    probe = work / f"probe-{v.name}"
    args = [sys.executable, "-m", "fsdp_recipes.launch.launcher", str(folder), "--output_dir", str(out),
            "--use_peft", "false", "--max_steps", str(steps), "--per_device_train_batch_size",
            str(global_batch // v.processes), "--gradient_accumulation_steps", "1", "--logging_steps", "1",
            "--warmup_steps", "0", "--eval_strategy", "no", "--save_strategy", "no", "--save_merged_model", "false",
            "--measure_memory", "true", "--report_to", "none", "--seed", "42", *extra]
    env = dict(os.environ, COMPARE_PROBE=str(probe), PYTHONPATH=f"{work}:{os.environ.get('PYTHONPATH', '')}",
               FSDP_RECIPES_SUMMARY_GENERATIONS="0")
    print(f"[compare] {v.name}: {v.processes} process(es), {global_batch // v.processes} sequences each", flush=True)
    t0 = time.time()
    log = work / f"{v.name}.log"
    with open(log, "w") as f:
        rc = subprocess.call(args, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-5:])
        sys.exit(f"[compare] {v.name} failed (exit {rc}); the end of its log, {log}:\n{tail}")
    m = json.loads((out / "metrics.json").read_text())
    history = json.loads((out / "log_history.json").read_text())["log_history"]
    ranks = []
    for r in range(v.processes):
        measured = json.loads((out / f"memory_probe.rank{r}.json").read_text())
        probed = json.loads(Path(f"{probe}.rank{r}.json").read_text())
        ranks.append({**{k: measured[k] for k in COMPONENTS}, "tokens_per_micro_batch": measured.get(
            "tokens_per_micro_batch"), "peak_rss_bytes": probed["peak_rss_bytes"],
                      "collectives_per_step": per_step(probed["collectives"], probed["micro_batches"])})
    return {"variant": v.name, "strategy": v.strategy, "processes": v.processes, "shard": v.shard,
            "fsdp_version": v.fsdp_version, "reshard_after_forward": v.reshard_after_forward,
            "sharding_strategy": m.get("sharding_strategy"), "steps": m["steps"], "train_time_s": m["train_time_s"],
            "step_time_s": m["train_time_s"] / m["steps"], "tokens_per_second": m["tokens_per_second"],
            "tokens": m["tokens"], "losses": [h["loss"] for h in history if "loss" in h], "ranks": ranks,
            "wall_s": round(time.time() - t0, 1)}


def per_step(collectives: dict, micro_batches: int) -> dict:
    """Inside training_step, per optimizer step (one micro-batch per step here): {op: payload, sent per rank}."""
    from fsdp_recipes.api import ring_bytes

    out: dict[str, dict] = {}
    for key, c in collectives.items():
        op, group, where = key.split("/")
        if where != "step" or not micro_batches:
            continue
        payload = c["payload"] / micro_batches
        entry = out.setdefault(op, {"group": int(group), "calls": 0.0, "payload": 0.0, "sent": 0.0})
        entry["calls"] += c["calls"] / micro_batches
        entry["payload"] += payload
        entry["sent"] += ring_bytes(op, int(group), int(payload)) if op != "broadcast" else payload
    return out


def planned(v: Variant, cfg, shape, tokens: int) -> dict:
    """make plan's figures for this variant: memory per rank by component at `tokens` per micro-batch, and the
    collectives' payload per step."""
    from fsdp_recipes.api import Setup, Topology, Work, budget, estimate_comms

    setup = Setup(shard=v.shard, world=v.processes, strategy=v.strategy, load_bytes=4, compute_bytes=4,
                  mixed_precision=False, tokens=tokens, reference="none",
                  checkpointed=False, optimizer_bytes=8, runtime_bytes=0)
    memory = budget(shape, setup)
    topology = Topology(v.strategy, v.processes, 1, v.shard, v.fsdp_version or 2, v.reshard_after_forward)
    work = Work(accumulation=1, micro_batch=1, max_length=tokens, gather_bytes=4, reduce_bytes=4)
    from fsdp_recipes.api import fabric

    estimate = estimate_comms(shape, topology, work, fabric("H100"))  # payloads do not depend on the fabric
    return {"memory": {k: memory[k] for k in COMPONENTS}, "collectives": {
        c.op: {"group": c.group, "payload": c.payload, "sent": c.sent} for c in estimate.collectives}}


def model_shape(source: Path, cfg_args: list[str]):
    """The planner's ModelShape of the recipe's model, full fine-tuning (a meta-device copy, as make plan builds)."""
    from fsdp_recipes.api import model_shape, plan_recipe

    _, _, cfg, model = plan_recipe(str(source), overrides=["--use_peft", "false", *cfg_args])
    return cfg, model_shape(model, cfg.model)


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def error(measured: float, planned: float) -> str:
    return f"{(planned - measured) / measured:+.0%}" if measured else "n/a"


def table(rows: list[dict]) -> str:
    head = ("| variant | rank | weights MiB (plan, error) | gradients | optimizer states | activations | "
            "peak RSS MiB | step s | tokens/s | collectives per step: payload MiB (plan), sent per rank MiB |")
    out = [head, "|---|---:|---|---|---|---|---:|---:|---:|---|"]
    for row in rows:
        for r, rank in enumerate(row["ranks"]):
            cells = [f"{mib(rank[k])} ({mib(row['planned']['memory'][k])}, "
                     f"{error(rank[k], row['planned']['memory'][k])})" for k in COMPONENTS]
            comm = "; ".join(
                f"{op} x{c['calls']:g} over {c['group']}: {mib(c['payload'])} "
                f"({mib(row['planned']['collectives'].get(op, {}).get('payload', 0))}), {mib(c['sent'])}"
                for op, c in sorted(rank["collectives_per_step"].items())) or "none"
            out.append(f"| {row['variant']} | {r} | {' | '.join(cells)} | {mib(rank['peak_rss_bytes'])} | "
                       f"{row['step_time_s']:.2f} | {row['tokens_per_second']:,.0f} | {comm} |")
    return "\n".join(out)


def states(row: dict) -> float:
    """Rank 0's weights + gradients + optimizer states: what sharding divides."""
    r = row["ranks"][0]
    return r["weights"] + r["gradients"] + r["optimizer_states"]


def expectations(rows: list[dict]) -> list[str]:
    """The design's three expectations, checked in words against what was measured, whatever the outcome."""
    by = {r["variant"]: r for r in rows}
    ddp, lines = by.get("ddp"), []
    fsdp = [r for r in rows if r["strategy"] in ("FSDP", "HSDP")]
    if ddp:
        for r in fsdp:
            ratio = states(r) / states(ddp)
            lines.append(f"- Memory, {r['variant']} against DDP: weights + gradients + optimizer states on rank 0 are "
                         f"{ratio:.2f}x DDP's ({mib(states(r))} vs {mib(states(ddp))} MiB); peak RSS "
                         f"{r['ranks'][0]['peak_rss_bytes'] / ddp['ranks'][0]['peak_rss_bytes']:.2f}x. "
                         f"{'Holds' if ratio < 0.75 else 'Does not hold'} (much lower: below 0.75x).")
        for r in fsdp:
            ratio = r["tokens_per_second"] / ddp["tokens_per_second"]
            lines.append(f"- Throughput, {r['variant']} against DDP: {ratio:.2f}x DDP's tokens/s "
                         f"({r['tokens_per_second']:,.0f} vs {ddp['tokens_per_second']:,.0f}). "
                         f"{'Holds' if 0.8 <= ratio <= 1.1 else 'Does not hold'} (similar or a little lower: "
                         f"0.8x to 1.1x){'; 4 processes on 2 cores' if r['processes'] > 2 else ''}.")
    base = by.get("single") or rows[0]
    worst = max((abs(a - b) / abs(b), r["variant"], step + 1) for r in rows
                for step, (a, b) in enumerate(zip(r["losses"], base["losses"])))
    lines.append(f"- Equal losses: the largest relative difference from {base['variant']}'s per-step loss is "
                 f"{worst[0]:.2e} ({worst[1]}, step {worst[2]}). {'Holds' if worst[0] <= LOSS_RTOL else 'Does not hold'}"
                 f" (tolerance {LOSS_RTOL:g}: the same math in float32, reductions in another order).")
    return lines


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, speed) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    names = [r["variant"] for r in rows]
    bottom = [0.0] * len(rows)
    for k in COMPONENTS:
        values = [r["ranks"][0][k] / 2**20 for r in rows]
        mem.bar(names, values, bottom=bottom, label=k.replace("_", " "))
        bottom = [a + b for a, b in zip(bottom, values)]
    mem.scatter(names, [r["planned"]["memory"]["weights"] / 2**20 + r["planned"]["memory"]["gradients"] / 2**20
                        + r["planned"]["memory"]["optimizer_states"] / 2**20
                        + r["planned"]["memory"]["activations"] / 2**20 for r in rows],
                marker="_", s=600, color="black", label="make plan's estimate (sum)", zorder=3)
    mem.set_ylabel("MiB on rank 0")
    mem.set_title("memory per rank by component (measured)")
    mem.legend(fontsize=8)
    mem.tick_params(axis="x", rotation=20)
    speed.bar(names, [r["tokens_per_second"] for r in rows], color="tab:gray")
    speed.set_title("tokens/s (all ranks)")
    speed.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny assets' model: the machinery in seconds")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per variant (default: 30; --tiny 2)")
    ap.add_argument("--global-batch", type=int, default=4, help="sequences per optimizer step, over all processes")
    ap.add_argument("--variants", default="", help="comma-separated names (default: all but hsdp)")
    ap.add_argument("--hsdp", action="store_true", help="also HSDP, 2 replicas x 2 shards (4 processes)")
    ap.add_argument("--processes", type=int, default=2,
                    help="processes of the distributed variants (8 on a node of 8 GPUs: --processes 8 "
                         "--global-batch 16 --hsdp)")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    source = TINY if args.tiny else DEFAULT
    steps = args.steps or (2 if args.tiny else 30)
    base = yaml.safe_load((source / "accelerate.yaml").read_text())
    # float32 everywhere, on GPUs too: the comparison's losses are exact and the planner's widths are the measured ones
    extra = (["--use_cpu", "true"] if not _gpus() else []) + ["--bf16", "false"]
    extra += ["--learning_rate", "1e-4" if args.tiny else "1e-5"]
    cfg, shape = model_shape(source, extra)
    gpus = _gpus()
    chosen = variants(base, base["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"], args.hsdp, args.processes)
    if gpus:  # one process per GPU: on fewer GPUs than a variant's processes it runs on those (world-size-1 rows)
        chosen = [v for v in chosen if v.strategy != "HSDP" or gpus >= v.processes]
        for v in chosen:
            v.processes = v.accelerate["num_processes"] = min(v.processes, gpus)
            v.shard = min(v.shard, v.processes)
    if args.variants:
        wanted = args.variants.split(",")
        chosen = [v for v in chosen if v.name in wanted]
    work = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    (work / "sitecustomize.py").write_text(PROBE)
    rows = []
    for v in chosen:
        row = run(v, source, work, steps, args.global_batch, extra)
        row["planned"] = planned(v, cfg, shape, row["ranks"][0]["tokens_per_micro_batch"] or 1)
        rows.append(row)
    result = {"benchmark": "compare", "date": now_iso(), "host": platform.node(), "cpu": device_info()["name"],
              "cpu_count": os.cpu_count(), "versions": versions(), "model": str(cfg.model.model_name_or_path),
              "method": "full fine-tuning", "steps": steps, "global_batch": args.global_batch, "rows": rows,
              "expectations": expectations(rows)}
    stem = args.results / f"compare-{'tiny-' if args.tiny else ''}{file_stamp(result['date'])}"
    args.results.mkdir(parents=True, exist_ok=True)
    write_json_atomic(stem.with_suffix(".json"), result)
    text = (f"# FSDP against DDP and one process, {result['date']}\n\n{result['cpu']}, {os.cpu_count()} cores; "
            f"{result['model']}, full fine-tuning, {steps} steps of {args.global_batch} sequences; versions: "
            f"{', '.join(f'{k} {v}' for k, v in result['versions'].items())}.\n\nMeasured per rank; in brackets "
            f"`make plan`'s estimate and its error.\n\n{table(rows)}\n\n" + "\n".join(result["expectations"]) + "\n")
    stem.with_suffix(".md").write_text(text)
    figure(rows, stem.with_suffix(".png"))
    print(text)
    print(f"[compare] written to {stem}.json, .md, .png (work folder {work})")
    return 0


def _gpus() -> int:
    from fsdp_recipes.api import gpus_here

    return gpus_here()


if __name__ == "__main__":
    sys.exit(main())
