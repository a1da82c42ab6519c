"""The commands of `fsdp-recipes <command>`: one row each, naming the `main(argv)` that runs it.

A command's module is imported only when that command runs (`fsdp-recipes recipes list` must not pay for the
planner's or the launcher's imports), so a row names it as "module:function"; `python -m <module>` runs the same
function. The rows are checked when this module loads: a name given twice, or a target that is not
"fsdp_recipes.<module>:<function>", fails there.
"""

from __future__ import annotations

import dataclasses
import re

TARGET = re.compile(r"^fsdp_recipes(\.\w+)+:\w+$")


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    target: str  # "fsdp_recipes.<module>:<function>": main(argv) -> exit code
    help: str
    aliases: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # set before the target runs (the smoke run is the launcher's mode)

    def __post_init__(self):
        if not TARGET.match(self.target):
            raise TypeError(f"command {self.name}: target {self.target!r} is not 'fsdp_recipes.<module>:<function>'")


COMMANDS = (
    Command("finetune", "fsdp_recipes.launch.launcher:main",
            "RECIPE [--field value ...]: checks, accelerate launch, summary (what launch.sh runs)",
            aliases=("launch",)),
    Command("smoke", "fsdp_recipes.launch.launcher:main",
            "RECIPE: its own launch path on CPU with a tiny model of its architecture",
            env=(("FSDP_RECIPES_SMOKE", "1"),)),
    Command("plan", "fsdp_recipes.planning.plan:main",
            "RECIPE --gpus 8 --nodes 1 --gpu H100 [--fit --comms --time]: will it fit? launches nothing"),
    Command("data", "fsdp_recipes.launch.data_preview:main",
            "RECIPE [--examples N] [--field value ...]: format, splits, token lengths, examples"),
    Command("job", "fsdp_recipes.cluster.command:main",
            "--launcher local|slurm|k8s RECIPE --nodes N --gpus G: the job for a cluster, written or submitted"),
    Command("recipes", "fsdp_recipes.config.recipes:main", "list | check NAME: the recipes, or whether NAME is one"),
    Command("report", "fsdp_recipes.metrics.run_comparison:main", "RUN [RUN ...] [--out DIR]: comparison table and plots"),
    Command("prometheus", "fsdp_recipes.metrics.prometheus:main", "RUN [RUN ...] --out FILE: the runs' gauges"),
    Command("summary", "fsdp_recipes.launch.summary:main", "RUN [--generate]: a finished run's end-of-run summary"),
    Command("export", "fsdp_recipes.checkpoint.export:main",
            "CHECKPOINT OUT: a sharded checkpoint as an inference-ready model or adapter"),
    Command("gguf", "fsdp_recipes.serving.gguf_export:main",
            "RUN [--type f16|bf16|q8_0|f32]: a GGUF file and Modelfile"),
    Command("serve-check", "fsdp_recipes.serving.engine_check:main",
            "RUN [--engine llama.cpp|vllm|all]: the served model's answers against transformers'"),
    Command("tiny-assets", "fsdp_recipes.assets.tiny_assets:main", "[--force]: the tests' tiny model and data"),
    Command("smollm2", "fsdp_recipes.assets.smollm2:main", "[--force]: the default's SmolLM2-135M-Instruct"),
)

BY_NAME = {name: c for c in COMMANDS for name in (c.name, *c.aliases)}
if len(BY_NAME) != sum(1 + len(c.aliases) for c in COMMANDS):
    raise TypeError("fsdp_recipes/cli/commands.py: a command name or alias is given twice")
