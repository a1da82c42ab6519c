"""Which checkpoints are complete, and which one a relaunched run resumes from.

Gap this fills: transformers' `get_last_checkpoint` returns the newest `checkpoint-N` folder even when a kill
during saving left it half written, and resuming from it fails or silently loads partial state. Here a
checkpoint counts only once every rank has finished writing it: `CompletionMarkerCallback` waits for all
ranks in `on_save` and then rank 0 writes a marker file into the folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from transformers import TrainerCallback

from fsdp_recipes.checkpoint.fingerprint import weights_changed, weights_fingerprint
from fsdp_recipes.dist import barrier, rank
from fsdp_recipes.errors import UserError

MARKER = "checkpoint_complete"
IDENTITY = "checkpoint_identity.json"  # what was trained: checked before a resume loads any weight
ARCH_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size")
# the adapter's shape, and what makes its weights compute another function: the scale (alpha over r, or over its
# root under rsLoRA) and DoRA's magnitudes
PEFT_KEYS = ("r", "target_modules", "modules_to_save", "lora_alpha", "use_rslora", "use_dora")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """checkpoint-N folders, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def step_of(ckpt: Path) -> int:
    """The step in a checkpoint-N folder's name."""
    return int(_CHECKPOINT_RE.match(ckpt.name).group(1))


def is_complete(ckpt: Path) -> bool:
    return (ckpt / MARKER).is_file()


def latest_complete(output_dir: str | Path) -> Path | None:
    complete = [p for p in checkpoint_dirs(output_dir) if is_complete(p)]
    return complete[-1] if complete else None


def unreadable(ckpt: Path) -> str | None:
    """Why a complete checkpoint cannot be loaded, or None. Reads what is cheap to read whole (the JSON files,
    safetensors headers, the zip directory at the end of every torch.save file, which a truncated file lacks),
    not the tensors: an 8B checkpoint is checked in well under a second. Damage inside a tensor's bytes is
    found by the load itself, whose error names the checkpoint (launch/explain_failure.py)."""
    import zipfile

    from safetensors import safe_open

    if not (ckpt / "trainer_state.json").is_file():  # every Trainer save writes it: the step and the data to skip
        return "trainer_state.json: missing, so the Trainer cannot resume from it (its step and the data to skip)"
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                with safe_open(str(path), "pt") as f:
                    f.keys()
            elif path.suffix in (".pt", ".pth", ".bin"):
                zipfile.ZipFile(path).close()
            elif path.name == ".metadata":  # a distributed checkpoint's index (e.g. tensor_parallel_state.py)
                from torch.distributed.checkpoint import FileSystemReader

                FileSystemReader(str(path.parent)).read_metadata()
        except Exception as err:  # noqa: BLE001 -- any reason a loader would fail is the answer here
            first = next((x.strip() for x in str(err).splitlines() if x.strip()), "")
            return f"{path.relative_to(ckpt)}: {type(err).__name__}: {first}"
    return None


