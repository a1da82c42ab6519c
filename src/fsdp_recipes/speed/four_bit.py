"""QLoRA under FSDP: a 4-bit (NF4) base through transformers' BitsAndBytesConfig (TRL's `load_in_4bit`,
`bnb_4bit_quant_type`, `use_bnb_nested_quant`, `bnb_4bit_quant_storage` fields of ModelConfig), LoRA on top.

The storage dtype is the pack's to set, never a default. bitsandbytes packs two 4-bit values per byte and keeps them
in a tensor of `bnb_4bit_quant_storage` (uint8 unless told). FSDP shards and all-gathers that tensor like any other
parameter and, under mixed precision, casts it to its compute dtype first: float32 storage cast to bf16 rounds the
packed bits away; uint8 storage crashed or trained with a loss of 0 or NaN (accelerate issue 3983), and accelerate
1.15 now leaves it out of the sharding instead, whole on every rank, which saves no memory (axolotl PR 2992's
finding). Stored in the dtype FSDP itself gives the parameters (the mixed-precision dtype, else the model's), the
cast is a no-op, the packed bytes shard along dim 0 and gather back bit for bit: on 2 CPU processes the sharded
model's loss equals the unsharded one (tests/test_qlora.py).

What cannot be sharded correctly is refused in one line before any rank starts: 8-bit weights (bitsandbytes' int8
parameters carry their scales outside the tensor FSDP gathers), full fine-tuning of a 4-bit base (no gradient to
give packed weights), a storage dtype other than FSDP's, FSDP1 (not checked by this pack: FSDP2 is), a model dtype
left to `auto`.

The merged model of a 4-bit run (`save_merged_model`) is the dequantised 4-bit base + the adapter, in the compute
dtype (load_4bit below): the adapter learned to correct the NF4 weights, not the original ones, so that merged model
answers as the trained 4-bit model does (the logits agree to float rounding; tests/test_qlora.py, bench/README.md
"QLoRA on the default"), where a merge into the original weights would be another model.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

from fsdp_recipes import decoder
from fsdp_recipes.errors import UserError

DTYPES = ("bfloat16", "float16", "float32")
# ModelConfig's (TRL) 4-bit settings; load_in_8bit only to refuse it
FIELDS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")
# the checkpoint's shards have the 4-bit layout (its storage dtype follows dtype and bf16, which a resume keeps too)
RESUME_SETTINGS = ("load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant")
NF4_BYTES = 0.5
NF4_SCALE_BYTES = 4 / 64  # one fp32 absmax per block of 64
NF4_NESTED_SCALE_BYTES = 1 / 64 + 4 / (64 * 256)  # a uint8 per block, an fp32 per 256 blocks


def enabled(cfg) -> bool:
    return bool(getattr(cfg.model, "load_in_4bit", False))


def storage_dtype(model_dtype: str | None, training, acc_mixed_precision: str | None, fsdp: bool) -> str | None:
    """The dtype FSDP keeps the parameters in as it gathers them, which the 4-bit storage must have: the mixed
    precision the Trainer gives accelerate (TrainingArguments' bf16 / fp16 win over the accelerate config, as in
    transformers' Trainer; FSDP2's MixedPrecisionPolicy param_dtype follows it), else the model's own dtype. Without
    FSDP nothing casts the parameters: the model's dtype."""
    if not fsdp:
        return model_dtype
    mixed = "bf16" if getattr(training, "bf16", False) else "fp16" if getattr(training, "fp16", False) else \
        str(acc_mixed_precision or "no").lower()
    return {"bf16": "bfloat16", "fp16": "float16"}.get(mixed, model_dtype)


def check_launch(cfg, acc: dict, path) -> None:
    check(cfg.model, cfg.training, acc, path)


