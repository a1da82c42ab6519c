"""A finished run judged against its recipe: the acceptance gates (an MFU floor, a peak-memory ceiling), the memory
headroom warning, and whether the loss diverged. Pure functions of the run report's own figures and the recipe's
pack settings, so the verdict in metrics.json and the summary is what anyone can recompute from the files.

The gates follow the FSDP2 design's acceptance rule ("mfu >= 0.40 and no OOM headroom warnings"). Memory is judged
where it runs out: on a GPU, torch's peak reserved bytes against the device's total; on CPU, the largest rank's host
RSS times the ranks on the node against the host's RAM (the ranks share it).
"""

from __future__ import annotations

import math
import os

from fsdp_recipes.errors import EXIT_DIVERGED, EXIT_GATE_FAILED


def memory_fraction(peak_memory: dict) -> tuple[float | None, str]:
    """(share of capacity the run's peak used, what was compared), or (None, why) without the figures."""
    pm = peak_memory or {}
    if pm.get("device_reserved_bytes") is not None and pm.get("device_total_bytes"):
        return pm["device_reserved_bytes"] / pm["device_total_bytes"], "device memory reserved / device total"
    if pm.get("host_rss_bytes") and pm.get("host_total_bytes"):
        ranks = pm.get("ranks_per_node") or 1
        return pm["host_rss_bytes"] * ranks / pm["host_total_bytes"], \
            f"host RSS of the largest rank x {ranks} rank(s) on the node / host RAM"
    return None, "no peak memory or capacity recorded"


def diverged(losses: list[float], factor: float) -> str | None:
    """Why the logged training losses say the run diverged (a non-finite loss; the last loss above `factor` times the
    first), else None. `factor` 0 switches the second test off; a first loss at or below 0 cannot be scaled."""
    bad = [x for x in losses if not math.isfinite(x)]
    if bad:
        return f"a logged training loss was {bad[0]}"
    if factor and len(losses) >= 2 and losses[0] > 0 and losses[-1] > factor * losses[0]:
        return (f"the training loss rose from {losses[0]:.4g} to {losses[-1]:.4g}, over {factor:g}x where it "
                f"started (divergence_factor)")
    return None


SMOKE_ENV = "FSDP_RECIPES_SMOKE"  # launch/smoke.py's: `make smoke` sets it for the launcher and its ranks


def smoke_run() -> bool:
    """Whether this is a `make smoke` run: a tiny model's few steps, whose MFU and memory say nothing of the recipe's
    gates (set for a full-size run on its hardware)."""
    return os.environ.get(SMOKE_ENV, "") not in ("", "0", "false")


def evaluate(metrics: dict, pack: dict, losses: list[float], loss_falls: bool = True,
             smoke: bool | None = None) -> dict:
    """The run's verdicts: each gate the recipe sets (value, limit, passed), the headroom warning, divergence, and
    `verdict` "pass", "fail" or "no gates"; `enforced` False when the recipe says the gates only warn. A smoke run
    (`smoke`, default smoke_run()) records its figures against the gates but judges none: `judged` False, verdict
    "not judged" (divergence is still judged). Reports written before `judged` existed were all judged."""
    smoke = smoke_run() if smoke is None else smoke
    out: dict = {"enforced": not pack.get("gates_warn_only", False) and not smoke, "mfu": None, "peak_memory": None,
                 "headroom_warning": None, "judged": not smoke}
    failed = []
    if pack.get("mfu_min") is not None:
        mfu = metrics.get("mfu")
        ok = mfu is not None and mfu >= pack["mfu_min"]
        out["mfu"] = {"min": pack["mfu_min"], "value": mfu, "passed": ok,
                      **({} if mfu is not None else {"why": f"no MFU figure: {metrics.get('mfu_note')}"})}
        if not ok:
            failed.append("mfu")
    fraction, what = memory_fraction(metrics.get("peak_memory"))
    if pack.get("peak_memory_max_fraction") is not None:
        ok = fraction is not None and fraction <= pack["peak_memory_max_fraction"]
        out["peak_memory"] = {"max_fraction": pack["peak_memory_max_fraction"], "value": fraction, "of": what,
                              "passed": ok}
        if not ok:
            failed.append("peak_memory")
    margin = pack.get("memory_headroom_warning")
    if margin and fraction is not None and fraction > 1 - margin:
        out["headroom_warning"] = (f"peak memory at {100 * fraction:.1f}% of capacity ({what}), within the "
                                   f"{100 * margin:g}% margin (memory_headroom_warning): the next longer batch or "
                                   "step may not fit")
    why = diverged(losses, pack.get("divergence_factor") or 0) if loss_falls else None
    out["diverged"] = why
    if smoke:
        failed = []
        for name in GATES:
            if out[name]:
                out[name]["passed"] = None  # not judged: a tiny model's figures
    out["failed"] = failed
    # a diverged run fails whatever its gates say (exit code 4 before a gate's 3: launch/summary.py)
    gated = out["mfu"] or out["peak_memory"]
    out["verdict"] = "fail" if failed or why else (("not judged" if smoke else "pass") if gated else "no gates")
    return out


