"""The peak a CPU run's MFU divides by: a dense matmul rate measured on this machine, not a datasheet figure.

A CPU has no published dense bf16 peak that its ranks reach (the rate depends on the instructions torch's kernels use
here, AVX-512 BF16 or AMX or neither, and on the threads each rank gets), so each rank measures one: the median
rate of square matmuls in the compute dtype the run uses (bf16 under autocast, else float32), with the rank's own
threads, all ranks at once as they train. It is cached per CPU model, dtype, threads per rank, ranks on the node and
torch version in $FSDP_RECIPES_CACHE/cpu_matmul_peak.json as the best rate any launch measured there: a busy machine
measures low, so the first SETTLED_RUNS launches each measure again (0.5 s per rank) and the figure only rises
towards the machine's real rate; later launches take that best figure without measuring (their ranks start their
first step 0.5-1 s sooner; the suite's ~75 launches spent ~75 CPU-seconds on it, 2026-11-27). MFU
against it says how close training comes to what this CPU's matmul kernels do, the question a GPU's datasheet peak
answers.

The products are 1024 x 1024 where one takes at most 0.2 s, else 512 or 256 (the size is reported): bf16 on a CPU
with neither AVX-512 BF16 nor AMX is emulated at ~1.8 GFLOP/s (2-core AMD EPYC VM), 1.2 s per 1024 product, and six
of them held every rank of a bf16 launch (every GPU recipe's smoke run) for 7-15 s before its first step.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

SIZE = 1024  # n x n x n: 2.1 GFLOP per product, large enough for the kernels' steady rate, ~20-200 ms on one core
SIZES = (1024, 512, 256)  # the largest whose product takes at most MAX_PRODUCT_S, judged by a 256 product
MAX_PRODUCT_S = 0.2
MIN_PRODUCTS = 5
MIN_SECONDS = 0.5
SETTLED_RUNS = 8  # launches that measure, per key; the best of 8 is what later ones use
CACHE_FILE = "cpu_matmul_peak.json"
_MEASURED: dict[str, dict] = {}  # key -> this process's measurement


def key(cpu_name: str, dtype: str, threads: int, ranks_on_node: int) -> str:
    import torch

    return f"{cpu_name} | {dtype} | {threads} thread(s) per rank | {ranks_on_node} rank(s) | torch {torch.__version__}"


def product_size(dtype: str) -> int:
    """The largest of SIZES whose product, projected from a timed 256 product (n^3), takes at most MAX_PRODUCT_S."""
    import torch

    a = torch.randn(SIZES[-1], SIZES[-1]).to(getattr(torch, dtype))
    torch.mm(a, a)
    t0 = time.perf_counter()
    torch.mm(a, a)
    seconds = time.perf_counter() - t0
    return next((n for n in SIZES if seconds * (n / SIZES[-1]) ** 3 <= MAX_PRODUCT_S), SIZES[-1])


def measure(dtype: str, size: int | None = None, min_products: int = MIN_PRODUCTS,
            min_seconds: float = MIN_SECONDS) -> dict:
    """Median FLOP/s of size^3 matmuls in `dtype` ("bfloat16" or "float32") on this process's threads: at least
    `min_products` products and `min_seconds`, after one warm-up product. `size`: product_size's by default."""
    import torch

    size = size or product_size(dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(getattr(torch, dtype))  # random, never zeros (faster than real data)
    b = torch.randn(size, size, generator=gen).to(getattr(torch, dtype))
    torch.mm(a, b)
    rates, start = [], time.perf_counter()
    while len(rates) < min_products or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        torch.mm(a, b)
        rates.append(2 * size**3 / (time.perf_counter() - t0))
    return {"flops": statistics.median(rates), "products": len(rates), "size": size, "dtype": dtype,
            "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2)}


def best_rate(cache_dir: Path, cpu_name: str, dtype: str, ranks_on_node: int) -> dict:
    """This rank's peak: its rate measured now (every rank of the node at once, as they will train), or the best
    rate measured before for this CPU, dtype, threads and rank count where that is higher: a busy machine measures
    low, so the figure only ever rises towards the machine's real rate. Rank 0 stores it: `store`. Once
    SETTLED_RUNS launches have measured under this key, the best of theirs, measured_now None."""
    import torch

    k = key(cpu_name, dtype, torch.get_num_threads(), ranks_on_node)
    try:
        best = json.loads((cache_dir / CACHE_FILE).read_text()).get(k) or {}
    except (OSError, ValueError):
        best = {}
    if best.get("runs", 0) >= SETTLED_RUNS and best.get("flops") and k not in _MEASURED:
        return {key_: best.get(key_) for key_ in ("flops", "size", "dtype", "threads", "load_1min", "measured_at",
                                                  "runs")} | {"key": k, "measured_now": None}
    # once per process and key: a process that trains several runs in turn (scripts/arch_matrix.py) would otherwise
    # spend 0.5-0.8 s of each on the same measurement
    if k not in _MEASURED:
        _MEASURED[k] = measure(dtype)
    now = _MEASURED[k]
    out = {**now, "key": k, "measured_now": now["flops"], "runs": best.get("runs", 0) + 1,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if best.get("flops", 0) > now["flops"]:
        out.update(flops=best["flops"], measured_at=best.get("measured_at"), load_1min=best.get("load_1min"))
    return out


def store(cache_dir: Path, per_rank: list[dict]) -> None:
    """Keep the best node-wide figure (the median of the ranks' rates) under its key; atomic, last writer wins."""
    path = cache_dir / CACHE_FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    first = per_rank[0]
    measured = [p["measured_now"] for p in per_rank if p["measured_now"] is not None]
    if not measured:  # settled: this launch measured nothing
        return
    now = statistics.median(measured)
    entry = table.get(first["key"]) or {}
    if now > entry.get("flops", 0):
        entry = {"flops": now, "size": first["size"], "dtype": first["dtype"], "threads": first["threads"],
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_1min": first["load_1min"]}
    table[first["key"]] = {**entry, "runs": first["runs"]}
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)


def describe(per_rank: list[dict]) -> str:
    """What the MFU of a CPU run is against, for its report and summary."""
    total = sum(p["flops"] for p in per_rank)
    p = per_rank[0]
    if any(r["measured_now"] is None for r in per_rank):
        this = f"the best of the {p['runs']} launches that measured it; this one did not (metrics/cpu_peak.py)"
    else:
        now = sum(r["measured_now"] for r in per_rank)
        this = f"this launch measured {now / 1e9:,.1f} over {p['runs']} run(s) so far; metrics/cpu_peak.py"
    return (f"against the best {len(per_rank)}-rank {p['dtype']} matmul rate measured on this machine, "
            f"{total / 1e9:,.1f} GFLOP/s ({p['threads']} thread(s) per rank, {p['size']}x{p['size']} products; "
            f"{this})")