def check(model_args, training, acc: dict, path) -> None:
    """The 4-bit settings, before any rank starts: refuse what FSDP cannot shard correctly."""
    if getattr(model_args, "load_in_8bit", False):
        raise UserError(f"{path}: load_in_8bit cannot be sharded by FSDP (bitsandbytes' int8 weights keep their "
                        "scales outside the tensor FSDP gathers). Fix: load_in_4bit: true (QLoRA, NF4), or neither")
    if not getattr(model_args, "load_in_4bit", False):
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("load_in_4bit needs bitsandbytes, which is not installed. Fix: pip install "
                        "'fsdp-recipes[qlora]' (or pip install bitsandbytes), or drop load_in_4bit")
    if not model_args.use_peft:
        raise UserError("load_in_4bit with full fine-tuning: 4-bit weights cannot be trained, only LoRA adapters on "
                        "them. Fix: use_peft: true (QLoRA), or drop load_in_4bit")
    fsdp = acc.get("distributed_type") == "FSDP"
    if fsdp and int((acc.get("fsdp_config") or {}).get("fsdp_version", 1)) == 1:
        raise UserError(f"{path}: load_in_4bit under FSDP1 is not checked by this pack (its 4-bit path is checked "
                        "under FSDP2: sharded storage, losses equal to one process). Fix: fsdp_version: 2 "
                        "(accelerate_configs/fsdp2_1node.yaml)")
    if model_args.dtype not in DTYPES:
        raise UserError(f"load_in_4bit with dtype {model_args.dtype!r}: the 4-bit storage must be FSDP's own dtype, "
                        f"which needs the model's. Fix: dtype: bfloat16 on GPUs, float32 on CPU")
    want = storage_dtype(model_args.dtype, training, acc.get("mixed_precision"), fsdp)
    given = model_args.bnb_4bit_quant_storage
    if given is not None and given != want:
        why = ("accelerate leaves integer 4-bit weights unsharded, whole on every rank, so nothing is saved (older "
               "versions corrupted them: accelerate issue 3983)" if given in ("uint8", "int8") else
               "FSDP would cast the packed 4-bit bytes to it and corrupt them")
        raise UserError(f"bnb_4bit_quant_storage {given} differs from the dtype FSDP gathers the parameters in "
                        f"({want}): {why}. Fix: leave bnb_4bit_quant_storage out (the pack sets {want}), or set it "
                        f"to {want}")


def settle(cfg) -> None:
    settle_storage(cfg.model, cfg.training)


def settle_storage(model_args, training) -> None:
    """In the ranks, before run_args.json records the settings: the storage is FSDP's dtype (the launcher refused a
    user's other choice), from the ranks' own view of accelerate (its environment)."""
    if getattr(model_args, "load_in_4bit", False):
        fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("true", "1")
        model_args.bnb_4bit_quant_storage = storage_dtype(model_args.dtype, training,
                                                          os.environ.get("ACCELERATE_MIXED_PRECISION"), fsdp)


def model_init_kwargs(cfg) -> dict:
    bnb = quantization_config(cfg.model, cfg.training)
    return {} if bnb is None else {"quantization_config": bnb}


def quantization_config(model_args, training):
    """The BitsAndBytesConfig for from_pretrained (TRL's get_quantization_config), its storage set to FSDP's dtype;
    None without load_in_4bit."""
    if not getattr(model_args, "load_in_4bit", False):
        return None
    from trl import get_quantization_config

    settle_storage(model_args, training)
    return get_quantization_config(model_args)


def prepare_trainer(trainer, cfg) -> None:
    same_kernels_on_every_cpu(trainer.model)


def planner_setup(model_args, training) -> dict:
    """QLoRA's bytes per 4-bit parameter: the packed storage and its scales (planning/memory_budget.py)."""
    if not getattr(model_args, "load_in_4bit", False):
        return {}
    nested = getattr(model_args, "use_bnb_nested_quant", False)
    return {"quant_bytes": NF4_BYTES, "scale_bytes": NF4_NESTED_SCALE_BYTES if nested else NF4_SCALE_BYTES}


