"""LoRA on a mixture-of-experts model whose experts transformers 5 fuses into 3-D parameters (Qwen3-MoE, Mixtral,
DeepSeek-V3, GLM-4-MoE, Qwen3-Next, gpt-oss, ...): checked on the launcher's meta-device copy, before any rank starts.

transformers 5 stores each MoE layer's experts as two stacked parameters, `mlp.experts.gate_up_proj` (experts,
2 x intermediate, hidden) and `mlp.experts.down_proj` (experts, hidden, intermediate), not as `nn.Linear` modules.
PEFT adapts them through `target_parameters` (TRL's `lora_target_parameters`): a LoRA pair per expert, applied by
`torch.nn.utils.parametrize` (its `ParamWrapper`). The router (`mlp.gate`) stays frozen unless the recipe names it.

What surfaced only in every rank, after the weights were loaded, and is one line here instead:
- expert projections named as linear layers (`lora_target_modules: [gate_proj, up_proj, down_proj]`, Mixtral's
  `w1, w2, w3`): the model has no such modules; the fix is `lora_target_parameters`;
- `lora_dropout` or DoRA with LoRA on a parameter: PEFT's ParamWrapper raises for both (dropout cannot be factored
  out of a weight delta) -- also where PEFT itself turns `all-linear` into expert parameters (below);
- a `lora_target_parameters` entry that matches no parameter;
- FSDP1 (peft 0.21.2 + accelerate 1.15, measured on 2 CPU processes): transformers gives FSDP1 PEFT's auto-wrap
  policy, which makes each LoRA matrix an FSDP unit of its own, and ParamWrapper reads `lora_A.weight` directly
  instead of calling its forward, so it sees the flat local shard: "RuntimeError: inconsistent tensor size, expected
  tensor [16] and src [256]" at the first step (huggingface/peft#3080, open). Under FSDP2 the LoRA matrices belong to
  their decoder layer's unit, gathered for the layer's whole forward: the same run trains, saves and merges
  (scripts/arch_matrix.py's `qwen3-moe-experts` and `mixtral-experts` cases), with no patch.

PEFT 0.21 rewrites transformers-4 targets for the models transformers converts (`convert_peft_config_for_transformers`,
for loading old adapters): `all-linear` becomes the attention layers, the experts AND the router (`gate.weight`) as
target parameters. `effective_targets` asks that same code what the ranks will adapt.
"""

from __future__ import annotations

import copy
import re

from fsdp_recipes.errors import UserError

# transformers 4's names of the expert projections, which transformers 5 fuses into gate_up_proj and down_proj
FUSED_NAMES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
               "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
LAYER = re.compile(r"^.*?\.\d+\.")  # "model.layers.3." -- what precedes a parameter's name inside its layer


def fused_experts(model) -> list[str]:
    """The model's 3-D expert parameters, by their name inside a layer (`mlp.experts.gate_up_proj`), sorted."""
    return sorted({LAYER.sub("", name) for name, p in model.named_parameters() if p.ndim == 3 and ".experts." in name})


def effective_targets(model, model_args) -> tuple[object, list[str]]:
    """(target_modules, target_parameters) as PEFT will apply them to `model`: TRL's LoraConfig, rewritten by PEFT's
    own transformers-5 conversion where the installed PEFT has it."""
    from trl import get_peft_config

    try:
        config = copy.deepcopy(get_peft_config(model_args))
    except (ValueError, TypeError):
        return model_args.lora_target_modules, list(model_args.lora_target_parameters or [])  # value_checks' line
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

        convert_peft_config_for_transformers(config, model=model, conversions=None)
    except ImportError:  # a PEFT without the conversion leaves the targets as written
        pass
    except ValueError as err:  # e.g. gate_proj without up_proj: check() names the fix first
        raise UserError(f"LoRA targets: {str(err).strip().splitlines()[0]} Fix: {fix_line(model, model_args)}.")
    return config.target_modules, sorted(config.target_parameters or [])


def fix_line(model, model_args) -> str:
    experts = fused_experts(model)
    attention = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n.endswith(("q_proj", "k_proj",
                                                                                             "v_proj", "o_proj"))})
    return (f"put LoRA on the experts with lora_target_parameters: [{', '.join(experts)}] and lora_dropout: 0.0, "
            f"keeping lora_target_modules for the linear layers ({', '.join(attention) or 'the attention layers'}); "
            "or attention only, the cheaper (leave the experts out)")


def check(model, acc: dict, acc_path, model_args) -> None:
    """The recipe's LoRA targets against the fused experts of `model` (a meta-device copy); one line each."""
    if not model_args.use_peft:
        return
    arch = type(model).__name__
    experts = fused_experts(model)
    modules = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    targets = model_args.lora_target_modules
    if experts and isinstance(targets, list):
        fused = [t for t in targets if t in FUSED_NAMES and t not in modules]
        if fused:
            raise UserError(f"lora_target_modules names {', '.join(fused)}, {arch}'s expert projections as linear "
                            f"layers, but transformers 5 fuses its experts into 3-D parameters "
                            f"({', '.join(experts)}): no module of that name exists. Fix: "
                            f"{fix_line(model, model_args)}.")
    named = list(model_args.lora_target_parameters or [])
    parameters = [name for name, _ in model.named_parameters()]
    unmatched = [t for t in named if not any(p == t or p.endswith("." + t) for p in parameters)]
    if unmatched:
        have = ", ".join(experts) or "none: its MoE layers, if any, are linear modules (use lora_target_modules)"
        raise UserError(f"lora_target_parameters {unmatched} match no parameter of {arch} (its 3-D expert "
                        f"parameters: {have}). Fix: use names from that list.")
    if not experts and not named:  # a dense model: PEFT's conversion adapts no parameter
        return
    _, on_parameters = effective_targets(model, model_args)
    if not on_parameters:
        return
    what = (f"lora_target_parameters ({', '.join(on_parameters)})" if named else
            f"PEFT turns lora_target_modules {targets!r} into LoRA on {arch}'s fused experts and router too "
            f"(target_parameters {', '.join(on_parameters)})")
    if model_args.lora_dropout:
        raise UserError(f"{what}: PEFT applies LoRA to a parameter without dropout and refuses lora_dropout "
                        f"{model_args.lora_dropout} there. Fix: set lora_dropout: 0.0 (or leave the experts out: "
                        "name the linear layers in lora_target_modules).")
    if model_args.use_dora:
        raise UserError(f"{what}: PEFT has no DoRA for parameters. Fix: set use_dora: false.")
    fsdp = acc.get("fsdp_config") or {}
    if acc.get("distributed_type") == "FSDP" and int(fsdp.get("fsdp_version", 1)) == 1:
        raise UserError(f"{what} fails under FSDP1 ({acc_path}: fsdp_version 1): its auto-wrap gives each LoRA "
                        "matrix a unit of its own and PEFT's ParamWrapper reads it as the flat local shard "
                        "(huggingface/peft#3080). Fix: fsdp_version: 2 in that file (FSDP2 trains it), or LoRA on "
                        "the attention layers only, or full fine-tuning.")
