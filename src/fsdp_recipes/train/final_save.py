"""The end of a completed run on every rank: the final model or adapter saved, checked against the weights in memory
(checkpoint/save_check.py), and optionally merged (rank 0).
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_recipes import model_folders
from fsdp_recipes.checkpoint.save_check import (
    save_state_dict,
    verified_line,
    verify_against_memory,
    verify_final_save,
    without_tied_copies,
)
from fsdp_recipes.checkpoint.sharded_save import reshard_fsdp2, save_full_model_distributed, trainable_state_dict
from fsdp_recipes.config.run_config import RunConfig
from fsdp_recipes.dist import gather_objects
from fsdp_recipes.metrics.rss_watch import RssRise
from fsdp_recipes.speed import four_bit
from fsdp_recipes.train import tensor_parallel


def save_final(trainer, cfg: RunConfig, peft_config, report) -> None:
    """The final model or adapter, checked against the weights in memory (save_check.py), and optionally merged."""
    training, model_args, pack = cfg.training, cfg.model, cfg.pack
    out = training.output_dir
    sharded = trainer.is_fsdp_enabled and "SHARDED" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
    check_kwargs, checked_in_save = {}, False
    if trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2:
        reshard_fsdp2(trainer.model)  # whatever ran last without a backward (sharded_save.py says why)
    with RssRise() as saving:  # each rank's host-memory rise while saving, then while checking (rss_watch.py)
        if tensor_parallel.active(trainer.model):  # sharded by transformers at load time: its save, checked there
            report.final_save_check = tensor_parallel.save_and_check(trainer, out, peft_config is not None)
            checked_in_save = True
        elif not trainer.is_fsdp_enabled:
            trainer.save_model(out)
        elif peft_config is not None and trainer.accelerator.is_fsdp2:
            # LoRA under FSDP2, FULL or SHARDED: gather only the trainable tensors, one at a time. The Trainer's
            # FULL_STATE_DICT save gathers the whole model, frozen base included, on rank 0 to keep the adapter
            # (make bench-loading, 394 MiB model: rank 0 rose 183 MiB that way, 6 MiB this way).
            adapter = trainable_state_dict(trainer)
            save_state_dict(trainer, out, adapter)  # a copy: the check below reuses `adapter`
            check_kwargs = dict(full=adapter, gathered=True)
        elif not sharded or not trainer.accelerator.is_fsdp2:
            # FULL_STATE_DICT, and FSDP1 (flat parameters, no DTensors) in any case: gather on rank 0 as
            # Trainer.save_model does, save, and check against that same gathered copy. Gathering again for the
            # check held the model twice on rank 0 (make bench-loading, 394 MiB model: total RSS rose 561 MiB in it).
            full = without_tied_copies(trainer.accelerator.unwrap_model(trainer.model),
                                       trainer.accelerator.get_state_dict(trainer.model))
            save_state_dict(trainer, out, full)  # a copy: save_pretrained empties the dict it is given
            check_kwargs = dict(full=full, gathered=True)
        else:  # full fine-tuning, FSDP2, SHARDED_STATE_DICT: never gather the model
            report.final_save_check = save_full_model_distributed(trainer, out)  # checks each rank's shards
            checked_in_save = True  # on every rank (the result may be rank 0's only)
    with RssRise() as checking:
        if not checked_in_save:
            check = verify_final_save(trainer, out, **check_kwargs)  # rank 0; raises when incomplete
            compared_with = verify_against_memory(trainer.model, out, trainer.accelerator.is_main_process)
            report.final_save_check = check and {**check, "compared_with": compared_with}
    report.final_save_rss = gather_objects({"save": saving.rise_bytes, "check": checking.rise_bytes})
    if report.final_save_check:
        print(f"[train] {verified_line(report.final_save_check)}", flush=True)
    if peft_config is not None and pack.save_merged_model:
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            save_merged(model_args.model_name_or_path, training.output_dir,
                        os.path.join(training.output_dir, "merged"), model_args)
    trainer.accelerator.wait_for_everyone()


def save_merged(base_path: str, adapter_dir: str, out_dir: str, model_args) -> None:
    """Rank 0: reload base + saved adapter with plain transformers/peft (no FSDP), merge, save. A 4-bit run's base is
    the 4-bit one dequantised to the compute dtype (speed/four_bit.py says why), not the original weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if four_bit.recorded(model_args):
        base = four_bit.load_4bit(base_path, model_args, dequantise=True)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=model_args.dtype)
    adapted = PeftModel.from_pretrained(base, adapter_dir)
    untie_adapted_embeddings(adapted)
    merged = adapted.merge_and_unload()
    # adapter files left in merged/ (an earlier run's, a copy's) would make transformers apply an adapter on top of
    # the merged weights (model_folders.py): merged/ holds the merged model alone
    stale = model_folders.adapter_files(Path(out_dir))
    for name in stale:
        (Path(out_dir) / name).unlink()
    if stale:
        print(f"[train] {out_dir}: removed {', '.join(stale)} found there before the merge (transformers would have "
              "applied that adapter on top of the merged weights)", flush=True)
    merged.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)
    mixed = model_folders.adapter_beside_weights(Path(out_dir))
    if mixed:  # nothing the merge writes is an adapter file: a library that starts writing one is caught here
        raise RuntimeError(f"the merged model's folder is not a plain model: {mixed}")


def untie_adapted_embeddings(adapted) -> bool:
    """A tied model (tie_word_embeddings) whose LM head or input embedding the adapter changes (a LoRA target, a trained
    copy) is merged untied: the head and the embedding share one tensor, and PEFT's merge adds the LoRA update of one
    to that tensor in place, so the other changed too and the merged model's logits were not the trained model's
    (measured on a tiny tied Llama, issue 61: up to 10 apart with lm_head a LoRA target, 83 with embed_tokens). The
    head gets its own copy first, PEFT's own advice in its merge warning; the merged config then says untied, as it
    does after a merge of a trained head copy. Whether it untied."""
    import torch

    from fsdp_recipes.patches.peft_fsdp import unwrapped

    inner = adapted.get_base_model()
    if not getattr(inner.config, "tie_word_embeddings", False):
        return False
    head, embedding = inner.get_output_embeddings(), inner.get_input_embeddings()
    if head is None or embedding is None or (head is unwrapped(head) and embedding is unwrapped(embedding)):
        return False
    base_head = unwrapped(head)
    if base_head.weight is not unwrapped(embedding).weight:
        return False
    base_head.weight = torch.nn.Parameter(base_head.weight.detach().clone(), requires_grad=False)
    inner.config.tie_word_embeddings = False
    return True
