"""The end-of-run summary: what the run did, from its run report, and what the model learned.

    python -m fsdp_recipes.launch.summary runs/tiny-cpu-lora [--generate | --no-generate]

Prints what the evaluation room computes (evaluation/scoring.py): the base model and the trained model (and any stage
between: base -> sft -> dpo), loaded with plain transformers (no FSDP, no accelerate), each scored on the same rows
of the eval split by every metric that applies (evaluation/scores/): the held-out loss and perplexity of the
reference answers, where the answers are short the exact match of its greedy answers, with 95% Wilson intervals
and an exact McNemar test between consecutive stages, and on preference data the preference for the chosen answer.
The summary doubles as a check that the saved model reloads.

That holds two whole models in host memory, so the generations run only where that is cheap: on the first node of
a job (the launcher runs this on every node), and for a model under 1B parameters (counted from the safetensors
headers, nothing loaded). Elsewhere the summary says in one line that they were skipped and how to get them:
`--generate` here, or FSDP_RECIPES_SUMMARY_GENERATIONS=1 for the launcher (size limit lifted; still the first node
only). FSDP_RECIPES_SUMMARY_GENERATIONS=0 skips them whatever the size (a pipeline with its own evaluation; the test
suite, outside the tests that check them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from fsdp_recipes import library_logs
from fsdp_recipes.config.kind_registry import DEFAULT_TRAINER
from fsdp_recipes.speed.four_bit import load_4bit, recorded
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.evaluation import scores, scoring
from fsdp_recipes.evaluation.engine_rules import vllm_lora_refusals, vllm_max_lora_rank
from fsdp_recipes.evaluation.eval_rows import EVAL_PROMPTS
from fsdp_recipes.evaluation.scoring import SHOWN_SAMPLES
from fsdp_recipes.evaluation.stages import trained_model_dir
from fsdp_recipes.metrics import gates, metrics_file
from fsdp_recipes.metrics.figures import figure, percent
from fsdp_recipes.metrics.run_comparison import human_bytes
from fsdp_recipes.serving import llamacpp_converter
from fsdp_recipes.train import kinds


GENERATION_LIMIT = 1_000_000_000  # parameters: two such models in fp32 are ~8 GB of host memory
# The launcher has no flag for it: "1" generates whatever the size, "0" never; unset (or "auto"): by size.
FORCE_ENV = "FSDP_RECIPES_SUMMARY_GENERATIONS"
FORCE_VALUES = ("0", "1", "auto")


def generation_setting() -> str:
    """FSDP_RECIPES_SUMMARY_GENERATIONS, checked: one of FORCE_VALUES."""
    value = os.environ.get(FORCE_ENV, "auto")
    if value not in FORCE_VALUES:
        raise UserError(f"{FORCE_ENV}={value!r} is not one of 0 (never), 1 (whatever the size), auto (by size). "
                        f"Fix: set one of those, or unset it.")
    return value


def model_size(model_dir: Path) -> tuple[int, int] | None:
    """(parameters, bytes) of the safetensors files in `model_dir`, from their headers and file sizes: no tensor
    is read. None without safetensors files."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    params = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                n = 1
                for dim in h.get_slice(key).get_shape():
                    n *= dim
                params += n
    return params, sum(f.stat().st_size for f in files)


def skip_generations(run_dir: Path, trained: Path, machine_rank: str, force: bool, size=None) -> str | None:
    """None: generate; else the one line saying why the generations were skipped and how to get them. `size`
    replaces model_size (tests)."""
    how = (f"run `python -m fsdp_recipes.launch.summary {run_dir} --generate` where the memory is, or set "
           f"{FORCE_ENV}=1 for the launcher")
    if str(machine_rank) != "0":
        return f"skipped on this node (machine rank {machine_rank}): the first node generates them"
    if force:
        return None
    found = (size or model_size)(trained)
    if found is None:
        return f"skipped: no safetensors files in {trained} to tell the model's size; {how}"
    params, nbytes = found
    if params >= GENERATION_LIMIT:
        return (f"skipped: the model has {params / 1e9:.1f}B parameters (the limit is {GENERATION_LIMIT / 1e9:g}B), "
                f"and loading it and the base model on CPU would take about {human_bytes(2 * nbytes)} of host "
                f"memory; {how}")
    return None


