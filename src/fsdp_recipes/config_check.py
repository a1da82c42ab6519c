"""Checks that turn a user's configuration mistake into one line naming the problem and the fix.

They run in the launcher, before `accelerate launch` starts any process, and again in the entry point, so
a mistake never becomes N tracebacks from N ranks.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import yaml

from fsdp_recipes.errors import UserError


def load_yaml(path: str | Path, what: str = "config") -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}. Fix: check the path (recipes live in recipes/<name>/).")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"malformed YAML in {path}{where}: {problem}. Fix: correct the YAML syntax there.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a YAML mapping of `key: value` lines, not {type(data).__name__}.")
    return data


def known_fields(dataclass_types) -> set[str]:
    return {f.name for dc in dataclass_types for f in dataclasses.fields(dc)}


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean `{close[0]}`?" if close else "remove it, or see `--help` for the valid keys"


def check_known_keys(config: dict, dataclass_types, path: str | Path) -> None:
    """Every key must be a field of one of the parser's dataclasses (or TRL's `env`)."""
    known = known_fields(dataclass_types) | {"env"}
    for key in config:
        if key not in known:
            raise UserError(f"unknown config key `{key}` in {path}. Fix: {_suggest(key, known)}")


def check_known_flags(argv: list[str], dataclass_types) -> None:
    """Command-line overrides must name fields too (`--no_<bool field>` included, as HfArgumentParser allows)."""
    known = known_fields(dataclass_types) | {"config", "help", "h"}
    for arg in argv:
        if not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0]
        if key not in known and not (key.startswith("no_") and key[3:] in known):
            raise UserError(f"unknown command-line flag `--{key}`. Fix: {_suggest(key, known)}")


def check_accelerate_config(path: str | Path) -> dict:
    """Parse with accelerate's own loader, then apply the rules that accelerate only discovers at run time."""
    raw = read_accelerate_config(path)
    check_accelerate_keys(path, raw)
    return raw


def read_accelerate_config(path: str | Path) -> dict:
    """The YAML and the pack's FSDP rules, without importing accelerate (which imports torch, 2 s: the launcher
    needs the config before it starts the ranks, and checks the keys while they import)."""
    raw = load_yaml(path, "accelerate config")
    fsdp = raw.get("fsdp_config") or {}
    if raw.get("distributed_type") == "FSDP":
        version = int(fsdp.get("fsdp_version", 1))
        if version == 1 and fsdp.get("fsdp_cpu_ram_efficient_loading") and not fsdp.get("fsdp_sync_module_states"):
            raise UserError(
                f"{path}: fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true "
                "(the other ranks receive rank 0's weights by broadcast). Fix: set fsdp_sync_module_states: true."
            )
        if version == 2:
            fsdp1_only = sorted(k for k in fsdp if k in FSDP1_ONLY_KEYS)
            if fsdp1_only:
                raise UserError(
                    f"{path}: {', '.join(fsdp1_only)} only apply to FSDP1 but fsdp_version is 2. "
                    "Fix: remove them (FSDP2 uses fsdp_reshard_after_forward instead of fsdp_sharding_strategy)."
                )
    return raw


