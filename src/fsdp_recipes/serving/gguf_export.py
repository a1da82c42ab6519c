"""A run's merged model as one GGUF file for llama.cpp, Ollama and LM Studio, written with the `gguf` package (its
writer, tensor-name map and quantizers), not a copy of llama.cpp's converter script.

    python -m fsdp_recipes.serving.gguf_export runs/smollm2-135m-lora [--type f16|bf16|q8_0]   # make gguf RUN=...

Writes <run>/gguf/<name>.<type>.gguf and an Ollama Modelfile beside it (serving/modelfile.py). Nothing the run wrote
is touched. What it supports, and why each part is done as it is:
- Architectures: Llama (SmolLM2, Llama 3 without rope scaling) and Mistral as llama.cpp's `llama`, whose attention
  expects q_proj and k_proj rows in Meta's interleaved rotary order (transformers keeps them in halves, so they are
  permuted back, as llama.cpp's convert_hf_to_gguf.py LlamaModel.permute does); Qwen2 and Qwen3 as `qwen2`/`qwen3`
  (rotary in halves, NEOX: no permutation). Rope scaling (Llama 3.1's `llama3`) is refused in one line for now.
- Tokenizer: a byte-level BPE tokenizer.json (SmolLM2, Llama 3, Qwen) as llama.cpp's `gpt2` model with its merges;
  the pre-tokenizer's name, which llama.cpp otherwise finds by hashing a test string's tokens, comes from the model
  family (PRE_TOKENIZERS), and an unknown family is refused rather than guessed. A SentencePiece-style tokenizer
  (Mistral's byte-fallback BPE) goes through gguf's LlamaHfVocab as llama.cpp's `llama` model. Special tokens
  (bos, eos, pad, unk), the chat template and the add-bos flag come from gguf's SpecialVocab, which reads the
  folder's tokenizer_config.json and chat_template.jinja; added special tokens are CONTROL tokens, so llama.cpp
  stops at <|im_end|>.
- Tensors: 1-D ones (norms) in float32, as llama.cpp's converter keeps them; matrices in the chosen type. A tied LM
  head is written once, as the embedding (llama.cpp ties it back).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsdp_recipes import model_folders
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.serving import modelfile
from fsdp_recipes.speed import four_bit

TYPES = ("f16", "bf16", "q8_0", "f32")
# transformers architecture -> (gguf architecture name, q/k rows need Meta's interleaved rotary order)
ARCHITECTURES = {"LlamaForCausalLM": ("llama", True), "MistralForCausalLM": ("llama", True),
                 "Qwen2ForCausalLM": ("qwen2", False), "Qwen3ForCausalLM": ("qwen3", False)}
# llama.cpp's pre-tokenizer names (llama-vocab.cpp) for the byte-level BPE families this writer knows, by
# (model_type, vocab_size): SmolLM/SmolLM2, Llama 3, Qwen2/2.5/3, Mistral's tekken tokenizer (Nemo, Small 3: 131,072
# tokens; convert_hf_to_gguf.py names it so by Mistral-Nemo-Base-2407's hash). Mistral 7B v0.3 and Large 2411 are
# SentencePiece-style (32,768): no pre-tokenizer needed.
PRE_TOKENIZERS = {("llama", 49152): "smollm", ("llama", 128256): "llama-bpe", ("qwen2", None): "qwen2",
                  ("qwen3", None): "qwen2", ("mistral", 131072): "tekken"}


def pre_tokenizer(config: dict) -> str:
    key = (config.get("model_type"), config.get("vocab_size"))
    pre = PRE_TOKENIZERS.get(key) or PRE_TOKENIZERS.get((key[0], None))
    if pre is None:
        raise UserError(f"no known llama.cpp pre-tokenizer for a {key[0]} model with a {key[1]}-token byte-level BPE "
                        f"vocabulary. Fix: add its name to PRE_TOKENIZERS in fsdp_recipes/serving/gguf_export.py "
                        "(llama.cpp's convert_hf_to_gguf.py get_vocab_base_pre says which), or convert with llama.cpp.")
    return pre


def rope(config: dict) -> tuple[float, str | None]:
    """(rope theta, rope type): transformers 5 keeps them in `rope_parameters`, older configs in `rope_theta` and
    `rope_scaling`. (Reading only `rope_theta` wrote 10,000 for SmolLM2's 100,000: llama.cpp then answered 82 of the
    100 held-out questions against transformers' 93, caught by serving/engine_check.py.)"""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kinds = [params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")]
    return float(theta), next((k for k in kinds if k not in (None, "default")), None)


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
    it, GPTQ, AWQ) holds packed weights and their scales (`weight.absmax`, `weight.quant_map`, ...), which have no
    GGUF name: one line saying so and where the dequantised model is, instead of "tensor ... has no GGUF name"."""
    how = four_bit.saved_quantized(folder)
    if how is None:
        return
    if (run / "run_args.json").is_file():  # a run of the pack's: its merge is the dequantised model
        where = (f"the pack's merge of a 4-bit (QLoRA) run writes the dequantised base + adapter as "
                 f"{run / 'merged'}: rerun the recipe with --save_merged_model true (docs/training.md, QLoRA), then "
                 f"make gguf RUN={run}")
    else:
        where = ("dequantise it first: load it with transformers and bitsandbytes, then save model.dequantize() "
                 "with save_pretrained into a folder and export that; or export the model's full-precision release")
    raise UserError(f"{folder} is saved {how} (config.json's quantization_config): its tensors are packed weights "
                    f"and their scales, which GGUF cannot take as they are. Fix: {where}.")


def permute(w, n_head: int):
    """transformers' rotary halves -> Meta's interleaved pairs, per head (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(folder: Path):
    """(name, float32 numpy array) of every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).float().numpy()


def add_vocab(writer, folder: Path, config: dict) -> None:
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text()) if (folder / "tokenizer.json").is_file() else None
    byte_level = tok is not None and tok["model"]["type"] == "BPE" and not tok["model"].get("byte_fallback") and (
        (tok.get("decoder") or {}).get("type") == "ByteLevel")
    if byte_level:
        vocab = dict(tok["model"]["vocab"])
        specials = {}
        for added in tok.get("added_tokens") or []:
            vocab[added["content"]] = added["id"]
            specials[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        size = max(config["vocab_size"], max(vocab.values()) + 1)
        by_id = {i: t for t, i in vocab.items()}
        tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
        types = [specials.get(i, gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED) for i in range(size)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer(config))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        gguf.SpecialVocab(folder, load_merges=True, n_vocab=size).add_to_gguf(writer)
        return
    try:
        vocab = gguf.LlamaHfVocab(folder)
    except (FileNotFoundError, TypeError, ValueError) as err:
        raise UserError(f"the tokenizer in {folder} is neither byte-level BPE nor SentencePiece-style ({err}). Fix: "
                        "export a model whose tokenizer llama.cpp knows, or convert with llama.cpp.") from None
    tokens, scores, types = zip(*vocab.all_tokens())
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    gguf.SpecialVocab(folder, load_merges=False, n_vocab=len(tokens)).add_to_gguf(writer)


def export(folder: Path, out: Path, qtype: str = "f16") -> dict:
    """Write `folder`'s model to the GGUF file `out`; returns what was written (for the summary and tests)."""
    import gguf

    if qtype not in TYPES:
        raise UserError(f"GGUF type {qtype!r} is not one of {', '.join(TYPES)}. Fix: choose one of them.")
    config = json.loads((folder / "config.json").read_text())
    arch_name = (config.get("architectures") or ["?"])[0]
    if arch_name not in ARCHITECTURES:
        raise UserError(f"{folder} is a {arch_name}, which this GGUF writer does not support (it writes "
                        f"{', '.join(sorted(ARCHITECTURES))}). Fix: convert it with llama.cpp's convert_hf_to_gguf.py.")
    rope_type = rope(config)[1]
    if rope_type not in (None, "default"):
        raise UserError(f"{folder} uses rope scaling {rope_type!r}, which this GGUF "
                        "writer does not write yet (llama.cpp needs its rope_freqs tensor). Fix: convert it with "
                        "llama.cpp's convert_hf_to_gguf.py.")
    arch, needs_permute = ARCHITECTURES[arch_name]
    kind = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
            "q8_0": gguf.GGMLQuantizationType.Q8_0, "f32": gguf.GGMLQuantizationType.F32}[qtype]
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f32": gguf.LlamaFileType.ALL_F32}[qtype]

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # renamed when complete: a cut-short export is never taken for one
    try:
        return write(folder, config, out, partial, arch, needs_permute, qtype, kind, file_type)
    finally:
        partial.unlink(missing_ok=True)  # a refusal or a failure half-way leaves nothing behind


