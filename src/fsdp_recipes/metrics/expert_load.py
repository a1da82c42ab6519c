"""Expert load of a mixture of experts: how many tokens each routed expert of each layer received during training.

A router that sends most tokens to a few experts trains those and starves the rest; the load-balancing loss
(router_aux_loss_coef, TRL's SFTConfig) pushes against that, and this is what it achieved. A forward hook on every
router (`mlp.gate`: transformers 5's Qwen3MoeTopKRouter / MixtralTopKRouter return (logits, scores, indices)) adds the
experts it chose to a per-layer count on the device (a bincount: no host sync); the counts are summed over the ranks
once, at the end of training, and the run report (metrics.json `expert_load`) gives per layer the tokens routed, the
busiest expert's count over the mean (1.0: perfectly even) and the experts that received nothing.

What is counted: every position of the training forwards, padding included (the router sees it, and so does the
load-balancing loss without an attention mask); not the forward that activation checkpointing recomputes during the
backward (the hooks count only inside the model's own forward), not evaluation. A resumed run counts from its resume.
Each layer's counts sum to its positions x top_k.
"""

from __future__ import annotations

from transformers import TrainerCallback

from fsdp_recipes.dist import all_reduce
from fsdp_recipes.metrics import flops


def routers_of(model) -> list[tuple[int, object]]:
    """(layer index, router module) of each sparse layer: the `gate` beside an `experts` module. Layers a model
    keeps dense (Qwen3-MoE's mlp_only_layers) have none."""
    found = []
    for name, module in model.named_modules():
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if gate is None or experts is None or not hasattr(gate, "weight"):
            continue
        parts = name.split(".")
        layer = next((int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()),
                     len(found))
        found.append((layer, gate))
    return found


def chosen_experts(output, top_k: int):
    """The expert indices a router chose, from its forward's output: transformers 5's routers return
    (logits, scores, indices); a router that returns its logits only (an nn.Linear gate) is read by top_k."""
    import torch

    if isinstance(output, (tuple, list)):
        indices = [t for t in output if torch.is_tensor(t) and not t.is_floating_point()]
        if indices:
            return indices[-1]
        output = output[0]
    return torch.topk(output, top_k, dim=-1).indices


class ExpertLoad(TrainerCallback):
    """Counts the experts each router chooses in the training forwards; `report()` gives metrics.json's expert_load."""

    def __init__(self, model, top_k: int, experts: int):
        self.top_k, self.experts = top_k, experts
        self.routers = routers_of(model)
        self.counts: dict[int, object] = {}  # layer -> (experts,) int64 tensor on the router's device
        self.counting = False
        self.totals: list[list[int]] | None = None  # summed over the ranks at the end of training
        self.handles = [model.register_forward_pre_hook(self.open_window),
                        model.register_forward_hook(self.close_window)]
        self.handles += [router.register_forward_hook(self.counter(layer)) for layer, router in self.routers]

    def open_window(self, module, args):
        self.counting = module.training  # evaluation forwards are not training load

    def close_window(self, module, args, output):
        self.counting = False  # what runs after the forward (checkpointing's recomputation) is not counted twice

    def counter(self, layer: int):
        def hook(module, args, output):
            if not self.counting:
                return
            import torch

            with torch.no_grad():
                chosen = chosen_experts(output, self.top_k).reshape(-1)
                counts = torch.bincount(chosen, minlength=self.experts)
                self.counts[layer] = counts if layer not in self.counts else self.counts[layer] + counts
        return hook

    def local_counts(self) -> list[list[int]]:
        return [[int(c) for c in self.counts[layer].tolist()] if layer in self.counts else [0] * self.experts
                for layer, _ in self.routers]

    def on_train_end(self, args, state, control, **kwargs):
        # a collective: every rank is here. One host sync for the whole run's counts.
        flat = all_reduce([c for layer in self.local_counts() for c in layer], "sum")
        self.totals = [[int(flat[i * self.experts + e]) for e in range(self.experts)] for i in range(len(self.routers))]
        for handle in self.handles:
            handle.remove()

    def report(self) -> dict:
        """metrics.json `expert_load`: all ranks' counts after training ended, else this rank's own (a failed run)."""
        counts, scope = (self.totals, "all_ranks") if self.totals is not None else (self.local_counts(), "rank0_only")
        layers = []
        for (layer, _), row in zip(self.routers, counts):
            routed = sum(row)
            mean = routed / self.experts
            layers.append({"layer": layer, "tokens": routed // self.top_k, "max": max(row), "mean": mean,
                           "max_over_mean": max(row) / mean if mean else None,
                           "idle_experts": [e for e, n in enumerate(row) if n == 0], "tokens_per_expert": row})
        ratios = [entry["max_over_mean"] for entry in layers if entry["max_over_mean"] is not None]
        return {"experts": self.experts, "top_k": self.top_k, "scope": scope,
                "max_over_mean": max(ratios) if ratios else None,
                "idle_experts": sum(len(entry["idle_experts"]) for entry in layers),
                "counted": "every position of the training forwards (padding included), top_k experts each",
                "layers": layers}


def attach(trainer, report) -> ExpertLoad | None:
    """For a mixture of experts (flops.experts_of): the counting callback, added to `trainer` and handed to the run
    report; None for a dense model."""
    moe = flops.experts_of(getattr(trainer.model, "config", None))
    if moe is None:
        return None
    load = ExpertLoad(trainer.model, *moe)
    if not load.routers:
        return None
    trainer.add_callback(load)
    report.expert_load = load
    return load
