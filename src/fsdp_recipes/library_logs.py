"""Library log records and warnings that tell a user nothing they can act on. Each process of the pack sends them to
its log instead of the console: the ranks to their rank log (train/console.py), the launcher nowhere (every rank's
log holds the same record). The log filters are installed before the library is imported, since the record below
is written while its module imports; a filter on a logger that does not exist yet is kept by logging until the
library asks for that logger.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

LOG_ONLY_RECORDS = [
    # bitsandbytes 0.50 (checked on 0.50.2), which peft imports whenever it is installed: on a CPU with AVX-512 BF16
    # its CPU backend tries at import to fetch a kernel from the hub (kernels-community), logs this when it cannot,
    # and uses its own; the pack turns that packed-weight path off for every 4-bit layer (speed/four_bit.py).
    # Its advice, `pip install kernels`, would make the import download from the hub.
    ("bitsandbytes.backends.cpu.ops", r"^Failed to load CPU gemm_4bit_forward from kernels-community"),
    # transformers 5.23's Trainer under a cp mesh (speed/context_parallel.py): its own CP inputs, made as designed
    # from every batch TRL's collator gives it (which has neither); nothing a recipe can set
    ("transformers.trainer", r"^(Shift labels|Position IDs) not found in the inputs"),
    # transformers 5.23, rotating checkpoints saved under a second apart (a smoke run's, a tiny model's): it orders
    # them by their number and blames the file system, which is fine
    ("transformers.trainer_utils", r"^mtime may not be reliable on this filesystem"),
]

# Upstream warnings (the warnings module, not logging) of the same sort, matched by category and message: every other
# warning still reaches the console. The ranks send them to their log (train/console.py); the summary's scoring,
# which wraps the 4-bit base in the run's adapter, drops them (evaluation/scoring.py). Each says whose it is.
LOG_ONLY_WARNINGS = [
    # peft's PeftModel (0.21) reads the property transformers 5.x deprecated, once per adapter it wraps
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    # TRL's unwrap_model_for_generation (1.16) turns checkpointing off and on around every GRPO generation, by the
    # names transformers 5.x deprecated
    (FutureWarning, r"`gradient_checkpointing_(en|dis)able` is deprecated"),
    # peft 0.21 on a tied model whose head or embedding the adapter changes: it asks for ensure_weight_tying, which
    # no recipe can set (TRL's LoraConfig); the pack's merge unties such a model (train/final_save.py)
    (UserWarning, r"Model has `tie_word_embeddings=True` and a tied layer is part of the adapter"),
    # torch 2.13's DeviceMesh, when accelerate 1.15 slices the flattened dp_shard x cp dimension it shards FSDP over
    # (a parallelism_config with cp): accelerate's bookkeeping to change, not the recipe's
    (UserWarning, r"Slicing a flattened dim from root mesh will be deprecated"),
    # torch 2.13's FSDP1, when accelerate 1.15 saves or loads an FSDP1 model's state dict (every checkpoint and the
    # final save of an FSDP1 recipe: 6 times in a 3-step smoke run)
    (FutureWarning, r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\) are being deprecated"),
    # peft 0.21 on GPT-2's Conv1D layers: it sets fan_in_fan_out itself, which TRL's ModelConfig cannot set
    (UserWarning, r"fan_in_fan_out is set to False but the target module is `Conv1D`"),
]


class Diverted(logging.Filter):
    """Hands a matching record's text to `sink` and keeps it from every handler."""

    def __init__(self, pattern: str, sink: Callable[[str], None]) -> None:
        super().__init__()
        self.pattern, self.sink = re.compile(pattern), sink

    def filter(self, record: logging.LogRecord) -> bool:
        try:  # logging does not guard filters: an error here would break the import that logs
            message = record.getMessage()
            if not self.pattern.search(message):
                return True
            self.sink(f"{record.levelname} {record.name}: {message}")
            return False
        except Exception:  # noqa: BLE001  the record then goes on as logging would send it
            return True


def divert(sink: Callable[[str], None]) -> None:
    """From now on LOG_ONLY_RECORDS go to `sink(text)` instead of the console; once per process (a second call
    keeps the first sink)."""
    for name, pattern in LOG_ONLY_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, Diverted) for f in logger.filters):
            logger.addFilter(Diverted(pattern, sink))