def write(folder, config, out, partial, arch, needs_permute, qtype, kind, file_type) -> dict:
    import gguf
    import numpy as np

    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(partial), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch.upper())])
    writer.add_name(folder.resolve().parent.name if folder.name == "merged" else folder.resolve().name)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope(config)[0])
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)
    add_vocab(writer, folder, config)

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), layers)
    tied = config.get("tie_word_embeddings", False)
    written = {}
    for name, data in tensors(folder):
        if tied and name == "lm_head.weight":
            continue  # llama.cpp uses token_embd for the output when output.weight is absent
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            writer.close()
            raise UserError(f"{folder}: tensor {name} has no GGUF name for {arch}. Fix: convert it with llama.cpp.")
        if needs_permute and name.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif needs_permute and name.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        if data.ndim == 1 or kind == gguf.GGMLQuantizationType.F32 or (qtype == "q8_0" and data.shape[-1] % 32):
            tensor, dtype = data.astype(np.float32), gguf.GGMLQuantizationType.F32
        elif kind == gguf.GGMLQuantizationType.F16:
            tensor, dtype = data.astype(np.float16), kind
        else:
            tensor, dtype = gguf.quants.quantize(data, kind), kind
        writer.add_tensor(new, tensor, raw_dtype=dtype)
        written[new] = dtype.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    return {"file": str(out), "type": qtype, "architecture": arch, "tensors": len(written),
            "bytes": out.stat().st_size}


def default_out(run: Path, folder: Path, qtype: str) -> Path:
    name = (run.resolve().name if folder != run else folder.resolve().name)
    return run / "gguf" / f"{name}.{qtype}.gguf"


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run's output_dir (its merged/ model) or a model folder")
    ap.add_argument("--type", default="f16", help=f"one of {', '.join(TYPES)} (default f16)")
    ap.add_argument("--out", type=Path, default=None, help="the .gguf file (default <run>/gguf/<name>.<type>.gguf)")
    args = ap.parse_args(argv)
    if not args.run.is_dir():
        raise UserError(f"{args.run} is not a folder. Fix: point at a finished run's output_dir or a model folder.")
    folder = model_folder(args.run)
    out = args.out or default_out(args.run, folder, args.type)
    done = export(folder, out, args.type)

    written = modelfile.write(out, folder)
    print(f"[gguf] {done['file']}: {done['architecture']}, {done['tensors']} tensors, {done['type']}, "
          f"{done['bytes'] / 2**20:.1f} MiB; Ollama: {written} (ollama create <name> -f {written})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