PROMPTS_ENV = "FSDP_RECIPES_SUMMARY_PROMPTS"  # fewer (or more) eval prompts than EVAL_PROMPTS


def eval_prompts() -> int:
    """How many eval prompts the generations answer: FSDP_RECIPES_SUMMARY_PROMPTS, else EVAL_PROMPTS. On CPU the
    prompts' prefill is most of the time (the default's 100 questions, base and trained model: 61 s on 2 cores
    while another test ran)."""
    value = os.environ.get(PROMPTS_ENV, str(EVAL_PROMPTS))
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{PROMPTS_ENV}={value!r} is not a positive whole number. Fix: set it to how many eval "
                        f"prompts the summary should generate for (default {EVAL_PROMPTS}), or unset it.")
    return int(value)


def settings() -> tuple[int, str]:
    """(eval_prompts(), generation_setting()): the launcher reads them before the training, so that a bad value is
    one line before any rank starts rather than after the run."""
    return eval_prompts(), generation_setting()


def learning_check(run_dir: Path, run_args: dict, n: int = EVAL_PROMPTS, cfg=None) -> dict | None:
    """Every stage scored (evaluation/scoring.py); a 4-bit run's base loaded as it trained, in 4 bits with the run's
    settings (speed/four_bit.py). How to load it is handed down from here: the scoring names no speed option
    (4-bit loading is one), and evaluation/ does not import the room that holds them."""
    model_args = run_args.get("model_args") or {}
    four_bit = recorded(model_args) is not None
    return scoring.learning_check(run_dir, run_args, n, cfg,
                                  (lambda base: load_4bit(base, model_args)) if four_bit else None)


def eval_lines(check: dict, on_pairs: bool = False) -> list[str]:
    """The lines of every metric (evaluation/scores/) in the summary's order: those on the reference answers (held-out
    loss, exact match with its intervals and paired verdicts, the 4-bit model), or with `on_pairs` those on the
    preference rows."""
    return [line for m in scores.METRICS.values() if m.on_pairs() == on_pairs for line in m.lines(check)]


def rows_note(check: dict) -> list[str]:
    """Where the scored rows were not all held out: the line that says so, after the scores on them."""
    if check.get("eval_rows_changed"):
        from fsdp_recipes.checkpoint import resume_settings  # imports transformers: not in the launcher's start

        moved = resume_settings.described(check["eval_rows_changed"])
        return [f"            the held-out rows changed on resume ({moved}): rows the first part trained on may be "
                "among these, so they are not held out"]
    if not check.get("held_out", True):
        return ["            the data has no eval split (test, validation, valid, eval, dev): these rows were "
                "trained on; eval_split_size: 0.1 holds 10% out"]
    if check.get("eval_rows_in_train"):
        shared, scored = check["eval_rows_in_train"], check.get("rows", check["n"])
        return [f"            {shared} of these {scored} eval rows also appear in the training data: their answers "
                "are not held out"]
    return []


def shown(text: str) -> str:
    """A generation as a quoted literal a terminal prints cleanly: a random or untrained model emits token pieces
    that decode to U+FFFD or control characters, which become escapes (`\\ufffd`) instead of mojibake."""
    if text.isprintable() and "\ufffd" not in text:
        return repr(text)
    return ascii(text)


def eval_loss_counts(metrics: dict, run_args: dict) -> str:
    """What TRL's eval loss (metrics.json final_eval_loss) is and which tokens it counts, as the run's kind says
    (its eval_loss): the trainer's own loss on the whole eval split. The summary's held-out loss, beside it, counts
    the reference answers' tokens alone (evaluation/answer_loss.py): the two differ by design."""
    name = metrics.get("trainer") or (run_args.get("pack_args") or {}).get("trainer") or DEFAULT_TRAINER
    kind = kinds.KINDS.get(name)
    if kind is None or kind.eval_loss is None:
        return f"TRL's {name.upper()} loss on the eval split during training"
    return kind.eval_loss(run_args)


