"""SFT: TRL's SFTTrainer on language-modeling or prompt-completion data, plain or chat."""

from __future__ import annotations

from fsdp_recipes.config import model_check, model_found
from fsdp_recipes.data import formats, loading, row_checks
from fsdp_recipes.errors import UserError

# the loss is in every run report already; a mixture of experts' load-balancing loss (TRL logs it where
# router_aux_loss_coef is on) is reported where it was logged (run_report.OPTIONAL_LOGS)
REPORTED_LOGS: tuple[str, ...] = ("aux_loss",)
RESUME_SETTINGS: tuple[str, ...] = ("packing", "completion_only_loss")  # what a resume compares (checkpoint/resume_settings.py)
SEQUENCES_PER_ROW = 1  # make plan: sequences a dataset row puts through the model
ROWS = "sequences"  # what make plan calls the rows of a batch
SMOKE_DATA = "data"  # tiny_assets' synthetic chat data, for make smoke
describe_tokens = "non-padding tokens of the training sequences, one forward and one backward each"


def trainer_class():
    from trl import SFTTrainer

    return SFTTrainer


def trainer_kwargs(cfg) -> dict:
    return {}


def sequence_length(training) -> int:
    """make plan's worst case: every sequence max_length long."""
    return training.max_length or 1024


def extra_forwards(training) -> dict[str, float]:
    return {}


# Families whose every step fails in TRL 1.16's SFT loss: it runs through TRL's fused LM head (trl add_fused_lm_head),
# which reads the backbone output's last_hidden_state, and Llama 4's output has none (AttributeError; TRL's fault,
# scripts/arch_matrix.py found it). Config model_type -> the family's name.
FUSED_LOSS_CANNOT = {"llama4": "Llama 4", "llama4_text": "Llama 4"}


def check_config(cfg) -> None:
    """What TRL's SFTTrainer cannot train in these releases, from the model's config.json where it is known offline
    (a local folder)."""
    source = model_found.model_config_source(cfg.model.model_name_or_path, None)
    if source is None:
        return
    text = model_check.load_config(source).get_text_config()
    where, kind = cfg.model.model_name_or_path, type(text).__name__
    if text.model_type in FUSED_LOSS_CANNOT:
        raise UserError(f"{where} is a {FUSED_LOSS_CANNOT[text.model_type]} model ({kind}), which TRL 1.16's "
                        "SFTTrainer cannot train: its loss reads the backbone's last_hidden_state, which Llama 4's "
                        "output does not have (every step fails). Fix: none in these releases; train another family.")
    coef = cfg.training.router_aux_loss_coef
    coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef  # as SFTTrainer resolves it
    if hasattr(text, "output_router_logits") and coef and not hasattr(text, "num_experts"):
        raise UserError(f"{where}: TRL 1.16's SFTTrainer adds the load-balancing loss of this mixture of experts "
                        f"(router_aux_loss_coef {coef:g}) and asks its config for num_experts, which {kind} does not "
                        "have (it counts them as num_local_experts): the first step would fail. Fix: "
                        "router_aux_loss_coef: 0.0 in the recipe (no load-balancing loss), or train LoRA without "
                        "the router.")


def eval_loss(run_args: dict) -> str:
    """What TRL's eval loss of an SFT run counts: the trainer's own loss, masked as the training loss is
    (completion_only_loss, assistant_only_loss; a chat `messages` row without assistant_only_loss counts its prompt)."""
    sft = run_args.get("sft_config") or {}
    if sft.get("assistant_only_loss"):
        counts = "the assistant tokens alone (assistant_only_loss)"
    elif sft.get("completion_only_loss") is False:
        counts = "every token, prompts included (completion_only_loss false)"
    else:
        counts = ("every token of a chat `messages` row, its prompt included (assistant_only_loss off), or a "
                  "prompt/completion row's completion")
    return f"TRL's, on the eval split during training, over the tokens the training loss counts: {counts}"


def summary_lines(metrics: dict) -> list[str]:
    """A mixture of experts: the load-balancing loss and the expert load (docs/run-report.md, "Mixture of experts")."""
    from fsdp_recipes.metrics.figures import figure

    lines, aux, load = [], (metrics.get("sft") or {}).get("aux_loss"), metrics.get("expert_load")
    if aux:
        lines.append(f"aux loss    {figure(aux['first'], '.4g')} -> {figure(aux['last'], '.4g')} (the router's "
                     "load-balancing loss, before its coefficient)")
    if load and load["layers"]:
        slots = len(load["layers"]) * load["experts"]
        lines.append(f"experts     busiest {figure(load['max_over_mean'], '.2f')}x the mean (worst of "
                     f"{len(load['layers'])} layers); {load['idle_experts']} of {slots} received no token")
    return lines


def load_datasets(cfg, want_eval: bool | None = None):
    want_eval = cfg.training.eval_strategy != "no" if want_eval is None else want_eval
    text_field = cfg.training.dataset_text_field
    return loading.load_for(cfg, want_eval, lambda ds, where: loading.check_columns(ds, where, text_field))


def check_data(cfg, splits, tokenizer) -> list[str]:
    where, warned = cfg.script.dataset_name, []
    names = (cfg.script.dataset_train_split, cfg.script.dataset_test_split)
    for split, ds in zip(names, splits):
        if ds is None:
            continue
        warned += formats.check_rows(ds, where, split, cfg.training.dataset_text_field or "text")
        if tokenizer is not None and row_checks.conversational(ds):
            row_checks.check_chat_template(tokenizer, cfg.model.model_name_or_path, where)
    return warned  # what max_length cuts: data/lengths.py, in the launcher
