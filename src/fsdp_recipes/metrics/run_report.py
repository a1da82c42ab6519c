"""The run report: `run_args.json` and `metrics.json` in every run's output_dir.

A `transformers.TrainerCallback` (the hook transformers gives for exactly this) fed by the token counter
(metrics/tokens.py). Files are written by rank 0 only, atomically (records.write_json_atomic), and also when the
run fails or is interrupted, with a `status` field. The schema is documented in docs/run-report.md.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

import psutil
from transformers import TrainerCallback

from fsdp_recipes import dist
from fsdp_recipes.dist import all_reduce, gather_objects
from fsdp_recipes.metrics import cpu_peak, flops, gates, metrics_file
from fsdp_recipes.metrics.environment import (
    accelerate_env,
    device_info,
    git_commit,
    launcher_env,
    mesh_info,
    sharding_info,
    versions,
)
from fsdp_recipes.metrics.metrics_file import same_run
from fsdp_recipes.metrics.prometheus import write_textfile
from fsdp_recipes.metrics.tokens import COUNTS, TokenCounter
from fsdp_recipes.paths import cache_dir
from fsdp_recipes.records import now_iso, sets_sorted, write_json_atomic

SCHEMA_VERSION = 1
OPTIONAL_LOGS = ("aux_loss",)  # reported only where logged: TRL logs the load-balancing loss of a mixture of experts
COUNTERS_FILE = "run_report_counters.json"  # inside each checkpoint: what a resumed run continues from



def param_shards(model) -> dict:
    """How the parameters are laid out on this rank: evidence that sharding really happened."""
    from torch.distributed.tensor import DTensor

    dtensors = global_numel = local_numel = 0
    for p in model.parameters():
        global_numel += p.numel()
        if isinstance(p, DTensor):
            dtensors += 1
            local_numel += p.to_local().numel()
        else:
            local_numel += p.numel()
    return {"dtensor_params": dtensors, "global_numel": global_numel, "local_numel": local_numel}


def capacity(device: dict) -> dict:
    """What the peaks are judged against (metrics/gates.py): the GPU's total memory, the host's RAM, the ranks on
    this node that share it."""
    import torch

    gpu = device["type"] == "cuda" and torch.cuda.is_available()
    return {"device_total_bytes": torch.cuda.get_device_properties(0).total_memory if gpu else None,
            "host_total_bytes": psutil.virtual_memory().total, "ranks_per_node": device.get("count_per_node")}


def _peak_memory() -> dict:
    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    if torch.cuda.is_available():
        return {
            "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
            "host_rss": rss,
        }
    return {"allocated": -1, "reserved": -1, "host_rss": rss}


class RunReportCallback(TrainerCallback):
    """Writes run_args.json at the start and metrics.json at the end (or on failure) of every run."""

    def __init__(self, output_dir: str, resolved_args: dict, recipe: str | None = None,
                 resume_from: str | Path | None = None, prometheus_textfile: str | None = None,
                 trainer: str | None = None, reported_logs: tuple[str, ...] = (), extra_forwards: dict[str, float] | None = None,
                 loss_falls: bool = True):
        self.output_dir = Path(output_dir)
        # metrics.prom in output_dir, and the collector's file when the recipe names one: rewritten at every
        # training log while the run trains (write_live), and with the whole run's figures at the end.
        self.prom_paths = [self.output_dir / "metrics.prom"]
        if prometheus_textfile:
            self.prom_paths.append(Path(prometheus_textfile))
        self.live_mark = None  # (time, counters_so_far) at the last training log
        self.live_step = None  # the step write_live last ran for: the trainer's log() or on_log, whichever first
        self.resumed_from = str(resume_from) if resume_from else None
        # Counters of the run so far, as saved with the checkpoint this run resumes from.
        self.prior = {**dict.fromkeys(COUNTS, 0), "train_time_s": 0.0}
        if resume_from and (Path(resume_from) / COUNTERS_FILE).is_file():
            saved = json.loads((Path(resume_from) / COUNTERS_FILE).read_text())
            # a checkpoint from before squared_lengths was counted: MFU then falls back to the mean length
            self.prior.update({"squared_lengths": None, **saved})
        self.resolved_args = resolved_args
        self.recipe = recipe
        # the trainer kind (the caller's, else the one the resolved settings name) and its own logs to keep
        self.trainer = trainer or (resolved_args.get("pack_args") or {}).get("trainer")
        self.reported_logs = reported_logs
        # forwards per trained token besides its own (train/kinds: DPO's "reference", GRPO's "generation"), in the FLOPs
        self.extra_forwards = extra_forwards or {}
        self.loss_falls = loss_falls  # False for a kind whose loss is no falling objective (sampling): no divergence test
        self.tokens = TokenCounter()
        self.process_start = psutil.Process().create_time()
        self.started_at = now_iso()
        self.is_main = dist.rank() == 0
        self.train_start = self.train_end = self.first_step_end = None
        self.marks: dict[str, float] = {}  # the rank's start-up, in order (mark): metrics.json startup_s
        self.log_history: list[dict] = []
        self.params: dict[str, int] = {}
        self.model_config = None
        self.shards = None
        self.final_save_check = None  # set by the entry point after verifying the final save
        self.load_check = None  # set by LoadCheckCallback when verify_loaded_weights is on
        self.resume_check = None  # set by ResumeCheckCallback after a resume
        self.tied_embeddings = None  # set by TiedEmbeddingsCheck for a model with tied embeddings
        self.final_save_rss = None  # per rank {"save", "check"}: host-RSS rise, set by train/final_save.py save_final
        self.rss_at_train_start = None
        self.cpu_peak = None  # per rank, on CPU: the measured matmul rate MFU divides by (metrics/cpu_peak.py)
        self.expert_load = None  # a mixture of experts: the router counts (metrics/expert_load.py attach)
        self.finalized = False

    def mark(self, name: str, at: float | None = None) -> None:
        """A point of this rank's start-up (imports done, through the start gate, configured, data loaded, trainer
        built): metrics.json `startup_s` gives each in seconds from the process's creation, with the training's
        start and its first step's end, so that time to the first step reads as phases without a profiler."""
        self.marks.setdefault(name, time.time() if at is None else at)

    def startup(self) -> dict[str, float]:
        points = {**self.marks, "train_begin": self.train_start, "first_step_end": self.first_step_end}
        return {name: round(t - self.process_start, 3) for name, t in points.items() if t is not None}

    # -- trainer hooks ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.train_start = time.time()
        if model is not None:
            self.params = flops.count_params(model)
            self.model_config = getattr(model, "config", None)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            peak = self.measure_cpu_peak()
            shards = gather_objects({**param_shards(model), "rss": rss, "cpu_peak": peak})  # a collective: every rank
            self.rss_at_train_start = [s["rss"] for s in shards]
            if peak is not None:
                self.cpu_peak = [s["cpu_peak"] for s in shards]
                if self.is_main:
                    try:
                        cpu_peak.store(cache_dir(), self.cpu_peak)
                    except OSError as err:  # a read-only or full cache: this run's figure still stands
                        print(f"[train] warning: could not keep the CPU's matmul rate in {cache_dir()} "
                              f"({err.strerror or err}); the next run measures again", file=sys.stderr, flush=True)
            self.shards = {
                "dtensor_params": shards[0]["dtensor_params"],
                "global_numel": shards[0]["global_numel"],
                "local_numel_per_rank": [s["local_numel"] for s in shards],
            }
        if self.is_main:
            write_json_atomic(self.output_dir / "run_args.json", self.run_args())

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step_end is None:
            self.first_step_end = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.log_history = list(state.log_history)
        # A training log (it has the loss) comes at the same step on every rank: the collectives inside are safe.
        # The Trainer's evaluation and end-of-training logs carry no "loss" and are left to finalize.
        # ReportingSFTTrainer.log has already done it for this log (tracker_scalars); a plain Trainer has not.
        if logs and "loss" in logs and self.train_start is not None and self.live_step != state.global_step:
            self.write_live(state.global_step)

    def tracker_scalars(self, step: int) -> dict:
        """The live gauges as scalars for the Trainer's own logs, so TensorBoard, W&B and MLflow (`report_to`) plot
        them beside the loss. Called by ReportingSFTTrainer.log at a training log before the integrations see the
        logs: they run before any callback the pack adds, so on_log would be too late. A collective (write_live):
        every rank calls it; rank 0 gets the figures, the others an empty dict (their logs go to no tracker).
        A figure the run does not have (MFU or device memory on CPU) is left out, not logged as NaN."""
        if self.train_start is None:
            return {}
        live = self.write_live(step)
        if live is None:
            return {}
        gib = 1024 ** 3
        mem = live["peak_memory"]
        scalars = {"tokens_per_second": live["tokens_per_second"], "mfu": live["mfu"],
                   "peak_host_rss_gib": mem["host_rss_bytes"] / gib,
                   "peak_device_memory_gib": None if mem["device_allocated_bytes"] is None
                   else mem["device_allocated_bytes"] / gib}
        return {k: v for k, v in scalars.items() if v is not None}

    def write_live(self, step: int) -> dict | None:
        """The Prometheus gauges over the interval since the last training log (tokens/s and MFU of that interval,
        peaks so far), so that an alert sees a run slow down while it trains.

        Gap it fills: the Trainer logs its own throughput only as an average since train start
        (`include_num_input_tokens_seen`), which hides a slowdown behind the hours before it, and gives no MFU.
        Returns the figures on rank 0 (None on the other ranks, and when no time has passed since the last log)."""
        now = time.time()
        totals, peaks = self.counters_so_far(now), self.peaks_so_far()  # collectives: every rank runs them
        since, before = self.live_mark or (self.train_start, self.prior)
        self.live_mark, self.live_step = (now, totals), step
        if not self.is_main or now <= since:
            return None
        window = {k: None if totals[k] is None or before[k] is None else totals[k] - before[k] for k in COUNTS}
        alloc = peaks["allocated"]
        tps = window["non_padding"] / (now - since)
        world = launcher_env()["world_size"]
        device = device_info()
        live = {
            "recipe": self.recipe,
            "status": "running",
            "steps": step,
            "updated_at": dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(timespec="seconds"),
            "world_size": world,
            "device": {"name": device["name"]},
            "tokens_per_second": tps,
            "peak_memory": {"device_allocated_bytes": None if alloc < 0 else int(alloc),
                            "device_note": "CPU run: no device memory" if alloc < 0 else None,
                            "host_rss_bytes": int(peaks["host_rss"])},
            **self.mfu_figures(window, tps, world, device),
        }
        self.write_prom(live)
        return live

    def write_prom(self, metrics: dict) -> None:
        for path in self.prom_paths:
            try:
                write_textfile(metrics, path, run_dir=self.output_dir)
            except OSError as err:  # monitoring must never stop training; the launcher checked the path
                print(f"[run_report] could not write {path}: {err}", file=sys.stderr, flush=True)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.log_history = list(state.log_history)

    def train_time_until(self, t: float) -> float:
        """Training time of the whole run up to `t`, continued from the checkpoint it resumed from."""
        return self.prior["train_time_s"] + (t - self.train_start)

    def counters_so_far(self, now: float) -> dict:
        """Run totals (all ranks) up to now: a collective, so every rank must call it."""
        counts = self.tokens.counts()
        per_row = mesh_info()["ranks_per_row"]  # a mesh's tp and cp ranks share rows: counted once per dp rank
        summed = [int(v) // per_row for v in all_reduce([counts[k] for k in COUNTS], "sum")]
        return {**{k: None if self.prior[k] is None else v + self.prior[k] for k, v in zip(COUNTS, summed)},
                "train_time_s": self.train_time_until(now)}

    def on_save(self, args, state, control, **kwargs):
        counters = self.counters_so_far(time.time())
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.is_main and ckpt.is_dir():
            write_json_atomic(ckpt / COUNTERS_FILE, counters)

    def on_train_end(self, args, state, control, **kwargs):
        self.train_end = time.time()
        self.log_history = list(state.log_history)
        self.global_step = state.global_step
        # Collectives: every rank is here, so counts and peaks can be combined over ranks.
        self.totals = self.counters_so_far(self.train_end)
        self.peaks = self.peaks_so_far()

    def measure_cpu_peak(self) -> dict | None:
        """On CPU: this rank's dense matmul rate in the run's compute dtype (the best measured on this machine), else None."""
        device = device_info()
        if device["type"] == "cuda":
            return None
        # the compute dtype: the Trainer's bf16 (CPU autocast), accelerate's bf16 mixed precision, or a bf16 model
        bf16 = bool((self.resolved_args.get(f"{self.trainer}_config") or {}).get("bf16")) or \
            os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16" or \
            (self.resolved_args.get("model_args") or {}).get("dtype") == "bfloat16"
        return cpu_peak.best_rate(cache_dir(), device["name"], "bfloat16" if bf16 else "float32",
                                           int(device["count_per_node"]))

    def peaks_so_far(self) -> dict:
        """Peak device memory and host RSS so far, max over ranks: a collective, so every rank must call it."""
        mem = _peak_memory()
        alloc, reserved, rss = all_reduce([mem["allocated"], mem["reserved"], mem["host_rss"]], "max")
        return {"allocated": alloc, "reserved": reserved, "host_rss": rss}

    def mfu_figures(self, tokens: dict, tps: float | None, world: int, device: dict) -> dict:
        """FLOPs per token with attention at the token-weighted mean length sum(n^2) / sum(n) of the sequences in
        `tokens` (useful work: padding and attention across packed sequences count for nothing), and MFU. Counts
        without squared_lengths (a resume from an older checkpoint) fall back to the mean padded length."""
        fpt, seq_len, mfu, mfu_note = None, None, None, None
        if self.model_config is not None and self.params and tokens["sequences"]:
            if tokens.get("squared_lengths") and tokens["non_padding"]:
                seq_len = tokens["squared_lengths"] / tokens["non_padding"]
            else:
                seq_len = tokens["padded"] / tokens["sequences"]
            layers, heads, head_dim = flops.attention_shape(self.model_config)
            # the parameters a token passes through: a mixture of experts' top_k of num_experts (metrics/flops.py)
            trained, frozen = (self.params["trainable_active_non_embedding"], self.params["frozen_active_non_embedding"])
            fpt = flops.flops_per_token(trained, frozen, layers, heads, head_dim, seq_len)
            # the kind's other forwards per trained token, each on the weights flops.extra_forward_weights names: the
            # reference's, GRPO's sampling ("generation": over its prompt and each new token, a KV cache, no token
            # twice), its "old_policy" log-probabilities (docs/run-report.md)
            lora = self.resolved_args.get("lora_config") is not None
            fpt += flops.extra_forward_flops(self.extra_forwards, trained, frozen, lora, layers, heads, head_dim,
                                             seq_len)
        peak, why = flops.peak_flops(device["name"] if device["type"] == "cuda" else None)
        source = f"against the datasheet's dense bf16 peak of the {device['name']} (metrics/flops.py)" if peak else None
        if device["type"] != "cuda":
            if self.cpu_peak:  # the ranks' own measured rates: their mean times the world is their sum
                peak = sum(p["flops"] for p in self.cpu_peak) / len(self.cpu_peak)
                source = cpu_peak.describe(self.cpu_peak)
            else:
                why = f"device is a CPU ({device['name']}) and no matmul rate was measured before training"
        if fpt is not None and tps and peak:
            mfu = flops.mfu(fpt, tps, peak, world)
        else:
            mfu_note = why if not peak else "no tokens or no model config recorded"
        return {"flops_per_token": fpt, "flops_seq_len": seq_len, "peak_flops_per_device": peak,
                "peak_flops_source": source, "mfu": mfu, "mfu_note": mfu_note}

    # -- files --------------------------------------------------------------------------------------
    def run_args(self) -> dict:
        return sets_sorted({
            "schema_version": SCHEMA_VERSION,
            "recipe": self.recipe,
            "started_at": self.started_at,
            "hostname": socket.gethostname(),
            "command": sys.argv,
            "git_commit": git_commit(Path.cwd()),
            "versions": versions(),
            "launcher": launcher_env(),
            "accelerate_env": accelerate_env(),
            **self.resolved_args,
        })

    def finalize(self, status: str, error: str | None = None) -> dict | None:
        """Write metrics.json once, from rank 0. On a failure path no collectives are attempted."""
        if self.finalized or not self.is_main:
            return None
        self.finalized = True
        end = time.time()
        if not (self.output_dir / "run_args.json").exists():
            write_json_atomic(self.output_dir / "run_args.json", self.run_args())
        metrics = self.metrics(status, error, end)
        write_json_atomic(self.output_dir / "log_history.json", {"log_history": self.log_history})
        metrics = metrics_file.amend(self.output_dir, lambda cur: {**same_run(cur, self.started_at), **metrics})
        self.write_prom(metrics)  # for node_exporter's textfile collector
        return metrics

    def write_provisional(self, status: str, error: str) -> None:
        """Write metrics.json now, from rank 0's own figures, without closing the report: what stays on disk
        when the process is killed before `finalize` (a preemption save that outlives the grace period)."""
        if self.is_main and not self.finalized:
            metrics = self.metrics(status, error, time.time(), True)
            metrics = metrics_file.amend(self.output_dir, lambda cur: {**same_run(cur, self.started_at), **metrics})
            self.write_prom(metrics)  # training_running 0: the run is no longer training

    def metrics(self, status: str, error: str | None, end: float, provisional: bool = False) -> dict:
        env = launcher_env()
        world, nodes = env["world_size"], env["num_nodes"]
        device = device_info()
        completed_collectives = hasattr(self, "totals")
        if completed_collectives:
            tokens, peaks, scope = self.totals, self.peaks, "all_ranks"
        else:  # failed before on_train_end: this rank's own figures, labelled as such
            try:
                counts = self.tokens.counts()
            except RuntimeError:  # e.g. a CUDA error that ended the run: what the host counted still goes out
                counts = self.tokens.counts(host_only=True)
            tokens = {k: None if self.prior[k] is None else counts[k] + self.prior[k] for k in COUNTS}
            peaks, scope = _peak_memory(), "rank0_only"
        train_time = self.train_time_until(self.train_end or end) if self.train_start else None
        tps = tokens["non_padding"] / train_time if train_time else None

        losses = [h["loss"] for h in self.log_history if "loss" in h]
        eval_losses = [h["eval_loss"] for h in self.log_history if "eval_loss" in h]

        figures = self.mfu_figures(tokens, tps, world, device)
        no_device_mem = peaks["allocated"] < 0
        report = {
            "schema_version": SCHEMA_VERSION,
            "status": status,
            "provisional": provisional,
            "error": error,
            "recipe": self.recipe,
            "resumed_from": self.resumed_from,
            "started_at": self.started_at,
            "finished_at": now_iso(),
            "wall_clock_s": end - self.process_start,
            "train_time_s": train_time,
            "time_to_first_step_s": (self.first_step_end - self.process_start) if self.first_step_end else None,
            "startup_s": self.startup(),
            "steps": getattr(self, "global_step", None) or (self.log_history[-1].get("step") if self.log_history else 0),
            "samples": tokens["sequences"],
            "tokens": {"non_padding": tokens["non_padding"], "padded": tokens["padded"], "scope": scope},
            "tokens_per_second": tps,
            "tokens_per_second_per_device": tps / world if tps else None,
            **({"generated_tokens": tokens["generated"],
                "generated_tokens_per_second": tokens["generated"] / train_time if train_time and tokens["generated"]
                is not None else None} if "generation" in self.extra_forwards else {}),
            "world_size": world,
            "num_nodes": nodes,
            **sharding_info(),
            "device": {"type": device["type"], "name": device["name"], "count": world},
            "peak_memory": {
                "device_allocated_bytes": None if no_device_mem else int(peaks["allocated"]),
                "device_reserved_bytes": None if no_device_mem else int(peaks["reserved"]),
                "device_note": "CPU run: no device memory; see host_rss_bytes" if no_device_mem else None,
                "host_rss_bytes": int(peaks["host_rss"]),
                "host_rss_at_train_start_bytes_per_rank": self.rss_at_train_start,
                "host_rss_rise_final_save_bytes_per_rank": [r["save"] for r in self.final_save_rss or []] or None,
                "host_rss_rise_final_check_bytes_per_rank": [r["check"] for r in self.final_save_rss or []] or None,
                "scope": "max_over_ranks" if scope == "all_ranks" else scope,
                **capacity(device),
            },
            "params": {"total": self.params.get("total"), "trainable": self.params.get("trainable"),
                       "active": self.params.get("active")},  # a mixture of experts: top_k of its experts (flops.py)
            **({"expert_load": self.expert_load.report()} if self.expert_load else {}),
            "param_shards": self.shards,
            "load_check": self.load_check,
            "resume_check": self.resume_check,
            "tied_embeddings": self.tied_embeddings,
            "final_save_check": self.final_save_check,
            **figures,
            "first_train_loss": losses[0] if losses else None,
            "final_train_loss": losses[-1] if losses else None,
            "final_eval_loss": eval_losses[-1] if eval_losses else None,
            "trainer": self.trainer,
            **({self.trainer: logs} if (logs := self.kind_logs()) else {}),
        }
        report["gates"] = gates.evaluate(report, self.resolved_args.get("pack_args") or {}, losses, self.loss_falls)
        return report

    def kind_logs(self) -> dict:
        """The trainer kind's own logs (DPO: rewards, margins, accuracies; SFT of a mixture of experts: aux_loss):
        first and last training value of each, and the last evaluation's (`eval_<key>`), from the Trainer's log
        history. A key of OPTIONAL_LOGS that was never logged (aux_loss of a dense model) is left out."""
        out = {}
        for key in self.reported_logs:
            train = [h[key] for h in self.log_history if key in h]
            evals = [h[f"eval_{key}"] for h in self.log_history if f"eval_{key}" in h]
            if not train and not evals and key in OPTIONAL_LOGS:
                continue
            out[key] = {"first": train[0] if train else None, "last": train[-1] if train else None,
                        "eval_last": evals[-1] if evals else None}
        return out
