"""`attn_implementation` (TRL's ModelConfig): the attention kernel transformers runs, passed to from_pretrained.

`auto` picks the fastest implementation installed for the device the ranks train on (`choose`):
- CUDA, packed rows (`padding_free: true`, or `packing: true` with TRL's bfd strategies, which turn it on): a
  variable-length kernel and no mask: `packed_varlen` (varlen_attention.py: torch's own varlen flash kernel) where
  the installed torch has torch.nn.attention.varlen, else flash_attention_4 (flash-attn-4, Hopper and newer), else
  flash_attention_2 (flash-attn, or the kernels package's Hub build); SDPA with a block-diagonal mask where none is.
- CUDA, full rows: sdpa. transformers passes no mask and is_causal=True where a batch has no padding, so SDPA runs
  its flash or cuDNN kernels (masking_utils.py _ignore_causal_mask_sdpa; sdpa_attention.py `is_causal = q_length >
  1 and attention_mask is None and is_causal`); a padded batch gets a mask.
- CPU: sdpa (packed rows with transformers' block-diagonal mask; `packed_varlen` runs there too, its reference).
The launcher's `[launch]` line says which and why; each rank chooses again on its own device, and run_args.json
records `speed_options.attention` (requested, ran, why).

Checked before any rank starts: an implementation the model's class does not support (transformers' own flags,
`_supports_sdpa`, `_supports_flash_attn`, `_supports_flex_attn`: Gemma2 has no SDPA, its softcapping), which
from_pretrained refused in every rank, and `auto` then picks what the class supports; a flash-attention choice
without its package; flex_attention on CPU, whose
backward torch 2.13 does not have (NotImplementedError in the first step); anything but sdpa (or auto) under a cp
mesh. `make smoke` on a machine without
CUDA runs sdpa instead of those.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from fsdp_recipes.config import hardware, model_check, model_found, placement
from fsdp_recipes.config.mesh import mesh_of
from fsdp_recipes.errors import UserError
from fsdp_recipes.speed import varlen_attention

FIELDS = ("attn_implementation",)
AUTO = "auto"
VARLEN = varlen_attention.NAME
# The flash-attention builds transformers names, and the distribution each one imports from
FLASH_PACKAGES = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn-3",
                  "flash_attention_4": "flash-attn-4"}
NAMES = ("eager", "sdpa", "flex_attention", "paged|eager", AUTO, VARLEN, *FLASH_PACKAGES)
FLASH_MIN_CAPABILITY = (8, 0)  # the flash kernels (torch's varlen, flash-attn 2): Ampere and newer
FA4_MIN_CAPABILITY = (9, 0)  # flash-attn-4: Hopper and newer


@dataclass(frozen=True)
class Choice:
    name: str  # what from_pretrained gets
    why: str


# The flag transformers' PreTrainedModel reads before it loads a model with each implementation (private class
# attributes: modeling_utils _sdpa_can_dispatch, _flash_attn_can_dispatch, _flex_attn_can_dispatch; checked on
# transformers 5.23). A class without the flag is not judged (a later transformers that renames them refuses no
# launch); tests/test_attention.py fails then, as Gemma2 stops being refused
SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
                 **{name: "_supports_flash_attn" for name in FLASH_PACKAGES}}

_CHOSEN: dict[int, tuple[str, Choice]] = {}  # id(cfg.model) -> (requested, choice), for the run report


def enabled(cfg) -> bool:
    return bool(cfg.model.attn_implementation)


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def packed_rows(training) -> bool:
    """TRL's padding-free batches: what SFTTrainer decides (`padding_free or packing with bfd/bfd_split`)."""
    return bool(getattr(training, "padding_free", False)) or (
        bool(getattr(training, "packing", False))
        and getattr(training, "packing_strategy", "bfd") in ("bfd", "bfd_split"))


def choose(cuda: bool, packed: bool, capability: tuple[int, int] | None, has=None) -> Choice:
    """`auto`: the fastest implementation installed for this device. `has(name)`: torch's varlen module
    ("torch_varlen") or a distribution is installed; `capability`: the GPU's, None where unknown."""
    has = has or (lambda name: varlen_attention.torch_varlen_available() if name == "torch_varlen"
                  else installed(name))
    if not cuda:
        return Choice("sdpa", "no CUDA device: torch's SDPA on CPU; packed rows get transformers' block-diagonal mask")
    if not packed:
        return Choice("sdpa", "full rows: SDPA with is_causal and no mask tensor where a batch has no padding "
                              "(its flash/cuDNN kernels)")
    if capability is not None and capability < FLASH_MIN_CAPABILITY:
        return Choice("sdpa", f"packed rows, but the flash kernels need compute capability 8.0+ and this GPU has "
                              f"{capability[0]}.{capability[1]}: SDPA with a block-diagonal mask")
    if has("torch_varlen"):
        return Choice(VARLEN, "packed rows: torch's own varlen flash kernel (torch.nn.attention.varlen), no mask")
    if has("flash-attn-4") and (capability is None or capability >= FA4_MIN_CAPABILITY):
        return Choice("flash_attention_4", "packed rows: flash-attn-4's varlen kernel (this torch has no "
                                           "torch.nn.attention.varlen)")
    if has("flash-attn"):
        return Choice("flash_attention_2", "packed rows: flash-attn's varlen kernel (this torch has no "
                                           "torch.nn.attention.varlen)")
    if has("kernels"):
        return Choice("flash_attention_2", "packed rows: flash-attn from the Hub's kernels-community, fetched by "
                                           "the kernels package at load (this torch has no torch.nn.attention.varlen)")
    return Choice("sdpa", "packed rows, but no varlen kernel is installed (this torch has no "
                          "torch.nn.attention.varlen; no flash-attn): SDPA with a block-diagonal mask")


