"""Counting the tokens a run trains on (non-padding, padded, sequences, squared lengths for attention FLOPs);
the entry point's trainer feeds it every micro-batch and the run report reads it.
"""

from __future__ import annotations

COUNTS = ("non_padding", "padded", "sequences", "squared_lengths", "generated")


class TokenCounter:
    """Per-rank counts of what the model was fed; summed over ranks when the run ends.

    `squared_lengths` is the sum of n^2 over the sequences' real lengths n: attention's work per token grows with
    the length of the sequence the token is in, so its per-token average is sum(n^2) / sum(n), the token-weighted
    mean length, not the mean length (on the GPU ladder's data: 1,971 against 1,126 tokens).

    What needs the batch's values (mask sums, sequence starts) is added up where the batch lives, on the GPU in a
    GPU run, and read back only when a count is read (at a training log, a save, the end): reading it at every
    micro-batch would block the host until the GPU had drained its queue, one synchronisation per micro-batch.
    What the shapes tell is counted on the host at once."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start counting from zero (the GPU ladder leaves its warm-up steps out this way)."""
        self._host = dict.fromkeys(COUNTS, 0)
        self._on_device = None  # int64 [non_padding, sequences, squared_lengths, generated] not yet read back

    def add(self, inputs: dict) -> None:
        import torch

        ids = inputs["input_ids"]
        self._host["padded"] += ids.numel()
        mask, pos = inputs.get("attention_mask"), inputs.get("position_ids")
        if mask is not None:  # padded rows: one sequence each, of its mask's length
            lengths = mask.reshape(ids.shape[0], -1).sum(dim=-1, dtype=torch.int64)
            self._host["sequences"] += ids.shape[0]
            self._add_on_device(lengths.sum(), None, (lengths * lengths).sum())
        elif pos is not None:  # padding-free: one row holds several sequences, each restarting at position 0;
            # over a sequence of length n, sum(2p + 1) for p = 0..n-1 is n^2, so no boundaries need finding
            self._host["non_padding"] += ids.numel()
            self._add_on_device(None, (pos == 0).sum(), (2 * pos.to(torch.int64) + 1).sum())
        else:
            self._host["non_padding"] += ids.numel()
            self._host["sequences"] += ids.shape[0]
            self._host["squared_lengths"] += ids.shape[0] * ids.shape[-1] ** 2

    def add_sampled(self, batch: dict, generated: bool = True) -> None:
        """An RL step's batch (GRPO): prompt and sampled completion side by side, each with its mask. The trained
        sequence is the two together; the completion's tokens are also counted as `generated` (`generated`: the
        batch's first training pass; GRPO's num_iterations trains on it again without sampling it again)."""
        import torch

        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        self.add({"input_ids": ids, "attention_mask": torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)})
        if generated:
            self._add_on_device(None, None, None, batch["completion_mask"].sum(dtype=torch.int64))

    def _add_on_device(self, non_padding, sequences, squared, generated=None) -> None:
        import torch

        values = (non_padding, sequences, squared, generated)
        given = next(v for v in values if v is not None)
        zero = torch.zeros((), dtype=torch.int64, device=given.device)
        step = torch.stack([zero if v is None else v.to(torch.int64) for v in values])
        self._on_device = step if self._on_device is None else self._on_device + step  # queued, not waited for

    def counts(self, host_only: bool = False) -> dict[str, int]:
        """All the counts (COUNTS); reads the device's share back (one synchronisation) if there is any.
        `host_only`: leave it out (after a failure, when the device may no longer answer)."""
        if self._on_device is not None and not host_only:
            non_padding, sequences, squared, generated = self._on_device.tolist()
            self._on_device = None
            self._host["non_padding"] += non_padding
            self._host["sequences"] += sequences
            self._host["squared_lengths"] += squared
            self._host["generated"] += generated
        return dict(self._host)

    @property
    def non_padding(self) -> int:
        return self.counts()["non_padding"]

    @property
    def padded(self) -> int:
        return self._host["padded"]

    @property
    def sequences(self) -> int:
        return self.counts()["sequences"]

    @property
    def squared_lengths(self) -> int:
        return self.counts()["squared_lengths"]

    @property
    def generated(self) -> int:
        return self.counts()["generated"]
