"""`make plan ARGS="--time [--rows N] [--tokens-per-row T]"`: how long a run takes, from the dataset's size.

Steps as transformers 5.23's Trainer counts them (`num_update_steps_per_epoch` in trainer.py):
each rank's data loader has ceil(rows / (per-device batch x data-parallel GPUs)) micro-batches (accelerate shards one
sampler; the last batch is not dropped), an epoch is ceil(micro-batches / accumulation) optimizer steps, and
max_steps > 0 replaces epochs x that.

Tokens: rows x epochs x the mean tokens per row, each sequence cut at max_length (what the trainers truncate to; a
DPO pair runs 2 sequences, both a row's tokens, as make plan counts a micro-batch). Without a figure for the rows
(a hub dataset, no --tokens-per-row) the worst case is taken: every sequence max_length long.
Padding is not counted as work (the worst case includes it).

Time: per optimizer step the longer of compute (FLOPs at the assumed MFU) and communication
(fsdp_recipes.planning.comms), times the steps. The MFU is an assumption until a GPU run measures it; the run report's
`mfu` replaces it then (docs/run-report.md).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from fsdp_recipes.config import model_found
from fsdp_recipes.data import lengths
from fsdp_recipes.data.tokenizing import Truncation
from fsdp_recipes.errors import UserError
from fsdp_recipes.train import kinds


SAMPLE = 1000  # rows tokenized for the mean length


@dataclasses.dataclass(frozen=True)
class Data:
    rows: int
    tokens_per_row: float  # mean, already capped at max_length
    source: str  # where the figures come from, for the report


@dataclasses.dataclass(frozen=True)
class Duration:
    steps: int
    tokens: int
    seconds: float | None
    step_seconds: float | None


def steps(rows: int, micro_batch: int, data_parallel: int, accumulation: int, epochs: float, max_steps: int) -> int:
    if max_steps > 0:
        return max_steps
    batches = math.ceil(rows / (micro_batch * data_parallel))
    per_epoch = max(batches // accumulation + int(batches % accumulation > 0), 1)
    return math.ceil(epochs * per_epoch)


def estimate(data: Data, step_count: int, rows_read: int, flops_per_token: float, world: int,
             peak: float | None, mfu: float, comm_per_step_s: float, exposed_per_step_s: float = 0.0) -> Duration:
    """Tokens the run trains on and its wall-clock time: per step max(compute, communication) plus the communication
    that compute waits for (tensor parallel's, comms.py), times steps."""
    tokens = int(round(rows_read * data.tokens_per_row))
    if not peak:
        return Duration(step_count, tokens, None, None)
    compute_per_step = (tokens / step_count) * flops_per_token / (world * peak * mfu)
    per_step = max(compute_per_step, comm_per_step_s) + exposed_per_step_s
    return Duration(step_count, tokens, per_step * step_count, per_step)


def rows_seen(rows: int, epochs: float, max_steps: int, global_batch: int) -> int:
    """Rows the run reads: the dataset x epochs, or max_steps x the global batch."""
    return max_steps * global_batch if max_steps > 0 else int(math.ceil(rows * epochs))


def local_stats(cfg, max_length: int) -> Data | None:
    """Rows and mean tokens per row of the recipe's own local dataset, tokenized with its local model's tokenizer as
    the trainer tokenizes them (data/lengths.py, by the rows' layout: a pair counts both its sequences, as the
    policy runs over both); None when the dataset is not local."""
    if not (cfg.script.dataset_name and model_found.looks_local(cfg.script.dataset_name)):
        return None
    import datasets

    datasets.disable_progress_bars()
    kind = kinds.load(cfg.trainer)
    train, _ = kind.load_datasets(cfg, want_eval=False)
    if not model_found.looks_local(cfg.model.model_name_or_path):  # every sequence max_length: a pair's two
        return Data(len(train), float(max_length * kind.SEQUENCES_PER_ROW), f"{len(train):,} rows from "
                    f"{cfg.script.dataset_name}; tokens per row unknown (hub model): max_length a sequence assumed")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.model_name_or_path)
    # a spread sample, not the first rows (a file sorted by length would mislead); seconds for the chat template
    step = max(1, len(train) // SAMPLE)
    sample = train.select(range(0, len(train), step)) if len(train) else train
    measured = lengths.measure(sample, tok, "train", Truncation.of(cfg.training), sample=len(sample))
    if measured is None:
        raise UserError(f"the rows of {cfg.script.dataset_name} are in no layout the pack measures (messages, prompt "
                        "+ completion, a text field, preference pairs). Fix: --tokens-per-row N.")
    counts = [row_tokens(measured, i, max_length) for i in range(measured.sampled)]
    mean = statistics.fmean(counts) if counts else 0.0
    of = "every row" if step == 1 else f"every {step}th row"
    longest = max(counts, default=0)
    return Data(len(train), mean, f"{len(train):,} rows from {cfg.script.dataset_name}, {mean:,.1f} tokens per row on "
                                  f"average over {of} (max {longest:,}, cut at max_length {max_length:,})")


def row_tokens(measured: lengths.Lengths, i: int, max_length: int) -> int:
    """Tokens the model runs over for measured row i: each of its sequences (prompt + answer; a pair has two) cut at
    max_length (the trainers truncate each sequence), or its prompt where the answers are generated."""
    names = measured.answer_names
    if not names:
        return min(measured.prompt[i], max_length)
    return sum(min(measured.prompt[i] + measured.answers[name][i], max_length) for name in names)