def check_config(cfg) -> None:
    attn = cfg.model.attn_implementation
    if attn and attn not in NAMES and "/" not in attn:  # "org/repo[@rev][:fn]": a Hub kernel, transformers' to load
        raise UserError(f"attn_implementation {attn!r} is not an attention implementation. Fix: one of "
                        f"{', '.join(NAMES)} (auto picks the fastest installed for the device), or a Hub kernel "
                        "`org/repo`.")
    check_model_config(cfg, None)  # the model's own config, found without the network


def model_class(cfg, config=None):
    """The class from_pretrained builds for the recipe's model (AutoModelForCausalLM's, as the launcher's meta-model
    check builds it), from `config` or the model's config.json found without the network; None where neither is
    known, or the model brings its own code (trust_remote_code: its class, not transformers' mapping)."""
    path = getattr(cfg.model, "model_name_or_path", None)
    if getattr(cfg.training, "trust_remote_code", False) or (config is None and not path):
        return None
    if config is None:
        source = model_found.model_config_json(path, getattr(cfg.model, "model_revision", None))
        if source is None:
            return None
        try:
            config = model_check.load_config(source)
        except Exception:  # noqa: BLE001 -- a config transformers cannot read: the model's own checks name it
            return None
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING  # AutoModelForCausalLM's own mapping, public

    try:
        found = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # not a causal LM transformers maps: the loader names it
        return None
    if isinstance(found, (list, tuple)):  # several classes for one config: the one its architectures name
        named = [c for c in found if c.__name__ in (getattr(config, "architectures", None) or [])]
        found = (named or list(found))[0]
    return found


def supported(cls) -> list[str]:
    """The implementations `cls` takes, by transformers' flags (eager always)."""
    return ["eager", *(name for name, flag in SUPPORT_FLAGS.items() if getattr(cls, flag, False))]


def unsupported(attn: str | None, cls) -> bool:
    return (cls is not None and attn in SUPPORT_FLAGS and hasattr(cls, SUPPORT_FLAGS[attn])
            and not getattr(cls, SUPPORT_FLAGS[attn]))


def check_model_config(cfg, config) -> None:
    """An implementation the model's class does not support: from_pretrained refuses it in every rank
    (`ValueError: Gemma2ForCausalLM does not support an attention implementation through
    torch.nn.functional.scaled_dot_product_attention yet`), said here in one line."""
    attn = cfg.model.attn_implementation
    if attn not in SUPPORT_FLAGS:  # none, auto (resolve picks a supported one), eager, a Hub kernel
        return
    cls = model_class(cfg, config)
    if not unsupported(attn, cls):
        return
    flag = SUPPORT_FLAGS[attn]
    raise UserError(f"attn_implementation: {attn} is not supported by {cls.__name__}, the model's class "
                    f"(transformers' {cls.__name__}.{flag} is False: from_pretrained would refuse it in every rank). "
                    f"Fix: --attn_implementation eager (or attn_implementation: eager in the recipe YAML; "
                    f"{cls.__name__} supports {', '.join(supported(cls))}).")


def fit_to_model(choice: Choice, cls) -> Choice:
    """`auto`'s choice where the model's class does not support it: SDPA if the class has it, else eager."""
    if not unsupported(choice.name, cls):
        return choice
    name = "sdpa" if not unsupported("sdpa", cls) else "eager"
    return Choice(name, f"{choice.name} would run here, but {cls.__name__} does not support it (transformers' "
                        f"{SUPPORT_FLAGS[choice.name]} is False)")


def check_installed(cfg) -> None:
    attn = cfg.model.attn_implementation
    package = FLASH_PACKAGES.get(attn)
    if package is None or installed(package) or (attn != "flash_attention_4" and installed("kernels")):
        return
    how = ("pip install --pre flash-attn-4 (Hopper or newer)" if attn == "flash_attention_4" else
           f"pip install {package} (a source build: PyPI has no wheel of it)")
    raise UserError(f"attn_implementation: {attn} needs the {package} package, which is not installed. "
                    f"Fix: {how}, or use attn_implementation: auto (torch's own varlen kernel for packed rows on "
                    "CUDA, SDPA otherwise).")


