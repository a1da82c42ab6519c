"""Greedy answers from llama.cpp (llama-cpp-python) to chat questions, with the GGUF's own chat template.

Runs in the environment that has llama-cpp-python (`make serve-env`: built from source once, kept apart from the
training environment), so it imports nothing but the standard library and llama_cpp:

    <env>/bin/python src/fsdp_recipes/serving/llamacpp_answers.py MODEL.gguf QUESTIONS.jsonl TOKENS > answers.json

QUESTIONS.jsonl: one `{"prompt": [chat turns], ...}` per line (the default's held-out file). Prints a JSON list of the
answers (at most TOKENS tokens each), stripped, in order; serving/engine_check.py compares them with transformers'.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from llama_cpp import Llama

    model_path, questions, tokens = argv
    llm = Llama(model_path=model_path, n_ctx=2048, n_threads=2, seed=0, verbose=False)
    answers = []
    with open(questions) as f:
        for line in f:
            if not line.strip():
                continue
            prompt = json.loads(line)["prompt"]
            # the chat template comes from the GGUF's tokenizer.chat_template, rendered by llama-cpp-python
            out = llm.create_chat_completion(messages=prompt, temperature=0.0, max_tokens=int(tokens))
            answers.append((out["choices"][0]["message"]["content"] or "").strip())
    json.dump(answers, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
