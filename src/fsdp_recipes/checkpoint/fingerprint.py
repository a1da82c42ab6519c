"""Cheap fingerprints of the files a run trains from, recorded in its checkpoints and compared on resume: the base
model's weights (markers.identity, checked with the model's architecture) and the local data files
(resume_settings.current). At most two 64 KiB reads a file, and none for a hub id's or a data folder's files.

Gap this fills: a checkpoint recorded the base model's path and architecture only, and the data's path only. New
weights saved into the same model folder between an interruption and its resume passed the check ("resumed adapter
verified") and the old LoRA trained on on the new base; a data file shuffled in place resumed silently, the resumed
steps read other rows than the checkpoint's data skip assumes, and the summary called rows the first part trained
on "held out" (eval_split_size carves the eval rows by index).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from fsdp_recipes import model_folders

BLOCK = 1 << 16  # bytes read at the start and at the end of a file's data (a safetensors file's: after its header)
MAX_DATA_FILES = 10_000  # a data folder with more files is not fingerprinted (None: unknown, not compared)
# what data/loading.py's builders read in a data folder (data/files.py FILE_BUILDERS' suffixes, compressed too): a
# README or notes beside them are no data
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".txt", ".parquet", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip")


def file_fingerprint(path: Path) -> str:
    """A short hash of a file's size and a few of its bytes: the first and the last BLOCK bytes of its data, and of
    a safetensors file its header too (names, dtypes, shapes, offsets). Two reads a file, whatever its size."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            length = int.from_bytes(f.read(8), "little")
            if 8 + length <= size:
                digest.update(f.read(length))
                start = 8 + length
        f.seek(start)
        digest.update(f.read(BLOCK))
        if size - start > BLOCK:
            f.seek(max(start + BLOCK, size - BLOCK))
            digest.update(f.read(BLOCK))
    return digest.hexdigest()[:16]


def loaded_weights(folder: Path) -> list[str]:
    """The weight files from_pretrained loads from `folder`: its safetensors ones where there are any (a .bin beside
    them is not read), else its .bin ones."""
    names = [n for n in model_folders.full_weights(folder) if not n.endswith(".json")]
    return [n for n in names if n.endswith(".safetensors")] or names


def weights_fingerprint(model_name_or_path: str, revision: str | None = None) -> dict | None:
    """What identifies the base model's weights: {"files": {name: file_fingerprint}} for a local model folder (the
    weight files it loads) or a local file; for a hub id whose snapshot is in the local cache, {"blobs": {name: the
    blob its snapshot links to (the file's LFS sha256)}, "commit": the snapshot's}: no file is read. None where it is
    not known (a hub id not cached)."""
    path = Path(model_name_or_path).expanduser()
    try:
        if path.is_dir():
            names = loaded_weights(path)
            return {"files": {n: file_fingerprint(path / n) for n in names}} if names else None
        if path.is_file():
            return {"files": {path.name: file_fingerprint(path)}}
    except OSError:
        return None
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(model_name_or_path)):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model_name_or_path), "config.json", revision=revision)
        if not isinstance(cached, str):
            return None
        snapshot = Path(cached).parent
        blobs = {n: Path(os.path.realpath(snapshot / n)).name for n in loaded_weights(snapshot)}
    except Exception:  # noqa: BLE001 - an unreadable cache: unknown
        return None
    return {"blobs": blobs, "commit": snapshot.name} if blobs else None


def weights_changed(saved: dict, now: dict) -> str | None:
    """How the weights `now` differ from the `saved` ones (weights_fingerprint's), in words; None when the same."""
    if "blobs" in saved or "blobs" in now:  # a hub id: the same weight blobs are the same weights, whatever commit
        if saved.get("blobs") == now.get("blobs"):
            return None
        return f"commit {saved.get('commit', 'unknown')}'s weight files -> commit {now.get('commit', 'unknown')}'s"
    if saved == now:
        return None
    was, new = saved.get("files") or {}, now.get("files") or {}
    changed = [n for n in sorted(was) if n in new and was[n] != new[n]]
    gone, added = sorted(set(was) - set(new)), sorted(set(new) - set(was))
    parts = ([f"{changed[0]} changed" + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")] if changed
             else []) + ([f"{gone[0]} is gone"] if gone else []) + ([f"{added[0]} is new"] if added else [])
    return ", ".join(parts) or "other files"


def data_fingerprint(paths) -> dict | None:
    """{path: short hash} for each local data path in `paths` (a file: its file_fingerprint; a folder: the relative
    name, size and modification time of each of its data files, DATA_SUFFIXES, but hidden ones and the `datasets`
    library's own cache-*.arrow); hub ids and missing paths are left out, and a folder of more than MAX_DATA_FILES
    files. None when none is local."""
    out = {}
    for name in dict.fromkeys(p for p in paths if p and isinstance(p, str)):
        path = Path(name).expanduser()
        try:
            if path.is_file():
                out[name] = file_fingerprint(path)
            elif path.is_dir():
                files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("cache-")
                               and p.name.lower().endswith(DATA_SUFFIXES)
                               and not any(part.startswith(".") for part in p.relative_to(path).parts))
                if len(files) > MAX_DATA_FILES:
                    continue
                digest = hashlib.sha256()
                for p in files:  # a folder's files by their size and time alone: no read of a shard-per-file dataset
                    stat = p.stat()
                    digest.update(f"{p.relative_to(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
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
