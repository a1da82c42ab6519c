"""A run's headline figures as Prometheus gauges, in node_exporter's textfile-collector format.

While a run trains, the run report rewrites these gauges at every training log with the figures of the interval
since the previous log (status "running"); when it ends, with the whole run's figures from metrics.json.

    fsdp-recipes prometheus runs/a runs/b --out /var/lib/node_exporter/textfile/fsdp_recipes.prom

Of the paths given, a file and a folder of runs (what `runs/*` also matches: report.md, runs/smoke) are skipped with
a line each; any other path that is not a run is an error.

`write_textfile(metrics, path)` is the same for one run, from its metrics.json dict (the run report writes
`<output_dir>/metrics.prom` with it). Standard library only, so the run report can import it on every rank.
Every sample carries the labels recipe, run (the output_dir's name), output_dir (its absolute path), device and
world_size. The path is what keeps two runs apart: every recipe's default output_dir is runs/<recipe>, so two users
of one recipe on one node share the name, and two files with the same series make node_exporter's whole gather
fail (monitoring/README.md).
See monitoring/README.md for node_exporter and monitoring/alerts.yaml for the alert rules.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
from pathlib import Path

from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.metrics.run_comparison import load_metrics, not_a_run, runs_inside

# (metric name, HELP text, the figure in metrics.json, why it can be null there)
GAUGES = (
    ("training_mfu", "Model FLOPs utilisation of the run, 0 to 1 (metrics.json mfu)",
     lambda m: m.get("mfu"), lambda m: m.get("mfu_note")),
    ("training_tokens_per_second", "Non-padding tokens per second of training time, all ranks (metrics.json)",
     lambda m: m.get("tokens_per_second"), lambda m: "the run stopped before training time was measured"),
    ("training_peak_device_memory_bytes", "torch.cuda.max_memory_allocated, max over ranks",
     lambda m: _peak(m, "device_allocated_bytes"), lambda m: _peak(m, "device_note")),
    ("training_peak_host_rss_bytes", "Peak resident set size of a rank's process, max over ranks",
     lambda m: _peak(m, "host_rss_bytes"), lambda m: "not measured"),
    ("training_step", "Optimizer steps done (metrics.json steps)",
     lambda m: m.get("steps"), lambda m: "no step recorded"),
    ("training_running", "1 while the run trains, 0 once its report is final (completed, failed, preempted)",
     lambda m: int(m.get("status") == "running"), lambda m: None),
    ("training_last_update_timestamp_seconds", "Unix time this file was last written by the run",
     lambda m: _unix_time(m.get("updated_at") or m.get("finished_at")), lambda m: "no time recorded"),
)


def _unix_time(iso: str | None) -> int | None:
    return int(dt.datetime.fromisoformat(iso).timestamp()) if iso else None


def _peak(metrics: dict, key: str):
    return (metrics.get("peak_memory") or {}).get(key)


def _label_value(value) -> str:
    """Escape as the text format requires: backslash, double quote and newline."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(metrics: dict, run_dir: str) -> str:
    labels = {
        "recipe": metrics.get("recipe") or "",
        "run": Path(run_dir).name,
        "output_dir": run_dir,
        "device": (metrics.get("device") or {}).get("name") or "",
        "world_size": metrics.get("world_size") if metrics.get("world_size") is not None else "",
    }
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items()) + "}"


def render(runs: dict[str, dict]) -> str:
    """The exposition text for {run directory (absolute): metrics.json dict}, one block per metric family.

    A null figure is left out, with a comment line saying why, rather than written as NaN. NaN is a valid
    sample value, and client libraries use it for "no observations yet" (an empty summary's quantiles). Here the
    figure does not exist at all: MFU has no peak FLOPs to divide by on a CPU, and a CPU has no device memory.
    A NaN would also turn sum() and avg() over all runs into NaN, and an alert comparing it is silently false.
    A missing series can at least be found with absent().
    """
    lines = []
    for name, help_text, value_of, why_null in GAUGES:
        samples, omitted = [], []
        for run_dir, metrics in runs.items():
            value = value_of(metrics)
            if value is None:
                reason = " ".join(str(why_null(metrics) or "null in metrics.json").split())  # one line
                omitted.append(f"# {name} omitted for run {run_dir!r}: {reason}")
            else:
                # ints stay ints (bytes); floats keep full precision (repr round-trips)
                text = str(value) if isinstance(value, int) else repr(float(value))
                samples.append(f"{name}{_labels(metrics, run_dir)} {text}")
        if samples:  # HELP/TYPE only for a family that has samples: no empty families
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *samples]
        lines += omitted
    return "\n".join(lines) + "\n"


def write_atomic(text: str, path: Path) -> Path:
    """Temp file + rename in the target directory, so node_exporter never reads half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temp name must not end in .prom: the collector reads every *.prom file in its directory.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; node_exporter usually runs as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_textfile(metrics: dict, path, run_dir=None) -> Path:
    """One run's gauges into `path`; `run_dir` (its output_dir) defaults to the directory holding `path`."""
    path = Path(path)
    return write_atomic(render({str(Path(run_dir or path.parent).resolve()): metrics}), path)


@cli
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-recipes prometheus", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run output directories (each with metrics.json)")
    parser.add_argument("--out", type=Path, required=True, help="the .prom file to write")
    args = parser.parse_args(argv)
    runs: dict[str, dict] = {}
    for run_dir in args.runs:
        if run_dir.is_file() or runs_inside(run_dir) and not (run_dir / "metrics.json").is_file():
            # what a glob over runs/ also matches (report.md, loss.png, runs/smoke's folder of runs): said, not fatal
            inside = f"; its runs: {run_dir}/*" if run_dir.is_dir() else ""
            print(f"[prometheus] skipped {not_a_run(run_dir)}{inside}", flush=True)
            continue
        key = str(run_dir.resolve())
        if key in runs:  # two samples with the same labels would make the whole file invalid
            raise UserError(f"{run_dir} is given twice. Fix: name each run directory once.")
        runs[key] = load_metrics(run_dir)
    if not runs:
        raise UserError(f"none of {', '.join(map(str, args.runs))} is a run's folder. Fix: pass runs' output_dir "
                        f"paths (each with metrics.json).")
    print(f"[prometheus] {len(runs)} run(s) -> {write_atomic(render(runs), args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def check_prometheus_textfile(path: str | None) -> None:
    """node_exporter reads only `*.prom` files directly inside its directory: any other name is silently ignored,
    so it is an error here, not a surprise on the dashboard."""
    if not path:
        return
    target = Path(path)
    if target.suffix != ".prom":
        raise UserError(f"prometheus_textfile {path} does not end in .prom, and node_exporter's textfile collector "
                        f"reads only *.prom files. Fix: name it like {target.with_suffix('.prom')}.")
    if not target.parent.is_dir() or not os.access(target.parent, os.W_OK):
        raise UserError(f"prometheus_textfile {path}: directory {target.parent} does not exist or is not writable. "
                        "Fix: point it into node_exporter's --collector.textfile.directory, or create that "
                        "directory with write access for this job.")
