"""make report: compare runs from their run reports (metrics.json, run_args.json, log_history.json).

    fsdp-recipes report runs/a runs/b [--out DIR]

Writes report.md (one table row per run, then the settings that differ between the runs), loss.png (train and
eval loss against step, all runs on one axes), throughput.png and memory.png (bar charts). By default they go into
the runs' common parent directory; where that is /, the home folder or a folder that cannot be written (runs in
unrelated places), the report is refused in one line naming --out DIR. A run that failed or was preempted is
reported with its status. A path that is not a run (a file, a folder of runs, a folder without metrics.json) is an
error that says which. An earlier report in the same folder is replaced, with a line naming what was replaced.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import sys
from pathlib import Path

from fsdp_recipes.errors import UserError, cli

GIB = 1024**3


def human_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}). Fix: rerun, or remove that run from the list.") from None


def runs_inside(folder: Path) -> list[Path]:
    """The runs (folders with metrics.json) directly inside `folder`: a folder of runs, not a run (runs/smoke)."""
    return sorted(p for p in Path(folder).iterdir() if (p / "metrics.json").is_file()) if Path(folder).is_dir() else []


def not_a_run(run_dir: Path) -> str | None:
    """Why `run_dir` is not a run's output_dir (the problem, without the fix), None for a run: missing, a file, a
    folder of runs, a folder without metrics.json."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return f"{run_dir} is a file, not a run's folder"
    if not run_dir.is_dir():
        return f"run directory {run_dir} does not exist"
    if (run_dir / "metrics.json").is_file():
        return None
    inside = runs_inside(run_dir)
    if inside:
        named = ", ".join(str(p) for p in inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
        return f"{run_dir} is a folder of {len(inside)} run(s) ({named}), not a run itself (no metrics.json)"
    return (f"{run_dir} has no metrics.json: not a run's output_dir, or its run was killed before writing its "
            f"report")


def load_metrics(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    why = not_a_run(run_dir)
    if why:
        inside = runs_inside(run_dir)
        fix = (f"pass its runs ({run_dir}/*), or leave it out" if inside else
               "pass runs' output_dir paths, or leave this one out")
        raise UserError(f"{why}. Fix: {fix}.")
    return _read_json(run_dir / "metrics.json")


def load_run(run_dir: Path, parent: Path) -> dict:
    """Everything the report shows about one run. run_args.json and log_history.json are optional."""
    run_dir = Path(run_dir)
    metrics = load_metrics(run_dir)
    args_path, history_path = run_dir / "run_args.json", run_dir / "log_history.json"
    history = _read_json(history_path) if history_path.is_file() else []
    if isinstance(history, dict):  # the run report wraps the list: {"log_history": [...]}
        history = history.get("log_history", [])
    return {
        "name": os.path.relpath(run_dir.resolve(), parent),  # unique among the runs, unlike the last path part
        "metrics": metrics,
        "run_args": _read_json(args_path) if args_path.is_file() else {},
        "history": history,
    }


def common_parent(run_dirs: list[Path]) -> Path:
    """The deepest directory holding all runs (the parent of a single run, not the run itself)."""
    return Path(os.path.commonpath([Path(d).resolve().parent for d in run_dirs]))


def _num(value, fmt: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{suffix}"


def row(run: dict) -> list[str]:
    m = run["metrics"]
    peak, device = m.get("peak_memory") or {}, m.get("device") or {}
    status = m.get("status", "?")
    if (m.get("tokens") or {}).get("scope") == "rank0_only":
        status += " (rank-0 figures)"  # stopped before the ranks combined their counts
    return [
        run["name"], m.get("recipe") or "?", status, _num(m.get("steps"), ","),
        _num(m.get("world_size"), "d"), _num(m.get("num_nodes"), "d"), m.get("sharding_strategy") or "n/a",
        _num(m.get("fsdp_version"), "d"), m.get("mixed_precision") or "n/a",
        f"{device.get('type', '?')}: {device.get('name', '?')}",
        _num(m.get("tokens_per_second"), ",.0f"), _num(m.get("tokens_per_second_per_device"), ",.0f"),
        _num(None if m.get("mfu") is None else 100 * m["mfu"], ".1f", "%"),
        human_bytes(peak.get("device_allocated_bytes")), human_bytes(peak.get("host_rss_bytes")),
        _num(m.get("time_to_first_step_s"), ".1f", " s"),
        _num(m.get("final_train_loss"), ".4f"), _num(m.get("final_eval_loss"), ".4f"),
        *held_out(m.get("eval")),
        (run["run_args"].get("git_commit") or "n/a")[:8],
    ]


def held_out(ev: dict | None) -> list[str]:
    """The summary's scores of the trained model (metrics.json `eval`, launch/summary.py): its loss on the reference
    answers alone, and its exact match with the 95% Wilson interval where it was scored; n/a where the summary did not
    score (no `eval`: generations skipped) or the metric did not apply (long answers, text rows)."""
    if not ev:
        return ["n/a", "n/a"]
    loss = (ev.get("held_out_loss") or {}).get("trained")
    stage = (ev.get("stages") or [{}])[-1]
    n, right = stage.get("n") or ev.get("prompts"), ev.get("trained_correct")
    if right is None or not n:
        match = "n/a"
    else:
        interval = stage.get("wilson95")
        match = f"{right}/{n}" + (f" ({100 * interval[0]:.1f}-{100 * interval[1]:.1f}%)" if interval else "")
    rows = "" if ev.get("held_out", True) else " (not held out)"
    return [_num(loss, ".4f") + (rows if loss is not None else ""), match + (rows if match != "n/a" else "")]


HEADER = ["run", "recipe", "status", "steps", "world size", "nodes", "sharding", "FSDP", "mixed precision",
          "device", "tokens/s", "tokens/s per device", "MFU", "peak device memory (allocated)", "peak host RSS",
          "time to first step", "final train loss", "final eval loss", "held-out answer loss", "exact match",
          "commit"]
TEXT_COLUMNS = {"run", "recipe", "status", "sharding", "mixed precision", "device", "commit"}  # the rest right-aligned


def table_row(cells: list[str]) -> str:
    """One markdown table row. A `|` inside a cell (a device name, a setting's value) would split it: markdown's
    escape is a backslash before it."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


# run_args.json sections whose fields are settings (or the software) a comparison should name when they differ
# (and the trainer kind's TRL config, `<kind>_config`: any section whose name ends so, whatever the kind)
SETTING_SECTIONS = ("pack_args", "script_args", "model_args", "dataset_mixture", "lora_config", "accelerate_env",
                    "versions")
# fields that differ between any two runs by construction: where the run writes, the launcher's rendezvous gate
PER_RUN = {"accelerate_env.FSDP_RECIPES_START_GATE", "accelerate_env.FSDP_RECIPES_START_GATE_PID"}
PER_RUN_TRAINING = ("output_dir", "logging_dir", "run_name")  # of the kind's `<kind>_config`
MAX_SETTING_ROWS = 40
_ABSENT = object()


def setting_sections(args: dict) -> list[str]:
    """SETTING_SECTIONS and the trainer kind's `<kind>_config` and `<kind>_args` sections of one run_args.json."""
    return [*SETTING_SECTIONS, *(sec for sec in args if sec.endswith(("_config", "_args"))
                                 and sec not in SETTING_SECTIONS)]


def _printed_set(value: str) -> list | None:
    """A set that an older run_args.json recorded in its printed form, `"{'q_proj', 'v_proj'}"` (json's
    default=str), as a sorted list; None for any other string. The printed order varies between processes, so two
    runs targeting the same modules would otherwise differ."""
    if not (value.startswith("{'") and value.endswith("'}")):
        return None
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    return sorted(parsed, key=str) if isinstance(parsed, (set, frozenset)) else None


def _setting_value(value) -> str:
    if value is _ABSENT:
        return "(not recorded)"
    if isinstance(value, str):
        as_set = _printed_set(value)
        return value if as_set is None else json.dumps(as_set)
    return json.dumps(value, sort_keys=True)


# settings a reader looks for first, ranked before the rest of those that differ (any section: `.learning_rate` is
# the kind's TRL config's, whichever kind)
FIRST_SETTINGS = (".model_name_or_path", ".learning_rate", ".dataset_name", ".recipe_name", ".max_steps",
                  ".num_train_epochs", ".per_device_train_batch_size", ".gradient_accumulation_steps")


def kind_of(run: dict) -> str | None:
    """The run's trainer kind: pack_args.trainer, else metrics.json's `trainer`, else its `<kind>_config` section."""
    args = run["run_args"]
    kind = (args.get("pack_args") or {}).get("trainer") or run["metrics"].get("trainer")
    if kind:
        return kind
    own = [sec.removesuffix("_config") for sec in args if sec.endswith("_config") and sec != "lora_config"]
    return own[0] if len(own) == 1 else None


@dataclasses.dataclass
class Settings:
    """What differs between runs' recorded settings: `kinds` (one per run) where the runs' trainer kinds differ,
    else None; `rows`, (setting, one value per run), the settings every run recorded first; `only` (section, runs
    that have it, number of fields): the fields of a kind's own section that another kind's runs do not have, told
    as a count, not a row each (a preference kind's 40 own fields against a run of another kind would fill
    the table)."""

    kinds: list | None
    rows: list[tuple[str, list[str]]]
    only: list[tuple[str, list[str], int]]


def _rank(key: str) -> tuple:
    first = next((i for i, end in enumerate(FIRST_SETTINGS) if key.endswith(end)), len(FIRST_SETTINGS))
    return first, key


def compare_settings(runs: list[dict]) -> Settings:
    """Every setting in run_args.json that is not the same in all runs: what was changed between them (a speed
    option, `learning_rate`, a library version, an accelerate setting, ...). Gap it fills: the metrics say how runs
    differ in speed and loss; this says what differed in how they ran. Runs of different trainer kinds (SFT and
    DPO) are compared on what both recorded: the trainer kind first, then the fields their TRL configs share under
    one name (`<kind a>_config/<kind b>_config.learning_rate`), then the rest; a kind's own fields are counted per
    section."""
    kinds = [kind_of(r) for r in runs]
    mixed = len(set(kinds)) > 1
    own = {suffix: "/".join(dict.fromkeys(f"{k}{suffix}" for k, r in zip(kinds, runs) if f"{k}{suffix}" in
                                          r["run_args"])) for suffix in ("_config", "_args")}
    flat, origin = [], {}  # origin: a shared name's (run index) -> its own section, for the counts
    for i, (r, kind) in enumerate(zip(runs, kinds)):
        args, fields = r["run_args"], {}
        for sec in setting_sections(args):
            suffix = next((x for x in own if mixed and sec == f"{kind}{x}"), None)
            name = own[suffix] if suffix else sec
            for k, v in (args.get(sec) or {}).items():
                if sec.endswith("_config") and k in PER_RUN_TRAINING:
                    continue
                fields[f"{name}.{k}"] = v
                if suffix:
                    origin[(i, f"{name}.{k}")] = sec
        if mixed:
            fields.pop("pack_args.trainer", None)  # the first row
        flat.append(fields)
    keys = set().union(*flat) - PER_RUN
    rows, partial, only = [], [], {}
    for key in sorted(keys, key=_rank):
        have = [i for i, f in enumerate(flat) if key in f]
        values = [_setting_value(f.get(key, _ABSENT)) for f in flat]
        kind_own = len(have) < len(runs) and all((i, key) in origin for i in have)
        if kind_own and len({values[i] for i in have}) == 1:  # one kind's field, alike where recorded: counted
            for i in have:
                only.setdefault(origin[(i, key)], set()).add(key)
            continue
        if len(set(values)) > 1:
            (rows if len(have) == len(runs) else partial).append((key, values))
    counts = [(sec, [r["name"] for i, r in enumerate(runs) if any(origin.get((i, k)) == sec for k in fields)],
               len(fields)) for sec, fields in only.items()]
    counts.sort(key=lambda c: [r["name"] for r in runs].index(c[1][0]))  # in the runs' order
    return Settings(kinds if mixed else None, rows + partial, counts)


def differing_settings(runs: list[dict]) -> list[tuple[str, list[str]]]:
    """(setting, one value per run) for every differing setting; the trainer kinds first where they differ."""
    found = compare_settings(runs)
    return ([("trainer", list(found.kinds))] if found.kinds else []) + found.rows


def settings_markdown(runs: list[dict]) -> list[str]:
    if len(runs) < 2 or not any(r["run_args"].get(sec) for r in runs for sec in setting_sections(r["run_args"])):
        return []  # one run, or runs without recorded settings: nothing to compare
    found = compare_settings(runs)
    rows = ([("trainer", [k or "?" for k in found.kinds])] if found.kinds else []) + found.rows
    if not rows and not found.only:
        return ["", "Settings: the runs' recorded settings (run_args.json) are the same, output paths aside."]
    lines = ["", "## Settings that differ", "", table_row(["setting", *(r["name"] for r in runs)]),
             "|---|" + "---|" * len(runs)]
    lines += [table_row([key, *values]) for key, values in rows[:MAX_SETTING_ROWS]]
    if len(rows) > MAX_SETTING_ROWS:
        lines.append(f"\n... and {len(rows) - MAX_SETTING_ROWS} more (compare the runs' run_args.json).")
    if found.only:
        lines.append("")
    for sec, names, n in found.only:
        kind = next((k for k, r in zip(found.kinds or [], runs) if r["name"] in names), None) or "?"
        lines.append(f"- {sec}: {n} field{'s' * (n != 1)} only the {kind.upper()} run{'s' * (len(names) != 1)} "
                     f"({', '.join(names)}) {'has' if len(names) == 1 else 'have'}, a trainer kind's own "
                     "(compare the runs' run_args.json)")
    return lines


def markdown(runs: list[dict]) -> str:
    lines = ["# Run comparison", "", table_row(HEADER),
             "|" + "|".join("---" if h in TEXT_COLUMNS else "---:" for h in HEADER) + "|"]
    lines += [table_row(row(r)) for r in runs]
    mfu_notes: dict[str, list[str]] = {}  # one line per distinct reason, in run order
    for r in runs:
        if r["metrics"].get("mfu") is None and r["metrics"].get("mfu_note"):
            mfu_notes.setdefault(r["metrics"]["mfu_note"], []).append(r["name"])
    lines += ["", "Peak memory is the max over ranks. Plots: loss.png, throughput.png, memory.png.",
              "Final eval loss: TRL's, on the eval split during training, over the tokens the training loss counts "
              "(with a chat `messages` row and assistant_only_loss off, its prompt too). Held-out answer loss and "
              "exact match: the end-of-run summary's, on its eval rows (metrics.json `eval`), the reference answers' "
              "tokens alone and the greedy answer's exact match with its 95% Wilson interval; n/a where the summary "
              "did not score them.",
              *(f"- MFU n/a for {', '.join(names)}: {note}" for note, names in mfu_notes.items())]
    lines += settings_markdown(runs)
    return "\n".join(lines) + "\n"


def plot_loss(runs: list[dict], path: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    positive = True
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        for key, style, label in (("loss", "-", "train"), ("eval_loss", "--o", "eval")):
            points = [(h["step"], h[key]) for h in run["history"] if key in h and "step" in h]
            if points:
                status = run["metrics"].get("status")
                tag = "" if status == "completed" else f" [{status}]"  # a failed run's curve stops early
                ax.plot(*zip(*points), style, color=color, markersize=3, label=f"{run['name']}{tag} ({label})")
                positive &= all(y > 0 for _, y in points)
    if positive and ax.lines:
        ax.set_yscale("log")  # fine-tuning losses span orders of magnitude; log keeps the tail readable
    ax.set(xlabel="optimizer step", ylabel="loss", title="Loss against step")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no logged losses", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _short(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def plot_bars(runs: list[dict], path: Path, plt, title: str, ylabel: str, series: dict) -> None:
    """Grouped bars, one group per run; `series` maps a legend label to a figure-of-a-run function."""
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(runs) * len(series)), 5))
    width = 0.8 / len(series)
    for j, (label, value_of) in enumerate(series.items()):
        for i, run in enumerate(runs):
            value = value_of(run["metrics"])
            x = i + (j - (len(series) - 1) / 2) * width
            bars = ax.bar(x, value or 0, width, color=f"C{j}", label=label if i == 0 else None)
            ax.bar_label(bars, labels=[_short(value)], fontsize=8)
    ax.set_xticks(range(len(runs)), [r["name"] for r in runs], rotation=15 if len(runs) > 3 else 0)
    ax.set(ylabel=ylabel, title=title)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _gib(key: str):
    return lambda m: None if (m.get("peak_memory") or {}).get(key) is None else m["peak_memory"][key] / GIB


def default_out(parent: Path) -> Path:
    """The runs' common parent, where the report goes without --out; refused where runs in unrelated places
    (runs/x and /tmp/y) would put report.md and the PNGs in / or the home folder, or where it cannot be written."""
    home = Path.home().resolve()
    if parent in (Path(parent.anchor), home) or not os.access(parent, os.W_OK):
        where = "/" if parent == Path(parent.anchor) else ("your home folder" if parent == home else
                                                          f"{parent}, which is not writable")
        raise UserError(f"the runs' common parent is {where}: the report would be written there. "
                        f"Fix: name a folder, make report RUNS=\"...\" ARGS=\"--out DIR\" "
                        f"(fsdp-recipes report ... --out DIR).")
    return parent


def write_report(run_dirs: list[Path], out_dir: Path | None = None) -> list[Path]:
    if not run_dirs:
        raise UserError("no runs given. Fix: make report RUNS=\"runs/a runs/b\".")
    parent = common_parent(run_dirs)
    runs = [load_run(d, parent) for d in run_dirs]
    out = Path(out_dir) if out_dir else default_out(parent)
    out.mkdir(parents=True, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a login node or in CI
    import matplotlib.pyplot as plt

    names = ("report.md", "loss.png", "throughput.png", "memory.png")
    earlier = [name for name in names if (out / name).is_file()]
    if earlier:  # a derived report, rewritten from the runs: replaced, but not silently
        print(f"[report] replacing the earlier {', '.join(earlier)} in {out}", flush=True)
    (out / "report.md").write_text(markdown(runs))
    plot_loss(runs, out / "loss.png", plt)
    plot_bars(runs, out / "throughput.png", plt, "Throughput (non-padding tokens/s)", "tokens/s",
              {"all devices": lambda m: m.get("tokens_per_second"),
               "per device": lambda m: m.get("tokens_per_second_per_device")})
    plot_bars(runs, out / "memory.png", plt, "Peak memory (max over ranks)", "GiB",
              {"device allocated": _gib("device_allocated_bytes"), "host RSS": _gib("host_rss_bytes")})
    return [out / name for name in names]


@cli
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-recipes report", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run output directories (each with metrics.json)")
    parser.add_argument("--out", type=Path, help="where to write (default: the runs' common parent directory)")
    args = parser.parse_args(argv)
    paths = write_report(args.runs, args.out)
    print(f"[report] {len(args.runs)} run(s) -> " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