def render(run_dir: Path, metrics: dict, check: dict | None, skipped: str | None = None,
           run_args: dict | None = None) -> str:
    """The summary's lines; `run_args`: the run's run_args.json (what its eval loss counts)."""
    m = metrics
    lines = [f"== {m.get('recipe') or run_dir.name}: {m['status']} in {figure(m.get('wall_clock_s'), '.0f')}s =="]
    if m.get("first_train_loss") is not None:
        ev = f", eval {figure(m['final_eval_loss'], '.3f')}" if m.get("final_eval_loss") is not None else ""
        lines.append(f"loss        {figure(m['first_train_loss'], '.3f')} -> {figure(m.get('final_train_loss'), '.3f')} "
                     f"(train){ev}")
        if ev:  # two eval losses in one summary: which tokens each counts
            answers = ("; the held-out loss below: the reference answers' tokens alone, no prompt"
                       if (check or {}).get("loss") else "")
            lines.append(f"            eval: {eval_loss_counts(m, run_args or {})}{answers}")
    tps = m.get("tokens_per_second")
    lines.append(
        f"throughput  {figure(tps, ',.0f')} tokens/s ({figure(m.get('tokens_per_second_per_device'), ',.0f')} per "
        f"device), {m['steps']} steps, {figure(m['tokens']['non_padding'], ',')} tokens" if tps else "throughput  n/a"
    )
    if m.get("trainer") in kinds.names():  # the kind's own lines (GRPO: what was sampled, and what it scored)
        lines += kinds.load(m["trainer"]).summary_lines(m)
    mfu = percent(m["mfu"]) if m.get("mfu") is not None else f"n/a ({m.get('mfu_note')})"
    source = m.get("peak_flops_source")
    lines.append(f"MFU         {mfu}" + (f" {source}" if source and m.get("mfu") is not None else ""))
    pm = m["peak_memory"]
    dev = (
        f"device {human_bytes(pm['device_allocated_bytes'])} allocated / {human_bytes(pm['device_reserved_bytes'])} reserved, "
        if pm.get("device_allocated_bytes") is not None else ""
    )
    lines.append(f"peak memory {dev}host RSS {human_bytes(pm['host_rss_bytes'])} (max over ranks)")
    lines += gates.lines(m.get("gates") or {})
    lines.append(
        f"sharding    {m['sharding_strategy']} (FSDP{m['fsdp_version'] or '-'}), world size {m['world_size']}, "
        f"{m['num_nodes']} node(s), {m['device']['type']}: {m['device']['name']}"
    )
    shards = m.get("param_shards") or {}
    if shards.get("dtensor_params"):
        shares = ", ".join(f"{100 * n / shards['global_numel']:.1f}%" for n in shards["local_numel_per_rank"])
        lines.append(
            f"shards      {shards['dtensor_params']} parameters are DTensors; the ranks hold {shares} "
            f"of {shards['global_numel'] / 1e6:.2f}M"
        )
    files = [p.name + ("/" if p.is_dir() else "") for p in sorted(run_dir.iterdir()) if not p.name.startswith(".")]
    lines.append(f"files       {run_dir}/: {', '.join(files)}")
    if check:
        lines += eval_lines(check) + rows_note(check) + eval_lines(check, on_pairs=True)
        lines += [f"warning     {line}" for line in check.get("mixed_folders", [])]  # scored adapter on top
        lines += [f"  {shown(ex['prompt'])}: expected {shown(ex['expected'])} | base {shown(ex['base'])} | "
                  f"trained {shown(ex['trained'])}" for ex in check["examples"][:SHOWN_SAMPLES]]
    if skipped:
        lines.append(f"generations {skipped}")
    lines += serve_lines(run_dir)
    return "\n".join(lines)


