"""`make smoke RECIPE=<any>`: a recipe's own launch path on CPU, or on the GPUs there are, with a tiny model of its
architecture.

`FSDP_RECIPES_SMOKE=1 recipes/<name>/launch.sh` (what `make smoke` runs) goes through the same launcher,
checks, `accelerate launch`, SFTTrainer and saving as the real job, with these substitutions, each printed:

- the model: the recipe's model's own config.json (a local folder's, or a hub id's in the hub cache), else, where
  that model is not here, the recipe's copy of its hub config (`model_config.json`), loaded with AutoConfig and
  kept as it is -- architecture class, decoder layer class, GQA, rope scaling, biases, tied embeddings -- except
  for fewer and narrower layers and the tiny local tokenizer's vocabulary; random weights, saved with
  save_pretrained and loaded back through from_pretrained;
- the data: tiny_assets' synthetic data, whichever the trainer kind names (its SMOKE_DATA: the prompt/completion
  rows, or the preference pairs a preference kind reads);
- the speed options this machine cannot run, each option's `smoke` (speed/): flash-attn becomes sdpa, a kernel
  package that is not installed is turned off, each with its line;
- the accelerate YAML: the recipe's own, with the processes scaled to 2 on one machine (an HSDP recipe
  keeps 2 replicas of 2 shards, 4 processes, so that both dimensions exist); where torch sees GPUs, one process per
  GPU (at most the recipe's count; HSDP from 4 GPUs, plain FSDP below) and no --use_cpu: the CUDA/NCCL path.
  FSDP_RECIPES_DEVICE=cpu keeps a GPU machine's smoke run on CPU;
- the length of the run: a few optimizer steps and a checkpoint, in runs/smoke/<name> (the user's --max_steps,
  --save_steps or --output_dir win, and the `run:` line says what will run);
- the recipe's gates (mfu_min, peak_memory_max_fraction): not judged (metrics/gates.py), each said once.

What would fail on the cluster fails here: a wrap class or LoRA target the architecture lacks (model_check),
a bad FSDP key (accelerate's own loader and the pack's checks), the FSDP1 or FSDP2 path itself, checkpoint
and final saving with the recipe's state-dict type. What it cannot show: memory (see `make plan`) and speed.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path

import yaml

from fsdp_recipes import decoder, speed
from fsdp_recipes.assets.tiny_assets import ensure_assets
from fsdp_recipes.config import model_found
from fsdp_recipes.config.argv import set_by
from fsdp_recipes.config.model_check import load_config
from fsdp_recipes.config.recipes import Recipe
from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import cache_dir, in_pack_cache
from fsdp_recipes.train import kinds

ENV = "FSDP_RECIPES_SMOKE"
STEPS = 3

# Narrow and shallow enough for a few CPU steps in seconds; wide enough for 4 heads of 16 and 2 KV heads.
SHAPE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)


def active() -> bool:
    return os.environ.get(ENV, "") not in ("", "0", "false")


def say(msg: str) -> None:
    print(f"[smoke] {msg}", flush=True)


# Each family's names for its key/value heads (Llama's num_key_value_heads, Falcon's num_kv_heads; GPT-NeoX, GPT-2 and
# OPT have none: one per query head); its MLP width's are decoder.py's MLP_WIDTHS, as the planner reads them
KV_HEADS = ("num_key_value_heads", "num_kv_heads")


def settable(config, key: str) -> bool:
    """The config has `key` and it is not a computed property (Falcon's head_dim: hidden / heads)."""
    return hasattr(config, key) and not isinstance(getattr(type(config), key, None), property)


def shrink(config, tokenizer):
    """The real config with fewer, narrower layers; everything that selects code paths is left alone. A setting the
    family does not have is not added (GPT-2 has no intermediate_size: its n_inner, or 4 x hidden)."""
    heads = getattr(config, "num_attention_heads", None) or SHAPE["num_attention_heads"]
    kv_key = next((key for key in KV_HEADS if getattr(config, key, None)), None)
    gqa = kv_key is not None and getattr(config, kv_key) < heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    hidden = config.hidden_size
    for key, value in SHAPE.items():
        if key in ("num_hidden_layers", "hidden_size", "num_attention_heads") or settable(config, key):
            setattr(config, key, value)
    for key in decoder.MLP_WIDTHS[1:]:  # None stays None (GPT-2: 4 x hidden)
        if getattr(config, key, None) and settable(config, key):
            setattr(config, key, SHAPE["intermediate_size"])
    if kv_key:
        setattr(config, kv_key, 2 if gqa else SHAPE["num_attention_heads"])
    if getattr(config, "rotary_dim", None):  # GPT-J, CodeGen: rotary on this many of each head's dims, in proportion
        config.rotary_dim = max(2, config.rotary_dim * SHAPE["head_dim"] // head_dim // 2 * 2)
    if getattr(config, "word_embed_proj_dim", None):  # OPT: embeddings of this width, projected to hidden (350M's)
        config.word_embed_proj_dim = max(2, config.word_embed_proj_dim * SHAPE["hidden_size"] // hidden)
    if getattr(config, "layer_types", None):  # per-layer attention types must match the layer count
        config.layer_types = config.layer_types[: SHAPE["num_hidden_layers"]]
    if getattr(config, "max_window_layers", None):
        config.max_window_layers = min(config.max_window_layers, SHAPE["num_hidden_layers"])
    if getattr(config, "moe_intermediate_size", None):  # Qwen3-30B-A3B's 128 experts of width 768: 38M parameters
        config.moe_intermediate_size = SHAPE["intermediate_size"] // 4
    return fit_tokenizer(config, tokenizer)


def fit_tokenizer(config, tokenizer):
    """The config's vocabulary and special tokens made the tokenizer's."""
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def model_dir(recipe: Path) -> Path:
    """Where the tiny model of `recipe` lives; prepare() names it to the ranks before build_model writes it."""
    return cache_dir() / "smoke" / Path(os.path.abspath(recipe)).name  # "." too: the folder's own name


def build_model(recipe: Path, source: Path, assets: dict) -> Path:
    """The model's config.json (`source`: model_source's) -> a tiny model of that architecture in the cache."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = model_dir(recipe)
    stamp = out / "smoke_source.json"
    if stamp.is_file() and stamp.read_text() == source.read_text():
        return out
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    config = shrink(load_config(source), tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    transformers.utils.logging.disable_progress_bar()  # a few KB: keep the output to the [smoke] lines
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stamp.write_text(source.read_text())  # last: a half-built folder is rebuilt
    return out


def model_source(recipe: Recipe) -> tuple[Path, str] | None:
    """The config.json the tiny model is built from, and the [smoke] line's words for it: the recipe's model's own
    (a local folder's, or a hub id's in the hub cache), else the recipe's `model_config.json` where the model is not
    here and that copy is of it (or of the model another run or the pack's assets will make). None for a recipe
    whose model is the tiny one already (tiny_assets)."""
    early = recipe.early
    model = str(early.model_name_or_path)
    shipped = recipe.folder / "model_config.json"
    in_cache = in_pack_cache(model)  # the pack's assets
    if in_cache and early.tiny_assets and not shipped.is_file():
        return None  # the tiny model already
    own = model_found.model_config_json(model, early.model_revision)
    if own is not None:
        arch = (json.loads(own.read_text()).get("architectures") or ["?"])[0]
        return own, f"{model} ({arch}, its own config.json {own})"
    if not shipped.is_file():
        raise UserError(f"recipe {recipe.name}: its model {model} is not here (no folder with config.json, not in "
                        f"the hub cache), and {shipped} does not exist, so there is no architecture to build a tiny "
                        f"model of. Fix: `hf download {model} config.json` (a few KB), or save the model's "
                        f"config.json as {shipped}.")
    copy = json.loads(shipped.read_text())
    made_later = early.continues_from or in_cache  # another run's model, or the pack's to prepare
    if copy.get("_name_or_path") != model and not made_later:  # a copied recipe pointed at another model
        raise UserError(f"{shipped} is the config of {copy.get('_name_or_path')}, but the recipe trains {model}, "
                        "which is not here (no folder with config.json, not in the hub cache): a smoke run would "
                        f"test {copy.get('_name_or_path')}'s architecture. Fix: point model_name_or_path at the "
                        f"model's folder, or `hf download {model} config.json` (a few KB), or save its config.json "
                        f"as {shipped}.")
    arch = (copy.get("architectures") or ["?"])[0]
    of = "" if copy.get("_name_or_path") == model else f", the config of {copy.get('_name_or_path')}"
    return shipped, f"{model} ({arch}, from {shipped}{of}: the model is not here)"


def scale_accelerate(acc: dict, gpus: int = 0) -> dict:
    """The recipe's accelerate YAML on this one machine: 2 CPU processes (an HSDP recipe 2 replicas of 2 shards, 4
    processes, so that both dimensions exist; a context-parallel recipe cp 2 over its 2 processes); with GPUs, one
    process per GPU up to the recipe's count, HSDP kept where there are 4 or more (2 replicas of half the GPUs each),
    cp kept where its size divides them, else plain FSDP over the GPUs there are. A tensor-parallel recipe keeps tp 2
    (the tiny model's 2 key/value heads allow no more): on CPU tp 2 over its 2 processes, with GPUs tp 2 x dp_shard
    the rest where they are an even count, else plain FSDP over the GPUs there are."""
    acc = dict(acc, num_machines=1, machine_rank=0, rdzv_backend="static", same_network=True)
    parallel = dict(acc.get("parallelism_config") or {})
    cp = int(parallel.get("parallelism_config_cp_size", 1))
    if int(parallel.get("parallelism_config_tp_size", 1)) > 1 and acc.get("distributed_type") == "FSDP":
        n = min(gpus, int(acc.get("num_processes", 1))) if gpus else 2
        if n % 2 == 0:  # transformers shards each layer over the 2 tp ranks, FSDP2 over the rest (config/mesh.py)
            acc.update(num_processes=n, parallelism_config={"parallelism_config_dp_shard_size": n // 2,
                                                            "parallelism_config_tp_size": 2})
            return acc
        acc.pop("parallelism_config")
        parallel, cp = {}, 1
    if cp > 1 and acc.get("distributed_type") == "FSDP":  # the row split over cp ranks, the rest dp_shard
        n = min(gpus, int(acc.get("num_processes", 1))) if gpus else 2
        cp = 2 if not gpus else cp if n % cp == 0 else 1  # on CPU: cp 2, the all-to-all form over 2 processes
        if cp > 1:
            acc.update(num_processes=n, parallelism_config={"parallelism_config_dp_shard_size": n // cp,
                                                            "parallelism_config_cp_size": cp})
            return acc
        acc.pop("parallelism_config")
        parallel = {}
    hsdp = int(parallel.get("parallelism_config_dp_replicate_size", 1)) > 1
    if gpus and acc.get("distributed_type") != "NO":
        n = min(gpus, int(acc.get("num_processes", 1)))
        if hsdp and n >= 4:
            parallel.update(parallelism_config_dp_replicate_size=2, parallelism_config_dp_shard_size=n // 2)
            acc.update(parallelism_config=parallel, num_processes=2 * (n // 2))
        else:
            acc.pop("parallelism_config", None)
            acc["num_processes"] = n
    elif hsdp:
        parallel.update(parallelism_config_dp_replicate_size=2, parallelism_config_dp_shard_size=2)
        acc.update(parallelism_config=parallel, num_processes=4)
    elif acc.get("distributed_type") != "NO":
        acc["num_processes"] = 2
    return acc


def prepare(recipe: Recipe, gpus: int = 0) -> Callable[[], Path] | None:
    """Point `recipe` at the smoke run's accelerate YAML and put the smoke overrides before the user's, for this
    machine's `gpus` (0: on CPU); prints each substitution; returns what builds the tiny model. The launcher calls
    the builder after it has started the ranks, so that building (transformers' import, a few seconds) overlaps
    their imports: they wait at the start gate until the checks pass anyway."""
    folder, acc = recipe.folder, recipe.accelerate  # the launcher checks acc's keys later
    assets = ensure_assets(quiet=True)
    kind = kinds.load(recipe.trainer)
    data = assets[kind.SMOKE_DATA]
    smoke_args = ["--dataset_name", str(data), "--dataset_train_split", "train",
                  "--dataset_test_split", "test", "--min_gpus", "0", "--tiny_assets", "true",
                  *([] if gpus else ["--use_cpu", "true"]),
                  "--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
                  "--output_dir", f"runs/smoke/{recipe.name}"]
    build = None
    source = model_source(recipe)
    if source is not None:
        build = functools.partial(build_model, folder, source[0], assets)  # called once the ranks are importing
        say(f"model: {source[1]} -> a tiny {SHAPE['num_hidden_layers']}-layer model of that architecture, in "
            f"{model_dir(folder)}")
        smoke_args = ["--model_name_or_path", str(model_dir(folder)), *smoke_args]
    early = recipe.early
    say(f"data: {early.dataset_name} -> {data} (local synthetic {recipe.trainer} data)")
    for field, (now, value) in recipe.differing(kind.SMOKE_SETTINGS).items():  # GRPO: a reward the data can feed
        smoke_args += [f"--{field}", *(value if isinstance(value, list) else [str(value)])]
        say(f"{field}: {now} -> {value}")
    if early.smollm2_assets or early.addition_preferences:  # the tiny model answers no additions
        smoke_args += ["--smollm2_assets", "false", "--addition_preferences", "false"]
    options, notes = speed.smoke(recipe.field, gpus)  # what this machine cannot run (speed/)
    smoke_args += options
    for note in notes:
        say(note)
    scaled = scale_accelerate(acc, gpus)
    where = f"{gpus} GPU(s)" if gpus else "CPU"
    path = cache_dir() / "smoke" / f"{recipe.name}.accelerate.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {recipe.accelerate_path} scaled for a smoke test on {where} "
                    "(fsdp_recipes.launch.smoke)\n" + yaml.safe_dump(scaled, sort_keys=True))
    meshed = any(int((acc.get("parallelism_config") or {}).get(f"parallelism_config_{d}_size", 1)) > 1
                 for d in ("tp", "cp"))
    dropped = (" (its tp or cp does not divide the GPUs: plain FSDP here)" if meshed else
               " (HSDP needs 4 GPUs for both dimensions: plain FSDP here)") if (
        acc.get("parallelism_config") and not scaled.get("parallelism_config")) else ""
    split = scaled.get("parallelism_config") or {}
    if int(split.get("parallelism_config_cp_size", 1)) > 1:  # context parallel kept: rows split over the cp ranks
        shard, cp = split["parallelism_config_dp_shard_size"], split["parallelism_config_cp_size"]
        dropped = f" as dp_shard {shard} x cp {cp}" + ("" if gpus else
                                                         " (context parallel: the all-to-all form on CPU)")
    if int(split.get("parallelism_config_tp_size", 1)) > 1:  # tensor parallel kept: each layer split over 2 ranks
        dropped = f" as dp_shard {split['parallelism_config_dp_shard_size']} x tp 2" + ("" if gpus else " (over gloo)")
    say(f"accelerate: {recipe.accelerate_path} with {acc.get('num_processes', 1)} process(es) on "
        f"{acc.get('num_machines', 1)} machine(s) -> {scaled.get('num_processes', 1)} on this one's {where} "
        f"({path}){dropped}")
    user = list(recipe.overrides)
    recipe.accelerate_path, recipe.accelerate = path, scaled
    recipe.overrides = [*smoke_args, *user]  # the user's overrides last: they win
    say(run_line(recipe.overrides, user))
    # the recipe's gates (metrics/gates.py) are for a full-size run on its hardware
    named = list(recipe.differing(dict.fromkeys(("mfu_min", "peak_memory_max_fraction"))))
    if named:
        say(f"gates ({', '.join(named)}): not judged on a smoke run (a tiny model's few steps say nothing of the "
            "recipe's MFU or memory on its hardware; metrics/gates.py)")
    return build


def run_line(overrides: list[str], user: list[str]) -> str:
    """What the smoke run will train, as its overrides stand (the smoke run's, then the user's, which win): its
    steps, its checkpoints and where it writes; `(yours)` after what the user's own overrides set."""
    (steps, my_steps), (strategy, my_strategy), (every, my_every), (out, my_out) = set_by(
        overrides, user, "max_steps", "save_strategy", "save_steps", "output_dir").values()
    saves = {"no": "no checkpoint", "steps": f"a checkpoint every {every} step(s)"}.get(
        str(strategy), f"checkpoints by save_strategy {strategy}")
    yours = " (yours)"
    return (f"run: {steps} step(s){yours * my_steps}, {saves}{yours * (my_strategy or my_every)}, in "
            f"{out}{yours * my_out}")