def on_cpu_in_launcher(cfg, acc: dict) -> bool:
    """The ranks will train on CPU: no GPU here (config/placement.py, which the launcher asked already), or
    use_cpu in the recipe, its accelerate YAML or the command."""
    return bool(getattr(cfg.training, "use_cpu", False) or acc.get("use_cpu")) or placement.gpus_here() == 0


def refuse_flex_on_cpu(attn: str | None) -> None:
    if attn == "flex_attention":
        raise UserError("attn_implementation: flex_attention cannot train on a CPU: torch 2.13's FlexAttention has "
                        "no CPU backward (NotImplementedError in the first step). Fix: attn_implementation: auto or "
                        "sdpa here; flex_attention on CUDA GPUs.")


def refuse_other_than_sdpa_under_cp(attn: str | None, acc: dict, path) -> None:
    """A cp mesh (speed/context_parallel.py) runs SDPA split over the ranks: transformers' Trainer refuses any other
    implementation at the first step (a traceback). `auto` picks sdpa there (cp rows are never packed)."""
    mesh = mesh_of(acc, path)
    if mesh is not None and mesh.cp > 1 and attn not in (None, "sdpa", AUTO):
        raise UserError(f"attn_implementation: {attn} cannot split rows over cp {mesh.cp}: context parallel runs "
                        "SDPA (the ring on CUDA, the all-to-all form elsewhere), and transformers' Trainer refuses "
                        "anything else. Fix: attn_implementation: sdpa or auto.")


def check_launch(cfg, acc: dict, path, say=None) -> None:
    """In the launcher, before the ranks work: flex_attention refused on CPU, and what `auto` will pick, said in a
    `[launch]` line (`say`)."""
    attn = cfg.model.attn_implementation
    refuse_other_than_sdpa_under_cp(attn, acc, path)
    if attn not in ("flex_attention", AUTO):
        return
    cpu = on_cpu_in_launcher(cfg, acc)
    if cpu:
        refuse_flex_on_cpu(attn)
    if attn == AUTO:
        capabilities = None if cpu else hardware.gpu_capabilities()
        choice = fit_to_model(choose(not cpu, packed_rows(cfg.training), min(capabilities) if capabilities else None),
                              model_class(cfg))
        (say or launch_line)(f"attention: auto -> {choice.name} ({choice.why})")


def launch_line(msg: str) -> None:
    print(f"[launch] {msg}", flush=True)  # launch/lines.py's format (that layer is above this one)


def smoke(field, gpus: int) -> tuple[list[str], str | None]:
    attn = str(field("attn_implementation", ""))
    package = FLASH_PACKAGES.get(attn, "flash-attn")
    if attn.startswith("flash_attention") and not (gpus and installed(package)):
        return ["--attn_implementation", "sdpa"], f"attention: {attn} needs CUDA and the {package} package -> sdpa"
    if attn == "flex_attention" and not gpus:
        return ["--attn_implementation", "sdpa"], "attention: flex_attention has no CPU backward -> sdpa"
    return [], None


def settle(cfg) -> None:
    """In each rank, on its own device: `auto` resolved (recorded as it will run), flex_attention refused on CPU."""
    resolve(cfg)


def resolve(cfg) -> str | None:
    """The implementation this process runs, written into cfg.model (from_pretrained gets it); `auto` chosen on
    this process's device. Idempotent; the bench workers reach it through model_init_kwargs without settle."""
    import torch

    attn = cfg.model.attn_implementation
    cuda = torch.cuda.is_available() and not getattr(cfg.training, "use_cpu", False)
    if attn == "flex_attention" and not cuda:
        refuse_flex_on_cpu(attn)
    if attn == AUTO:
        choice = fit_to_model(choose(cuda, packed_rows(cfg.training),
                                     torch.cuda.get_device_capability() if cuda else None), model_class(cfg))
        _CHOSEN[id(cfg.model)] = (AUTO, choice)
        cfg.model.attn_implementation = attn = choice.name
    if attn == VARLEN:
        varlen_attention.register()
    return attn


def model_init_kwargs(cfg) -> dict:
    """The recipe's kernel (`auto` resolved); none named, transformers' default (and whatever model_init_kwargs
    says)."""
    attn = resolve(cfg) if cfg.model.attn_implementation else None
    return {"attn_implementation": attn} if attn else {}


def prepare_trainer(trainer, cfg) -> dict:
    """What ran, for run_args.json's speed_options.attention, and its line."""
    config = getattr(trainer.model, "config", None)
    ran = getattr(config, "_attn_implementation", None) or cfg.model.attn_implementation
    requested, choice = _CHOSEN.get(id(cfg.model), (cfg.model.attn_implementation, None))
    record = {"requested": requested, "ran": ran}
    if choice is not None:
        record["why"] = choice.why
    if ran == VARLEN:
        import torch

        record["kernel"] = ("torch.nn.attention.varlen" if torch.cuda.is_available()
                            and varlen_attention.torch_varlen_available() else "reference: SDPA row by row")
    accelerator = getattr(trainer, "accelerator", None)
    if requested == AUTO and accelerator is not None:
        accelerator.print(f"[train] attention: auto -> {ran} ({record['why']})")
    return record