# each gate: its label in the summary, its recipe field, the key of its limit, the comparison that passes it
GATES = {"mfu": ("MFU", "mfu_min", "min", ">="),
         "peak_memory": ("peak memory", "peak_memory_max_fraction", "max_fraction", "<=")}


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def gate_percent(g: dict, key: str, op: str) -> str:
    """A gate's value with the decimals (1 to 4) that read as its verdict: an MFU of 0.952% under a 1% floor is
    "0.95%", not "1.0%" beside "gate >= 1%: FAIL". A value within 0.00005 points of the limit on the failing side
    still reads as the limit at 4 decimals; the verdict beside it says which side."""
    value, limit = g["value"], g[key]
    if value is None:
        return percent(value)
    for digits in range(1, 5):
        shown = round(100 * value, digits)
        if (shown >= 100 * limit if op == ">=" else shown <= 100 * limit) == g["passed"]:
            break
    return f"{100 * value:.{digits}f}%"


def lines(gates: dict) -> list[str]:
    """The summary's lines for the verdicts (empty for a run with no gates, no warning and no divergence)."""
    out = []
    if gates.get("judged") is False:  # a smoke run: its figures are in metrics.json, its verdicts not made
        named = [GATES[name][1] for name in GATES if gates.get(name)]
        if named:
            out.append(f"gate        not judged on a smoke run ({', '.join(named)}: a tiny model's few steps say "
                       "nothing of the recipe's MFU or memory on its hardware)")
    for name, (label, field, key, op) in GATES.items():
        g = gates.get(name)
        if not g or gates.get("judged") is False:
            continue
        value = gate_percent(g, key, op) + (" of capacity" if name == "peak_memory" and g["value"] is not None else "")
        limit = f"{op} {100 * g[key]:g}% ({field}" + (f"; {g['of']})" if name == "peak_memory" else ")")
        out.append(f"gate        {label} {value}, gate {limit}: {'pass' if g['passed'] else 'FAIL'}")
    if gates.get("failed") and not gates.get("enforced", True):
        out.append("gate        failed, but the recipe says gates_warn_only: true, so the exit code stays 0")
    if gates.get("headroom_warning"):
        out.append(f"warning     {gates['headroom_warning']}")
    if gates.get("diverged"):
        out.append(f"DIVERGED    {gates['diverged']}: the weights were saved, but do not use them; lower the "
                   "learning rate or raise warmup, then train again")
    return out


def verdict_line(verdicts: dict) -> str:
    """The one line of a completed run that exits 3 or 4."""
    if verdicts.get("diverged"):
        return (f"the run diverged: {verdicts['diverged']} (exit code {EXIT_DIVERGED}). Fix: lower learning_rate or "
                "raise warmup_steps and train again; divergence_factor: 0 switches the test off")
    failed = [f"{name} {gate_percent(verdicts[name], GATES[name][2], GATES[name][3])} against {GATES[name][1]} "
              f"{100 * verdicts[name][GATES[name][2]]:g}%" for name in verdicts["failed"]]
    return (f"the run trained and saved, but failed its gate(s): {'; '.join(failed)} (exit code {EXIT_GATE_FAILED}). "
            "Fix: tune the run (bench/README.md: the GPU ladder), or change the gate in the recipe; gates_warn_only: "
            "true keeps the exit code 0")


def exit_code(metrics: dict) -> int:
    """A completed run's code from its verdicts: 4 diverged, 3 a failed gate the recipe enforces, else 0, so that a
    job script tells "trained but unusable / too slow / too close to OOM" from a crash."""
    verdicts = metrics.get("gates") or {}
    if metrics.get("status") != "completed":
        return 0
    if verdicts.get("diverged"):
        return EXIT_DIVERGED
    if verdicts.get("failed") and verdicts.get("enforced", True):
        return EXIT_GATE_FAILED
    return 0
