"""Does the served model answer like the trained one? llama.cpp against transformers, on the run's held-out questions.

    python -m fsdp_recipes.serving.engine_check runs/smollm2-135m-lora      # make serve-check RUN=...

Exports the run's merged model to GGUF f16 and q8_0 (serving/gguf_export.py) where not done yet, has llama.cpp
(llama-cpp-python, in the environment `make serve-env` builds: FSDP_RECIPES_LLAMACPP_PYTHON names its python)
answer the eval split's questions greedily with the GGUF's own chat template, and the merged folder answer them with
plain transformers (assets/generation.py, as the run's summary does). Passes when llama.cpp's f16 exact match is
within TOLERANCE of transformers'; the q8_0 figure is reported beside it. Writes <run>/gguf/engine_check.json.
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

from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.paths import cache_dir

TOLERANCE = 2  # exact-match answers out of the held-out questions
PYTHON_ENV = "FSDP_RECIPES_LLAMACPP_PYTHON"


def llamacpp_python() -> Path:
    path = Path(os.environ.get(PYTHON_ENV) or cache_dir() / "serve-env" / "llamacpp" / "bin" / "python")
    if not path.is_file():
        raise UserError(f"no llama-cpp-python environment at {path}. Fix: make serve-env (builds it once, about "
                        f"{BUILD_MINUTES} minutes on 2 cores), or set {PYTHON_ENV} to a python that has llama_cpp.")
    return path


BUILD_MINUTES = "3 to 7"


def held_out(run: Path) -> list[dict]:
    """The run's eval split (its train split when it has none), as the summary reads it: chat prompt, expected."""
    from trl import DatasetMixtureConfig, ScriptArguments

    from fsdp_recipes.train.loading import load_raw

    run_args = json.loads((run / "run_args.json").read_text())
    script = ScriptArguments(**run_args["script_args"])
    ds = load_raw(script, DatasetMixtureConfig(**run_args["dataset_mixture"]))
    rows = ds[script.dataset_test_split if script.dataset_test_split in ds else script.dataset_train_split]
    if "prompt" not in rows.column_names or "completion" not in rows.column_names:
        raise UserError(f"the eval data of {run} has no prompt-completion rows to ask. Fix: check a run trained on "
                        "prompt-completion chat data (the default's).")
    return [{"prompt": r["prompt"], "expected": r["completion"][-1]["content"]} for r in rows]


def llamacpp_answers(gguf_file: Path, questions: list[dict]) -> tuple[list[str], float]:
    script = Path(__file__).with_name("llamacpp_answers.py")
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps({"prompt": q["prompt"]}) + "\n" for q in questions)
    start = time.time()
    res = subprocess.run([str(llamacpp_python()), str(script), str(gguf_file), f.name], capture_output=True,
                         text=True)
    os.unlink(f.name)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"llama.cpp could not answer with {gguf_file}: {tail}. Fix: re-export it (make gguf), or "
                        f"rebuild the environment (make serve-env).")
    return json.loads(res.stdout), time.time() - start


def check(run: Path) -> dict:
    from fsdp_recipes.assets.generation import generate
    from fsdp_recipes.serving import gguf_export

    folder = gguf_export.model_folder(run)
    questions = held_out(run)
    expected = [q["expected"] for q in questions]
    score = lambda answers: sum(a == e for a, e in zip(answers, expected))  # noqa: E731
    start = time.time()
    reference = generate(str(folder), [q["prompt"] for q in questions])
    result = {"run": str(run), "questions": len(questions), "metric": "exact match of the greedy answer (stripped)",
              "transformers": {"correct": score(reference), "seconds": round(time.time() - start, 1)}}
    for qtype in ("f16", "q8_0"):
        out = gguf_export.default_out(run, folder, qtype)
        if not out.is_file():
            gguf_export.export(folder, out, qtype)
        answers, seconds = llamacpp_answers(out, questions)
        result[f"llama.cpp {qtype}"] = {"file": str(out), "correct": score(answers), "seconds": round(seconds, 1),
                                        "same_answer_as_transformers": sum(a == r for a, r in zip(answers, reference))}
    result["passed"] = abs(result["llama.cpp f16"]["correct"] - result["transformers"]["correct"]) <= TOLERANCE
    (run / "gguf" / "engine_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a finished run's output_dir")
    args = ap.parse_args(argv)
    if not (args.run / "run_args.json").is_file():
        raise UserError(f"{args.run} is not a finished run (no run_args.json). Fix: point at a run's output_dir.")
    r = check(args.run)
    n, hf = r["questions"], r["transformers"]["correct"]
    f16, q8 = r["llama.cpp f16"], r["llama.cpp q8_0"]
    print(f"[serve-check] exact match on {n} held-out questions: transformers {hf}/{n}, llama.cpp f16 "
          f"{f16['correct']}/{n} ({f16['same_answer_as_transformers']} answers identical), q8_0 {q8['correct']}/{n}: "
          + ("passed" if r["passed"] else f"FAILED (f16 more than {TOLERANCE} from transformers)"))
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