def planner_shape(model, model_args) -> dict:
    """The decoder's linear weights that are stored in 4 bits: in all, in one layer, and the largest one."""
    if not getattr(model_args, "load_in_4bit", False):
        return {}
    import torch

    layers = decoder.layers(model)[1]
    linears = [m.weight.numel() for m in layers[0].modules() if isinstance(m, torch.nn.Linear)]
    quantized = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
    return {"quantized": quantized, "layer_quantized": sum(linears), "largest_quantized": max(linears)}


def recorded(model_args) -> SimpleNamespace | None:
    """A run's 4-bit settings (ModelConfig, or run_args.json's `model_args` dict) as get_quantization_config reads
    them; None for a run without load_in_4bit."""
    fields = model_args if isinstance(model_args, dict) else vars(model_args)
    if not fields.get("load_in_4bit"):
        return None
    return SimpleNamespace(load_in_4bit=True, load_in_8bit=False, dtype=fields.get("dtype"),
                           bnb_4bit_quant_type=fields.get("bnb_4bit_quant_type") or "nf4",
                           use_bnb_nested_quant=bool(fields.get("use_bnb_nested_quant")),
                           bnb_4bit_quant_storage=fields.get("bnb_4bit_quant_storage"))


def load_4bit(model_path: str, model_args, dequantise: bool = False):
    """The base a 4-bit run trained on, loaded again with its BitsAndBytesConfig: the same NF4 values (quantizing the
    same weights is deterministic; the storage dtype only holds the packed bytes). `dequantise`: every 4-bit linear
    turned back into a plain one in the compute dtype (transformers' dequantize(), which also drops the config's
    quantization_config): the 4-bit model's own weights in full precision, plain from_pretrained from then on."""
    import transformers
    from transformers import AutoModelForCausalLM
    from trl import get_quantization_config

    transformers.utils.logging.disable_progress_bar()  # as generation.generate: no bars inside the summary
    settings = recorded(model_args)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=settings.dtype,
                                                 quantization_config=get_quantization_config(settings))
    return model.dequantize() if dequantise else same_kernels_on_every_cpu(model)


def same_kernels_on_every_cpu(model):
    """Every bitsandbytes 4-bit layer of `model` computes as on a CPU without AVX-512 BF16 (dequantise, then matmul).

    Where the CPU has AVX-512 BF16, bitsandbytes 0.50 (checked on 0.50.2) rewrites a Linear4bit's weight in place into
    a kernel's packed layout at its first forward in eval mode without gradients (an evaluation, a generation), and
    that rewrite asserts `out_features % 32 == 0` (functional._convert_weight_packed_for_cpu): the tiny test model's
    688-wide MLP crashed there, on an AMD EPYC (Zen 4) VM and not on one without AVX-512 BF16. In a training rank it
    would also rewrite a parameter FSDP shards and gathers. Turned off, every CPU computes the same numbers the same
    way; a GPU never takes that path."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
    return model


def saved_quantized(folder) -> str | None:
    """How `folder`'s weights are stored quantized (config.json's quantization_config, as transformers saves a
    bitsandbytes, GPTQ, AWQ ... model), in words: 'in 4 bits (bitsandbytes nf4)'; None for plain weights. `make gguf`
    names such a folder (serving/gguf_export.py): its tensors are packed weights and their scales."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quant, dict) or not quant:
        return None
    method = str(quant.get("quant_method", "unknown method"))
    if quant.get("load_in_4bit") or quant.get("_load_in_4bit"):
        return f"in 4 bits ({method} {quant.get('bnb_4bit_quant_type', 'fp4')})"
    if quant.get("load_in_8bit") or quant.get("_load_in_8bit"):
        return f"in 8 bits ({method})"
    bits = quant.get("bits") or quant.get("w_bit")
    return f"in {bits} bits ({method})" if bits else f"quantized ({method})"
