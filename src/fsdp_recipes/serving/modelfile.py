"""An Ollama Modelfile beside a GGUF file: the file, the chat template in Ollama's Go-template syntax, and the stop
tokens, so that `ollama create <name> -f Modelfile` answers with the model's own chat format.

The Jinja chat template in the GGUF metadata is what llama.cpp uses; Ollama reads its own TEMPLATE instead. The
families written here use ChatML (SmolLM2, Qwen: <|im_start|>role ... <|im_end|>) or Llama 3's header tokens; for
another template the Modelfile names the GGUF only, and says so in a comment (Ollama then falls back to its own
detection of the GGUF's template).
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = """TEMPLATE \"\"\"{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
\"\"\"
PARAMETER stop "<|im_end|>"
PARAMETER stop "<|im_start|>"
"""
LLAMA3 = """TEMPLATE \"\"\"{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

\"\"\"
PARAMETER stop "<|eot_id|>"
"""


def chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = folder / "tokenizer_config.json"
    return json.loads(config.read_text()).get("chat_template") if config.is_file() else None


def write(gguf_file: Path, folder: Path) -> Path:
    """<gguf folder>/Modelfile for `gguf_file`, with the template of the model in `folder`; returns its path."""
    template = chat_template(folder) or ""
    if "<|im_start|>" in template:
        body, family = CHATML, "ChatML (<|im_start|> ... <|im_end|>)"
    elif "<|start_header_id|>" in template:
        body, family = LLAMA3, "Llama 3 headers"
    else:
        body, family = "", None
    lines = [f"# Ollama: ollama create <name> -f {gguf_file.parent / 'Modelfile'}; written by fsdp_recipes.serving",
             f"FROM ./{gguf_file.name}"]
    lines.append(f"# chat format: {family}" if family else
                 "# chat format: not one this writer knows; Ollama reads the GGUF's own chat template")
    text = "\n".join(lines) + "\n" + body + "PARAMETER temperature 0\n"  # greedy, as the run's summary answers
    path = gguf_file.parent / "Modelfile"
    path.write_text(text)
    return path