def serve_lines(run_dir: Path) -> list[str]:
    """How to serve what this run made: vLLM on its merged (or full) model, and on the base model with its LoRA
    adapter; llama.cpp and Ollama through `fsdp-recipes gguf` (`make gguf`), left out where llama.cpp's converter would
    refuse the tokenizer; `fsdp-recipes serve-check` to compare their answers (docs/serving.md)."""
    model = trained_model_dir(run_dir)
    if model is None:
        return []
    lines = [f"serve it    vLLM: vllm serve {model}"]
    adapter = run_dir / "adapter_config.json"
    if adapter.is_file():
        config = json.loads(adapter.read_text())
        base = config.get("base_model_name_or_path")
        refused = vllm_lora_refusals(config)  # vLLM's own rules for an adapter (evaluation/engine_rules.py)
        if refused:
            offer = "serve the merged model above" if model != run_dir else "serve the model above"
            lines.append(f"            vLLM, base + adapter: not offered: vLLM refuses this adapter "
                         f"({'; '.join(refused)}); {offer}")
        else:
            tokenizer = f" --tokenizer {run_dir}" if (run_dir / "tokenizer_config.json").is_file() else ""  # its template
            lines.append(f"            vLLM, base + adapter: vllm serve {base} --enable-lora --max-lora-rank "
                         f"{vllm_max_lora_rank(config)} --lora-modules {run_dir.name}={run_dir}{tokenizer}")
    name = run_dir.resolve().name  # serving/gguf_export.py's file name for it
    # the `fsdp-recipes` form works wherever the pack is installed; the make target in the pack's checkout
    refused = llamacpp_converter.unknown_pre_tokenizer(model)  # the converter's refusal, where it is installed
    if refused:
        lines.append(f"            llama.cpp / Ollama: not offered: {refused}")
        lines.append(f"            check they answer like this run: fsdp-recipes serve-check {run_dir} --engine vllm "
                     f"(make serve-check RUN={run_dir} ENGINE=vllm)")
        return lines
    unsure = ""
    if llamacpp_converter.byte_level_bpe(model) and not converter_installed():
        unsure = (" (llama.cpp's converter refuses a byte-level BPE tokenizer it does not know; with the converter "
                  f"installed, fsdp-recipes gguf --install-converter, `fsdp-recipes gguf {run_dir} --check-only` "
                  "tells in seconds)")
    lines.append(f"            llama.cpp / Ollama: fsdp-recipes gguf {run_dir} (make gguf RUN={run_dir}){unsure}, then "
                 f"llama-server -m {run_dir}/gguf/{name}.f16.gguf, or ollama create {name} -f "
                 f"{run_dir}/gguf/Modelfile")
    lines.append(f"            check they answer like this run: fsdp-recipes serve-check {run_dir} "
                 f"(make serve-check RUN={run_dir})")
    return lines


def converter_installed() -> bool:
    try:
        llamacpp_converter.location()
    except UserError:
        return False
    return True


@cli
def main(argv: list[str] | None = None, recipe=None) -> int:
    """`recipe`: the launcher's loaded recipe (config/recipes.py), whose parsed settings the generations use;
    run from the command line, the run's run_args.json says them."""
    library_logs.divert(lambda text: None)  # run alone: loading the 4-bit base imports bitsandbytes here
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    gen = ap.add_mutually_exclusive_group()
    gen.add_argument("--no-generate", action="store_true", help="skip the before/after generation")
    gen.add_argument("--generate", action="store_true",
                     help=f"generate whatever the model's size (default: under {GENERATION_LIMIT / 1e9:g}B parameters; "
                          f"also {FORCE_ENV}=1)")
    ap.add_argument("--machine-rank", default="0", help="this node's rank in the job: only node 0 generates")
    args = ap.parse_args(argv)
    prompts, setting = settings()
    metrics_path = args.run_dir / "metrics.json"
    if not metrics_path.is_file():
        raise UserError(f"no run report at {metrics_path}. Fix: pass the output_dir of a finished run.")
    metrics = json.loads(metrics_path.read_text())
    run_args = json.loads((args.run_dir / "run_args.json").read_text())
    check = skipped = None
    trained = None if args.no_generate else trained_model_dir(args.run_dir)
    if trained is not None:
        if setting == "0" and not args.generate:
            skipped = f"skipped: {FORCE_ENV}=0"
        else:
            skipped = skip_generations(args.run_dir, trained, args.machine_rank, args.generate or setting == "1")
        if skipped is None:
            check = learning_check(args.run_dir, run_args, prompts, recipe.cfg if recipe is not None else None)
            if check and not check.get("rows"):  # nothing to score: the line says why
                skipped, check = check.get("note"), None
    if check:
        (args.run_dir / "sample_generations.json").write_text(json.dumps(check, indent=2) + "\n")
        metrics = metrics_file.amend(args.run_dir, lambda m: {**m, "eval": scoring.eval_section(check)})
    print(render(args.run_dir, metrics, check, skipped, run_args))
    code = gates.exit_code(metrics)
    if code:
        print(f"error: {gates.verdict_line(metrics['gates'])}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
