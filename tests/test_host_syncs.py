"""The pack's own work in every training step makes the host wait for nothing.

What the pack runs per step: the token counter on every micro-batch (ReportingSFTTrainer.training_step), then the
run report's and the preemption callback's on_step_end. On a GPU, `.tolist()` or `.item()` on a device tensor
blocks the host until the GPU has drained its queue, and a blocking collective makes every rank wait for the
slowest. CPU tensors cannot show the stall, so these tests count the calls that would cause it, made from the
pack's own code, in a one-process gloo group: reads of any tensor computed from the batch (which a GPU run holds on
the GPU; marked here by a tensor subclass that every result of an operation on it inherits), and collectives that
block. Before this was fixed: 2 per micro-batch-pair step (the counter's
`.tolist()` per micro-batch, the preemption flag's all-reduce and its `.tolist()`), and one blocking collective.

Not counted here: the non-finite-loss check in ReportingSFTTrainer.training_step reads each micro-batch's loss. The
Trainer reads that same loss just before it (`logging_nan_inf_filter`, on by default), so the GPU has already
drained its queue and the pack's read waits for nothing more.
"""

import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import TrainerControl, TrainerState, TrainingArguments

from fsdp_recipes import dist as pack_dist
from fsdp_recipes.metrics.run_report import RunReportCallback
from fsdp_recipes.metrics.tokens import TokenCounter
from fsdp_recipes.train.preemption import PreemptionCallback

PACK_SRC = str(Path(pack_dist.__file__).parent)


class OnDevice(torch.Tensor):
    """A batch tensor, and everything computed from it, as a GPU run would hold it on the GPU."""


def from_pack() -> bool:
    """Is the caller of the wrapped function (two frames up) the pack's own code?"""
    return sys._getframe(2).f_code.co_filename.startswith(PACK_SRC)


@pytest.fixture
def host_waits(monkeypatch):
    """Counts, by kind, the calls from the pack's code that would make a GPU run's host wait."""
    counts = {"tolist": 0, "item": 0, "blocking_collective": 0}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            if isinstance(self, OnDevice) and from_pack():
                counts[name] += 1
            return original(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch.Tensor, "tolist", counting("tolist", torch.Tensor.tolist))
    monkeypatch.setattr(torch.Tensor, "item", counting("item", torch.Tensor.item))
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, async_op=False, **kwargs):
        if not async_op and from_pack():
            counts["blocking_collective"] += 1
        return all_reduce(tensor, *args, async_op=async_op, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    return counts


def on_device(batch: dict) -> dict:
    return {k: v.as_subclass(OnDevice) for k, v in batch.items()}


def padded_batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return on_device({"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask})


def packed_batch():
    return on_device({"input_ids": torch.zeros(1, 7, dtype=torch.long),
                      "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]])})


def run_steps(tmp_path, steps: int, signal_before_step: int | None = None):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    state, control = TrainerState(), TrainerControl()
    report = RunReportCallback(tmp_path, resolved_args={}, recipe="test")
    preemption = PreemptionCallback(report)
    stopped_at = None
    try:
        for step in range(1, steps + 1):
            for batch in (padded_batch(), packed_batch()):  # two micro-batches of one step
                report.tokens.add(batch)
            if step == signal_before_step:
                preemption._handler(signal.SIGTERM, None)
            state.global_step = step
            report.on_step_end(args, state, control)
            control = preemption.on_step_end(args, state, control)
            if control.should_training_stop:
                stopped_at = step
                break
        preemption.on_train_end(args, state, control)
    finally:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
    return report, stopped_at


def test_no_host_wait_in_the_pack_per_step(world_of_one, tmp_path, host_waits):
    report, _ = run_steps(tmp_path, steps=5)
    assert host_waits == {"tolist": 0, "item": 0, "blocking_collective": 0}
    # the counts, read once at the end: padded rows of 3 and 2 tokens, a packed row of 3 + 2 + 2 tokens, 5 steps
    assert report.tokens.counts() == {"non_padding": 5 * (5 + 7), "padded": 5 * (8 + 7), "sequences": 5 * (2 + 3),
                                      "squared_lengths": 5 * (9 + 4 + 9 + 4 + 4), "generated": 0}  # nothing sampled


def test_a_signal_stops_every_rank_one_step_later(world_of_one, tmp_path, host_waits):
    report, stopped_at = run_steps(tmp_path, steps=10, signal_before_step=3)
    assert stopped_at == 4  # seen at step 3's end; the combined flag is read at step 4's
    assert host_waits["blocking_collective"] == 0


def test_reading_the_counts_is_one_read_back(world_of_one, tmp_path, host_waits):
    counter = TokenCounter()
    for _ in range(4):
        counter.add(padded_batch())
    assert host_waits["tolist"] == 0
    assert counter.counts()["non_padding"] == 4 * 5
    assert host_waits["tolist"] == 1


def test_a_pure_nccl_group_gets_one_gloo_group_for_host_numbers(monkeypatch):
    created = []
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda **kw: created.append(kw) or "gloo-group")
    monkeypatch.setattr(pack_dist, "_HOST_GROUP", None)
    assert pack_dist.host_group() == "gloo-group" and pack_dist.host_group() == "gloo-group"
    assert created == [{"backend": "gloo"}]  # once, and gloo


@pytest.mark.parametrize("backend", ["gloo", "cuda:nccl,cpu:gloo"])
def test_a_group_with_gloo_is_used_as_it_is(monkeypatch, backend):
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: backend)
    monkeypatch.setattr(dist, "new_group", lambda **kw: pytest.fail("no new group is needed"))
    assert pack_dist.host_group() is None  # None: the default group
