"""The architecture matrix's checks of a trained case (scripts/arch_matrix.py), on rank 0 with plain transformers and
PEFT, no process group: the saved model's logits against the sharded model's, the merge's against base + adapter,
the logits moved from the base model's, a resumed run's losses against the uninterrupted run's. Where each case's
runs are written (case_dir, resumed_dir)."""

from __future__ import annotations

import json
from pathlib import Path

import arch_families

# |a - b| <= ATOL + RTOL * |b|, elementwise over the float32 logits: a reload gives the same bits, a merge reorders
# the sums (measured: at most 6e-7 apart)
ATOL, RTOL = 1e-4, 1e-4
MIN_CHANGE = 1e-3  # trained against base: at least this far apart somewhere, else the save may be the untrained model


def case_dir(out: Path, family, method: str) -> Path:
    return out / "runs" / family.name / method


def close(a, b, what: str) -> float:
    """The largest difference; raises when any logit is outside the stated tolerance."""
    diff = (a - b).abs()
    if not bool((diff <= ATOL + RTOL * b.abs()).all()):
        raise AssertionError(f"{what}: logits differ by up to {diff.max().item():.3g} (tolerance {ATOL:g} + {RTOL:g}|x|)")
    return float(diff.max())


def reload_checks(family, method: str, out: Path, batch: dict, trained) -> str:
    """Rank 0, plain transformers and PEFT: the saved model against the sharded one, the merge against base + adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=family.attn)
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if model.config.tie_word_embeddings and head is not None and head.weight is not embedding.weight:
            raise AssertionError(f"{path}: tie_word_embeddings, but the reloaded head is not the input embedding")
        return model.eval()

    def logits(model):
        with torch.no_grad():
            return model(**batch).logits

    run = case_dir(out, family, method)
    base = logits(load(out / "models" / family.name))
    if method == "full":
        reloaded = logits(load(run))
        notes = [f"reload {close(reloaded, trained, 'from_pretrained against the trained model'):.1g}"]
    else:
        reloaded = logits(PeftModel.from_pretrained(load(out / "models" / family.name), run).eval())
        merged = load(run / "merged")
        notes = [f"adapter {close(reloaded, trained, 'base + adapter against the trained model'):.1g}",
                 f"merged {close(logits(merged), reloaded, 'the merged model against base + adapter'):.1g}"]
        if method == "head" and merged.config.tie_word_embeddings:
            raise AssertionError("the merged model of a trained head still ties it to the input embedding")
    if method == "lora" and "--lora_target_parameters" in family.args:
        losses = [e["loss"] for e in json.loads((run / "log_history.json").read_text())["log_history"] if "loss" in e]
        if not losses[-1] < losses[0]:
            raise AssertionError(f"the loss did not fall: {losses}")
        notes.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                     + arch_families.expert_merge(out / "models" / family.name, run, ATOL))
    change = float((reloaded - base).abs().max())
    if change < MIN_CHANGE:
        raise AssertionError(f"the saved model's logits are the base model's (max change {change:.2g}): not trained")
    return ", ".join(notes) + f"; trained vs base {change:.2g}" + (f"; {family.note}" if family.note else "")


def resumed_dir(out: Path, family, method: str) -> Path:
    return out / "runs" / family.name / f"{method}-resumed"


def logged_losses(run: Path) -> dict[int, float]:
    history = json.loads((run / "log_history.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def resume_check(straight: Path, resumed: Path, step: int) -> str:
    """Rank 0: the resumed run's per-step losses are the uninterrupted run's (the steps after `step` trained again)."""
    a, b = logged_losses(straight), logged_losses(resumed)
    if sorted(a) != sorted(b) or not any(s > step for s in b):
        raise AssertionError(f"the resumed run logged steps {sorted(b)}, the uninterrupted one {sorted(a)}")
    worst = max(abs(a[s] - b[s]) for s in a)
    if any(abs(a[s] - b[s]) > 1e-5 + 1e-4 * abs(a[s]) for s in a):
        raise AssertionError(f"resumed from checkpoint-{step}, the losses differ by up to {worst:.3g}: "
                             f"{[a[s] for s in sorted(a)]} against {[b[s] for s in sorted(b)]}")
    return f"resumed from checkpoint-{step}: steps {step + 1}-{max(a)} within {worst:.1g}"
