"""What a training step really holds, by the memory budget's components: the measurement `make plan`'s
estimate is checked against on CPU, where torch keeps no allocator statistics.

Gap it fills: torch.cuda.max_memory_allocated exists only on GPUs and counts everything in one number. On
any device this callback counts, on each rank, the bytes of the local parameter shards, of the gradients
just before the optimizer step, of the optimizer states after it, and of the tensors autograd saves for
backward during the first step (torch.autograd.graph.saved_tensors_hooks; distinct storages, parameters
excluded). Enabled by the recipe field `measure_memory: true`; writes `memory_probe.rank<N>.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import TrainerCallback


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


class MemoryProbeCallback(TrainerCallback):
    def __init__(self, model, output_dir: str, rank: int, token_counter=None):
        self.model, self.out, self.rank, self.counter = model, Path(output_dir), rank, token_counter
        self.result: dict = {}
        self.saved: dict[int, int] = {}
        self.hooks = None

    def _pack(self, t: torch.Tensor):
        # Linear layers save their weight (or its transpose, a view) for the input gradient: that is the
        # parameter's memory, counted under weights, not an activation.
        base = t._base if t._base is not None else t
        if not isinstance(base, torch.nn.Parameter):
            storage = t.untyped_storage()
            self.saved[storage.data_ptr()] = storage.nbytes()
        return t

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.result["weights"] = tensor_bytes((model or self.model).parameters())

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0 and self.hooks is None:
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self.hooks.__enter__()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.hooks:
            self.hooks.__exit__(None, None, None)
            self.hooks = False  # measured once
            # Saved tensors of all micro-batches were counted; one micro-batch's set is alive at a time.
            micro_batches = max(args.gradient_accumulation_steps, 1)
            self.result["activations"] = sum(self.saved.values()) // micro_batches
            if self.counter is not None:  # padded tokens per micro-batch: what the activations scale with
                self.result["tokens_per_micro_batch"] = self.counter.padded // micro_batches
        if "gradients" not in self.result:
            self.result["gradients"] = tensor_bytes(p.grad for p in (model or self.model).parameters())

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if "optimizer_states" not in self.result and optimizer is not None:
            states = [v for s in optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0]  # not the scalar step counters
            self.result["optimizer_states"] = tensor_bytes(states)
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"memory_probe.rank{self.rank}.json").write_text(json.dumps(self.result, indent=2))