def usable(output_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint that can be read, and the newer complete ones that cannot, with why."""
    bad = []
    for ckpt in reversed([p for p in checkpoint_dirs(output_dir) if is_complete(p)]):
        why = unreadable(ckpt)
        if why is None:
            return ckpt, bad
        bad.append((ckpt, why))
    return None, bad


def move_aside(ckpt: Path, why: str = "unreadable") -> Path:
    """Rename a checkpoint out of the checkpoint-N names (kept for a look, never resumed, never overwritten by the
    save of that step, never rotated away by save_total_limit, whose glob is checkpoint-*): `<why>-checkpoint-N`."""
    target, n = ckpt.with_name(f"{why}-{ckpt.name}"), 1
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{why}-{ckpt.name}.{n}")
    ckpt.rename(target)
    return target


def incomplete(output_dir: str | Path) -> list[Path]:
    return [p for p in checkpoint_dirs(output_dir) if not is_complete(p)]


def identity(model_name_or_path: str, peft_config, settings: dict | None = None,
             revision: str | None = None) -> dict:
    """The model architecture (from a local config.json), a fingerprint of its weights (fingerprint.py: a few KiB of
    each file; a hub id's weight blobs where cached) and the adapter shape a checkpoint belongs to, and the settings it
    fixes (resume_settings.py). `revision`: the model's pinned revision (ModelConfig.model_revision), where known."""
    config_file = Path(model_name_or_path) / "config.json"
    arch = None
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        arch = {k: config.get(k) for k in ARCH_KEYS}
    peft = peft_full = None
    if peft_config is not None:
        d = peft_config.to_dict()
        peft = {k: sorted(d[k]) if isinstance(d.get(k), (list, set)) else d.get(k) for k in PEFT_KEYS}
        # the whole config, so `make export` can write adapter_config.json for a sharded checkpoint
        peft_full = json.loads(json.dumps(d, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    return {"model": model_name_or_path, "architecture": arch,
            "weights": weights_fingerprint(model_name_or_path, revision),
            "peft": peft, "peft_config": peft_full, "settings": settings}


def saved_identity(ckpt: Path) -> dict | None:
    path = Path(ckpt) / IDENTITY
    return json.loads(path.read_text()) if path.is_file() else None


def check_compatible(ckpt: Path, current: dict, explicit: bool = False) -> None:
    """Refuse, before any weight is loaded, to resume a run of another model or another LoRA shape. `explicit`: the
    command named the checkpoint (resume_from_checkpoint), rather than auto_resume finding it in output_dir."""
    saved = saved_identity(ckpt)
    if saved is None:
        return  # a checkpoint written by something else: the Trainer's own checks apply
    fix = ("Fix: point --resume_from_checkpoint at a checkpoint of this model and adapter, leave it out to start "
           "over, or use the checkpoint's settings." if explicit else
           "Fix: use a new output_dir, --auto_resume false, or the checkpoint's settings.")
    # the model first: another model's checkpoint differs in its LoRA targets too, which would be named instead
    if saved["architecture"] and current["architecture"] and saved["architecture"] != current["architecture"]:
        diff = [k for k in ARCH_KEYS if saved["architecture"].get(k) != current["architecture"].get(k)]
        raise UserError(f"cannot resume from {ckpt}: it was trained on another model ({diff[0]} "
                        f"{saved['architecture'][diff[0]]} vs {current['architecture'][diff[0]]}). {fix}")
    # a checkpoint written before the fingerprint was recorded, or a model whose weights are not known: not compared
    if saved.get("weights") and current.get("weights") and (how := weights_changed(saved["weights"],
                                                                                   current["weights"])):
        other = ("point --resume_from_checkpoint at a checkpoint of these weights, or leave it out to start over"
                 if explicit else "use a new output_dir to train on these weights")
        back = (f"--model_revision {saved['weights']['commit']} (the commit it was trained on)"
                if "blobs" in saved["weights"] else f"put the weights it was trained on back at {current['model']}")
        raise UserError(f"cannot resume from {ckpt}: the base model {current['model']} holds other weights than the "
                        f"ones it was trained on ({how}). Fix: {back}, or {other}.")
    if (saved["peft"] is None) != (current["peft"] is None):
        kinds = ["full fine-tuning", "LoRA"]
        raise UserError(f"cannot resume from {ckpt}: it is a {kinds[saved['peft'] is not None]} checkpoint and "
                        f"this run is {kinds[current['peft'] is not None]}. {fix}")
    for key in PEFT_KEYS if saved["peft"] else ():
        # a key an identity written before it was compared is unknown, not a difference
        if key in saved["peft"] and saved["peft"][key] != current["peft"][key]:
            raise UserError(f"cannot resume from {ckpt}: its LoRA {key} is {saved['peft'][key]} and this run's is "
                            f"{current['peft'][key]}. {fix}")


# What accelerate writes for the model under each fsdp_state_dict_type (accelerate 1.15 save_fsdp_model,
# FSDP_MODEL_NAME; the optimizer's files follow the same type), and reads back under the run's own type only
STATE_DICT_FILES = {"SHARDED_STATE_DICT": "pytorch_model_fsdp_0", "FULL_STATE_DICT": "pytorch_model_fsdp.bin",
                    "LOCAL_STATE_DICT": "pytorch_model_fsdp_rank0.bin"}
_STATE_DICT_TYPES = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT"}  # torch's enum


def saved_state_dict_type(ckpt: Path) -> str | None:
    """The fsdp_state_dict_type a checkpoint was saved with, from its files; None for one that FSDP did not write
    (DDP, tensor parallel, another tool's)."""
    return next((kind for kind, name in STATE_DICT_FILES.items() if (Path(ckpt) / name).exists()), None)


def run_state_dict_type(acc: dict | None = None) -> str | None:
    """The fsdp_state_dict_type this run saves and loads checkpoints with, as accelerate reads it: from the accelerate
    YAML (`acc`, in the launcher) or from the environment `accelerate launch` gives the ranks; unset, accelerate's
    default (FULL_STATE_DICT under FSDP1, SHARDED_STATE_DICT under FSDP2). None without FSDP."""
    if acc is not None:
        fsdp = acc.get("fsdp_config") or {}
        if acc.get("distributed_type") != "FSDP":
            return None
        value, version = fsdp.get("fsdp_state_dict_type"), fsdp.get("fsdp_version", 1)
    else:
        if os.environ.get("ACCELERATE_USE_FSDP", "").lower() not in ("true", "1"):
            return None
        value, version = os.environ.get("FSDP_STATE_DICT_TYPE"), os.environ.get("FSDP_VERSION", "1")
    if value is None:
        return "FULL_STATE_DICT" if str(version) == "1" else "SHARDED_STATE_DICT"
    value = str(value).upper().removeprefix("STATEDICTTYPE.")
    return _STATE_DICT_TYPES.get(value, value)


def check_state_dict_type(ckpt: Path, run_type: str | None, explicit: bool = False) -> None:
    """Refuse, before any rank loads it, a checkpoint saved with another fsdp_state_dict_type than this run's:
    accelerate loads only the run's own files (a FULL_STATE_DICT checkpoint resumed under SHARDED_STATE_DICT failed on
    every rank, 'FileNotFoundError ... pytorch_model_fsdp_0/.metadata', then 'CheckpointException ranks:dict_keys([0,
    1])', no cause named). `run_type`: run_state_dict_type's."""
    saved = saved_state_dict_type(ckpt)
    if saved is None or run_type is None or saved == run_type:
        return
    other = (f"point --resume_from_checkpoint at a {run_type} checkpoint" if explicit else
             f"use a new output_dir to start over with {run_type}")
    raise UserError(f"cannot resume from {ckpt}: it was saved with fsdp_state_dict_type {saved} "
                    f"({STATE_DICT_FILES[saved]}); this run's accelerate config says {run_type}, and accelerate loads "
                    f"only that type's files. Fix: set fsdp_state_dict_type: {saved} in the recipe's accelerate.yaml "
                    f"to resume, or {other}.")


class CompletionMarkerCallback(TrainerCallback):
    """Record what each checkpoint belongs to, and mark it complete once all ranks have returned from saving."""

    def __init__(self, run_identity: dict | None = None):
        self.run_identity = run_identity

    def on_save(self, args, state, control, **kwargs):
        barrier()  # every rank has finished its part of the checkpoint
        if rank() == 0:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                if self.run_identity is not None:
                    (ckpt / IDENTITY).write_text(json.dumps(self.run_identity, indent=2) + "\n")
                (ckpt / MARKER).write_text(f"{state.global_step}\n")
