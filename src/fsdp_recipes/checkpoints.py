"""Which checkpoints are complete, and which one a relaunched run resumes from.

Gap this fills: transformers' `get_last_checkpoint` returns the newest `checkpoint-N` folder even when a kill
during saving left it half written, and resuming from it fails or silently loads partial state. Here a
checkpoint counts only once every rank has finished writing it: `CompletionMarkerCallback` waits for all
ranks in `on_save` and then rank 0 writes a marker file into the folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from transformers import TrainerCallback

MARKER = "checkpoint_complete"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """checkpoint-N folders, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def is_complete(ckpt: Path) -> bool:
    return (ckpt / MARKER).is_file()


def latest_complete(output_dir: str | Path) -> Path | None:
    complete = [p for p in checkpoint_dirs(output_dir) if is_complete(p)]
    return complete[-1] if complete else None


def incomplete(output_dir: str | Path) -> list[Path]:
    return [p for p in checkpoint_dirs(output_dir) if not is_complete(p)]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CompletionMarkerCallback(TrainerCallback):
    """Mark `checkpoint-<step>` complete once all ranks have returned from saving it."""

    def on_save(self, args, state, control, **kwargs):
        _barrier()  # every rank has finished its part of the checkpoint
        if int(os.environ.get("RANK", 0)) == 0:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                (ckpt / MARKER).write_text(f"{state.global_step}\n")
