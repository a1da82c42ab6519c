"""Cheap fingerprints of the files a run trains from, recorded in its checkpoints and compared on resume: the base
model's weights (markers.identity, checked with the model's architecture) and the local data files
(resume_settings.current). A few KiB per file or tensor are read, never a whole file.

Gap this fills: a checkpoint recorded the base model's path and architecture only, and the data's path only. New
weights saved into the same model folder between an interruption and its resume passed the check ("resumed adapter
verified") and the old LoRA trained on on the new base; a data file shuffled in place resumed silently, the resumed
steps read other rows than the checkpoint's data skip assumes, and the summary called rows the first part trained
on "held out" (eval_split_size carves the eval rows by index).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from fsdp_recipes import model_folders

SAMPLE = 4096  # bytes read at the start and at the end of each tensor of a safetensors file
BLOCK = 1 << 20  # bytes read at the start and at the end of any other file (the whole of a file up to 2 MiB)
MAX_DATA_FILES = 10_000  # a data folder with more files is not fingerprinted (None: unknown, not compared)


def file_fingerprint(path: Path) -> str:
    """A short hash of a file's size and some of its bytes: of a safetensors file its header (names, dtypes, shapes,
    offsets) and the first and last SAMPLE bytes of every tensor, so that new values in any tensor show, however its
    file is laid out; of any other file the first and the last BLOCK bytes. Reads at most a few MiB per file."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            length = int.from_bytes(f.read(8), "little")
            header = f.read(length) if 8 + length <= size else b""
            digest.update(header)
            try:
                tensors = json.loads(header) if header else {}
            except ValueError:
                tensors = {}
            for name, info in sorted(tensors.items()):
                if name == "__metadata__" or not isinstance(info, dict):
                    continue
                start, end = info.get("data_offsets", (0, 0))
                for at in sorted({start, max(start, end - SAMPLE)}):
                    f.seek(8 + length + at)
                    digest.update(f.read(min(SAMPLE, end - at)))
        else:
            digest.update(f.read(BLOCK))
            if size > BLOCK:
                f.seek(max(BLOCK, size - BLOCK))
                digest.update(f.read(BLOCK))
    return digest.hexdigest()[:16]


def weights_fingerprint(model_name_or_path: str, revision: str | None = None) -> dict | None:
    """What identifies the base model's weights: {"files": {name: file_fingerprint}} for a local model folder (its
    weight files, model_folders.WEIGHT_GLOBS) or a local file; {"commit": sha} for a hub id whose snapshot for the
    default revision is in the local cache (the commit it resolves to). None where it is not known (a hub id not
    cached, or pinned to another revision: that revision's commit is what loads, and not every caller knows it)."""
    path = Path(model_name_or_path).expanduser()
    try:
        if path.is_dir():
            names = [n for n in model_folders.full_weights(path) if not n.endswith(".json")]
            return {"files": {n: file_fingerprint(path / n) for n in names}} if names else None
        if path.is_file():
            return {"files": {path.name: file_fingerprint(path)}}
    except OSError:
        return None
    if revision not in (None, "main") or not re.fullmatch(r"[\w.-]+/[\w.-]+", str(model_name_or_path)):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model_name_or_path), "config.json")
    except Exception:  # noqa: BLE001 - an unreadable cache: unknown
        return None
    return {"commit": Path(cached).parent.name} if isinstance(cached, str) else None


def weights_changed(saved: dict, now: dict) -> str | None:
    """How the weights `now` differ from the `saved` ones (weights_fingerprint's), in words; None when the same."""
    if saved == now:
        return None
    if "commit" in saved or "commit" in now:
        return f"commit {saved.get('commit', 'unknown')} -> {now.get('commit', 'unknown')}"
    was, new = saved.get("files") or {}, now.get("files") or {}
    changed = [n for n in sorted(was) if n in new and was[n] != new[n]]
    gone, added = sorted(set(was) - set(new)), sorted(set(new) - set(was))
    parts = ([f"{changed[0]} changed" + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")] if changed
             else []) + ([f"{gone[0]} is gone"] if gone else []) + ([f"{added[0]} is new"] if added else [])
    return ", ".join(parts) or "other files"


def data_fingerprint(paths) -> dict | None:
    """{path: short hash} for each local data path in `paths` (a file, or a folder: the file_fingerprint of each of its
    files but hidden ones and the `datasets` library's own cache-*.arrow, by relative name); hub ids and missing paths
    are left out, and a folder of more than MAX_DATA_FILES files. None when none is local."""
    out = {}
    for name in dict.fromkeys(p for p in paths if p and isinstance(p, str)):
        path = Path(name).expanduser()
        try:
            if path.is_file():
                out[name] = file_fingerprint(path)
            elif path.is_dir():
                files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("cache-")
                               and not any(part.startswith(".") for part in p.relative_to(path).parts))
                if len(files) > MAX_DATA_FILES:
                    continue
                digest = hashlib.sha256()
                for p in files:
                    digest.update(f"{p.relative_to(path)}\0{file_fingerprint(p)}\n".encode())
                out[name] = digest.hexdigest()[:16]
        except OSError:
            continue
    return out or None


def same_paths_changed(saved: dict | None, now: dict | None) -> list[str]:
    """The local data paths both data_fingerprint results hold whose files differ: a path only one holds is another
    dataset_name (or mixture), which resume_settings compares by name."""
    saved, now = saved or {}, now or {}
    return [name for name in sorted(set(saved) & set(now)) if saved[name] != now[name]]


def data_changed(saved: dict | None, now: dict | None) -> str:
    """Which local data path differs between two data_fingerprint results, in words."""
    saved, now = saved or {}, now or {}
    changed = same_paths_changed(saved, now)
    if not changed:
        return "the local data is the same"
    name = changed[0]
    kind = "files in the folder " if Path(name).is_dir() else ""
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return f"{kind}{name} changed{more}"