def check_accelerate_keys(path: str | Path, raw: dict) -> None:
    """accelerate's own loader, and the keys in sections where accelerate ignores unknown ones silently."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        load_config_from_file(str(path))
    except Exception as err:  # accelerate raises TypeError/ValueError for unknown or bad keys
        raise UserError(f"accelerate cannot read {path}: {err}. Fix: compare with accelerate_configs/.") from None
    for section in ("fsdp_config", "parallelism_config"):
        known = launch_options(section.split("_config")[0] + "_")
        for key in raw.get(section) or {}:
            if key not in known:
                raise UserError(f"{path}: unknown {section} key `{key}` (accelerate would ignore it). "
                                f"Fix: {_suggest(key, known)}")


def launch_options(prefix: str) -> set[str]:
    """The `accelerate launch` options starting with `prefix`: the keys its config sections may hold."""
    from accelerate.commands.launch import launch_command_parser

    return {a.dest for a in launch_command_parser()._actions if a.dest.startswith(prefix)}


def hsdp_sizes(acc: dict) -> tuple[int, int] | None:
    """(replicate, shard) group sizes of an FSDP2 HSDP config, else None."""
    par = acc.get("parallelism_config") or {}
    replicate = int(par.get("parallelism_config_dp_replicate_size", 1))
    if acc.get("distributed_type") != "FSDP" or replicate <= 1:
        return None
    return replicate, int(par.get("parallelism_config_dp_shard_size", 1))


def check_topology(acc: dict, path, num_machines: int, num_processes: int) -> None:
    """An HSDP layout must cover the world exactly, with each shard group inside one node."""
    sizes = hsdp_sizes(acc)
    if sizes is None:
        return
    replicate, shard = sizes
    if replicate * shard != num_processes:
        raise UserError(
            f"{path}: dp_replicate_size {replicate} x dp_shard_size {shard} = {replicate * shard}, but the job has "
            f"{num_processes} processes. Fix: make their product the world size ({num_machines} node(s) x GPUs per node)."
        )
    per_node = num_processes // max(num_machines, 1)
    if num_machines > 1 and (shard > per_node or per_node % shard):
        raise UserError(
            f"{path}: a shard group of {shard} does not fit inside one node of {per_node} GPUs, so FSDP's all-gathers "
            f"would cross the network. Fix: set parallelism_config_dp_shard_size to {per_node} (or a divisor of it)."
        )


def check_fsdp_with_peft(acc: dict, use_peft: bool, path, processes: int = 2) -> None:
    """FSDP1 flattens parameters; LoRA mixes frozen and trainable ones, which needs use_orig_params. And FSDP1 on
    one process runs NO_SHARD, whose sharded state dict of a LoRA model torch 2.13 cannot take: the first
    checkpoint save fails ("FSDP assumes ...base_layer.weight is in the state_dict"; seen on CPU, the same code
    runs on a GPU), so the run would lose its work at the first save."""
    fsdp = acc.get("fsdp_config") or {}
    if not (use_peft and acc.get("distributed_type") == "FSDP" and int(fsdp.get("fsdp_version", 1)) == 1):
        return
    if not fsdp.get("fsdp_use_orig_params"):
        raise UserError(
            f"{path}: LoRA under FSDP1 needs fsdp_use_orig_params: true (FSDP1 cannot flatten frozen and trainable "
            "parameters together). Fix: set fsdp_use_orig_params: true, or use fsdp_version: 2."
        )
    if processes == 1 and "SHARDED" in str(fsdp.get("fsdp_state_dict_type", "")):
        raise UserError(
            f"{path}: LoRA under FSDP1 with one process cannot save SHARDED_STATE_DICT checkpoints (FSDP1 runs "
            "NO_SHARD there, and its sharded state dict of a LoRA model fails at the first save). Fix: "
            "fsdp_state_dict_type: FULL_STATE_DICT, fsdp_version: 2, or num_processes > 1."
        )


# Keys that mean something only to FSDP1; accelerate ignores or rejects them under FSDP2 (its FSDP2 migration
# guide). A user who writes them in an FSDP2 config expects an effect they will not get.
FSDP1_ONLY_KEYS = {
    "fsdp_sharding_strategy",
    "fsdp_backward_prefetch",
    "fsdp_forward_prefetch",
    "fsdp_use_orig_params",
    "fsdp_sync_module_states",
}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_count_hint() -> int | None:
    """The GPUs this process may see, without importing torch (2-3 s): the ids in CUDA_VISIBLE_DEVICES when it is
    set, else the `GPU n:` lines of `nvidia-smi -L`, else 0; None when nvidia-smi fails. An upper bound (CUDA stops
    at the first invalid id): the launcher starts the ranks on it and counts with torch while they import."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in out.splitlines())


def gpus_per_node(min_gpus: int, nodes: int) -> int:
    """min_gpus counts the whole job; each of its `nodes` needs its share (rounded up)."""
    return -(-min_gpus // max(nodes, 1))


def check_gpus(min_gpus: int, recipe: str, nodes: int = 1) -> None:
    per_node = gpus_per_node(min_gpus, nodes)
    if per_node <= 0:  # a CPU recipe: no need to import torch to count
        return
    found = gpu_count()
    if per_node > found:
        need = f"{per_node} GPU(s)" + (f" per node (min_gpus {min_gpus} over {nodes} nodes)" if nodes > 1 else "")
        raise UserError(
            f"recipe {recipe} needs {need} and this machine has {found}. Fix: run it on a GPU node, or "
            f"test it on CPU with `make smoke RECIPE={recipe}` (a tiny model of the same architecture, 2 processes)."
        )


def job_nodes() -> int:
    """Nodes of the job this rank belongs to (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE); 1 outside a launch."""
    return max(1, int(os.environ.get("WORLD_SIZE", 1)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


def check_attn_implementation(attn: str | None) -> None:
    if attn and attn.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        raise UserError(
            f"attn_implementation: {attn} needs the flash-attn package, which is not installed. "
            "Fix: `pip install -e .[gpu]` on a CUDA machine, or use attn_implementation: sdpa."
        )


def looks_local(path: str) -> bool:
    """A hub id is `org/name`; anything absolute, relative-explicit, home- or file-like is a local path."""
    return path.startswith(("/", "./", "../", "~", "$")) or path.endswith(
        (".json", ".jsonl", ".parquet", ".csv")
    ) or os.path.exists(path)


def check_local_model(path: str) -> None:
    if looks_local(path) and not (Path(path) / "config.json").is_file():
        raise UserError(
            f"model not found: {path} has no config.json. "
            "Fix: point model_name_or_path at a model directory or a hub id "
            "(the tiny default is built by `python -m fsdp_recipes.tiny_assets`)."
        )


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


def gpu_inventory() -> str:
    """What the seeds' wrappers print: the GPUs and how they are linked, where nvidia-smi exists."""
    if not shutil.which("nvidia-smi"):
        return "GPUs: none (no nvidia-smi on PATH); running on CPU"
    out = []
    for cmd in (["nvidia-smi", "-L"], ["nvidia-smi", "topo", "-m"], ["nvidia-smi", "nvlink", "--status"]):
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            out.append(f"$ {' '.join(cmd)}\n{res.stdout.strip() or res.stderr.strip()}")
        except (OSError, subprocess.SubprocessError) as err:
            out.append(f"$ {' '.join(cmd)}: {err}")
    return "\n".join(out)
