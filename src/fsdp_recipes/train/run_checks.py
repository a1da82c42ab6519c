"""The checks of a recipe that need no process group and no weights, run by the launcher before any rank starts
and again by every rank (train/entry.py): parse the recipe and its overrides, build the local assets it uses, check
the settings.
"""

from __future__ import annotations

from fsdp_recipes import speed
from fsdp_recipes.assets import addition_preferences, smollm2
from fsdp_recipes.assets.tiny_assets import ensure_assets
from fsdp_recipes.config import hardware, model_found, value_checks
from fsdp_recipes.config.run_config import RunConfig, parse_args
from fsdp_recipes.data import declaration
from fsdp_recipes.evaluation.generation import generate
from fsdp_recipes.metrics import prometheus
from fsdp_recipes.train import kinds


def check_before_launch(cfg: RunConfig, nodes: int = 1) -> None:
    """Everything that can be checked without starting processes or loading weights."""
    hardware.check_gpus(cfg.pack.min_gpus, cfg.pack.recipe_name or "(unnamed)", nodes)
    speed.check_config(cfg)
    model_found.check_local_model(cfg.model.model_name_or_path, cfg.pack.continues_from)
    prometheus.check_prometheus_textfile(cfg.pack.prometheus_textfile)
    value_checks.check_values(cfg)
    # a misspelt format or column mapping, before any row is read: the registry's names (data/formats/)
    declaration.parse_spec(cfg.pack.dataset_format)
    kind = kinds.load(cfg.trainer)
    kind.check_config(cfg)
    kind.settle_generation(cfg)


def prepare_assets(cfg: RunConfig, quiet: bool = False) -> None:
    """The tiny assets, or the default's SmolLM2 (made once into the cache), when the recipe uses them."""
    if cfg.pack.tiny_assets:
        ensure_assets(quiet=quiet)
    if cfg.pack.smollm2_assets:
        # The model only when the recipe trains the prepared folder: with a hub id
        # (--model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct) from_pretrained fetches it as usual.
        smollm2.ensure_assets(model=smollm2.is_prepared_path(cfg.model.model_name_or_path), quiet=quiet)


def parse_and_check(argv: list[str], quiet: bool = False, nodes: int | None = None, raw: dict | None = None,
                    world_size: int | None = None) -> RunConfig:
    """Parse the recipe and overrides, build the tiny assets when the recipe uses them (the tiny model is one
    of them, so before the model check), and run the checks that need no process group. `nodes`: of the job
    (min_gpus is shared among them); by default read from torchrun's environment. `raw`: the recipe YAML when the
    caller has read it already (the launcher's Recipe). `world_size`: the job's processes, where the caller is not
    one of its ranks (the launcher): the trainer config's own checks see the layout the ranks will see."""
    cfg = parse_args(argv, raw, world_size)
    prepare_assets(cfg, quiet)
    if cfg.pack.addition_preferences:  # DPO on the default's task: pairs from the SFT model's own answers

        model_found.check_local_model(cfg.model.model_name_or_path, cfg.pack.continues_from)
        addition_preferences.ensure(cfg.model.model_name_or_path, cfg.script.dataset_name, generate, quiet=quiet)
    check_before_launch(cfg, nodes=hardware.job_nodes() if nodes is None else nodes)
    return cfg
