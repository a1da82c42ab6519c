"""Turn a sharded (DCP) checkpoint into an inference-ready model directory or PEFT adapter, on CPU.

    python -m fsdp_recipes.checkpoint.export runs/x/checkpoint-200 exported/      # make export CKPT=... OUT=...

A checkpoint saved with `fsdp_state_dict_type: SHARDED_STATE_DICT` holds one `.distcp` file per rank in
`pytorch_model_fsdp_0/`. torch.distributed.checkpoint reads those in a single process without a process group
or a GPU. What the checkpoint belongs to comes from the pack's `checkpoint_identity.json`: for LoRA the whole
adapter config, for full fine-tuning the model whose config.json describes the architecture (`--model`
overrides it). The written files are then read back and compared with the checkpoint's tensors.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from pathlib import Path

from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.model_folders import adapter_files, full_weights

MODEL_DIR = "pytorch_model_fsdp_0"


def load_sharded(ckpt: Path) -> dict:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    # Private in torch 2.13, and the one call that loads every key of a DCP checkpoint without a template.
    state = _load_state_dict_from_keys(checkpoint_id=str(ckpt / MODEL_DIR))
    return state.get("model", state)


def export(ckpt: Path, out: Path, model_override: str | None = None) -> dict:
    from fsdp_recipes.checkpoint.markers import IDENTITY
    from fsdp_recipes.checkpoint.save_check import compare, read_saved

    if not (ckpt / MODEL_DIR / ".metadata").is_file():
        hint = " It already holds a loadable model or adapter." if any(ckpt.glob("*.safetensors")) else ""
        raise UserError(f"{ckpt} is not a sharded checkpoint (no {MODEL_DIR}/.metadata).{hint} "
                        "Fix: pass a checkpoint-N folder saved with fsdp_state_dict_type: SHARDED_STATE_DICT.")
    ident_file = ckpt / IDENTITY
    ident = json.loads(ident_file.read_text()) if ident_file.is_file() else {}
    model_ref = model_override or ident.get("model")
    refuse_taken(out, ckpt, adapter=bool(ident.get("peft_config")))
    with warnings.catch_warnings():  # DCP's loader in one process: "torch.distributed is unavailable or uninitialized"
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
        tensors = {k: v.contiguous() for k, v in load_sharded(ckpt).items()}
    out.mkdir(parents=True, exist_ok=True)
    if ident.get("peft_config"):
        from safetensors.torch import save_file

        adapter_config = dict(ident["peft_config"], base_model_name_or_path=model_ref)
        (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not model_ref:
            raise UserError(f"exporting {ckpt} needs the model config, and the checkpoint does not name its model "
                            f"(no {IDENTITY}). Fix: --model <directory with config.json, or hub id>.")
        try:
            config = AutoConfig.from_pretrained(model_ref)
        except OSError:
            raise UserError(f"exporting {ckpt} needs the model config, and {model_ref} has none here. "
                            "Fix: --model <directory with config.json, or hub id>.") from None
        import torch

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(out, state_dict=dict(tensors))  # save_pretrained consumes the dict it is given
    if model_ref and Path(model_ref).is_dir():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (Path(model_ref) / name).is_file():
                shutil.copy(Path(model_ref) / name, out / name)
    return compare(tensors, read_saved(out), check_lora_b=False)


def refuse_taken(out: Path, ckpt: Path, adapter: bool) -> None:
    """Before anything is read or written: OUT a file; OUT a run's output_dir (the export replaced the run's final
    weights with the checkpoint's, and a full model's left the run's index naming a shard it had removed); OUT
    holding a model or adapter already (another run's merged/ was replaced without a word)."""
    # beside the run, not in it: a checkpoint-N-exported folder in output_dir is a checkpoint to the Trainer's
    # rotation (save_total_limit) and to --overwrite_output_dir, which would delete it
    beside = ckpt.parent.parent / f"{ckpt.parent.name}-{ckpt.name}"
    fix = f"Fix: export into a new or empty folder, e.g. OUT={beside}"
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a folder to export into. {fix}.")
    if not out.is_dir():
        return
    if ((out / "run_args.json").is_file() or (out / "metrics.json").is_file()
            or any(re.fullmatch(r"checkpoint-\d+", p.name) for p in out.iterdir())):
        raise UserError(f"{out} is a run's output_dir: the export would replace the run's own final model with "
                        f"{ckpt.name}'s. {fix}.")
    refuse_a_second_kind(out, adapter)
    there = adapter_files(out) if adapter else full_weights(out)
    if there:
        raise UserError(f"{out} already holds {'a LoRA adapter' if adapter else 'a full model'} "
                        f"({', '.join(there)}), which the export would replace. {fix}.")


def refuse_a_second_kind(out: Path, adapter: bool) -> None:
    """An adapter written beside a full model, or a model beside an adapter, makes a folder transformers loads as
    the model with the adapter applied on top (model_folders.py): refused before anything is written."""
    there = full_weights(out) if adapter else adapter_files(out)
    if there:
        this, other = ("a LoRA adapter", "a full model") if adapter else ("a full model", "a LoRA adapter")
        raise UserError(f"{out} already holds {other} ({', '.join(there)}); writing {this} beside it makes a folder "
                        "that transformers' from_pretrained loads as the model with the adapter applied on top. "
                        "Fix: export into an empty folder (OUT=<new folder>).")


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", help="the base model (directory or hub id) when the checkpoint does not name it")
    args = ap.parse_args(argv)
    if not args.checkpoint.is_dir():
        raise UserError(f"checkpoint not found: {args.checkpoint}. Fix: CKPT=<output_dir>/checkpoint-N.")
    result = export(args.checkpoint, args.out, args.model)
    print(f"[export] {args.out}: {result['tensors']} tensors written and verified against {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
