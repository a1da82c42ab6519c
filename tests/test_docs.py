"""The docs stay true: every shell command shown in README.md and docs/*.md is run by a test or marked as not
runnable here, every relative link resolves, and the README's recipe table agrees with the recipes' budgets.

A command shown in a ```bash, ```sh or ```console block (in console blocks, the lines after `$ `) must be one of:
- RUN_HERE: cheap (no training, no network), so this file runs it. A `make` target is expanded with `make -n` and
  the module it calls runs in this process: the planner's first import costs seconds, a subprocess per command
  would cost that each time. In a console block, the output shown must be what the command prints.
- RUN_BY: expensive (training, the suite itself), so a named test or CI script runs it; this file checks that the
  named file holds the lines that run it, and, for a `make` target, that `make -n` expands to what that file runs.
  The test may pass its own output directory or fewer steps; the target, module and recipe are the shown ones.
- marked in the doc with a trailing comment that ends `needs a GPU`, `needs <N> GPUs`, `needs the hub`,
  `needs a Slurm cluster`, `needs Kubernetes` or `needs the network` (the suite runs offline; `make test-compat`
  downloads every library from PyPI).
No multi-process training here, and nothing that installs: `make -n` with the stamp marked old (`-o`) never builds
the venv.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdp_recipes.config import recipes

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "console"}
NOT_RUNNABLE = re.compile(r"#[^\n]*\bneeds (a GPU|\d+ GPUs|the hub|a Slurm cluster|Kubernetes|the network)\s*$")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")  # indented fences too (list items)

# Commands this file runs. Value: the exit code the command must return.
RUN_HERE = {
    "make help": 0,
    "make plan RECIPE=mistral-7b-full GPUS=8 NODES=1 GPU=H100": 0,
    "make plan RECIPE=mistral-7b-full GPUS=1 GPU=H100": 1,  # docs/planner.md shows it refusing
    "fsdp-recipes plan mistral-7b-full --gpus 8 --nodes 1 --gpu H100": 0,
    "fsdp-recipes plan mistral-large-hsdp --gpus 8 --nodes 2 --gpu H100": 0,
    # the planner's questions (docs/planner.md, README): in this process, a second or so each
    'make plan RECIPE=mistral-7b-full GPUS=8 GPU=H100 ARGS="--max_length 8192 --fit --comms"': 0,  # the README's
    # docs/planner.md's: the recipe's settings before issue 57 (checkpointing full, 4 x 4), which its hand counts use
    'make plan RECIPE=mistral-7b-full GPUS=8 GPU=H100 ARGS="--per_device_train_batch_size 4 '
    '--gradient_accumulation_steps 4 --activation_checkpointing_policy full --max_length 8192 --fit --comms"': 0,
    'make plan RECIPE=mistral-large-hsdp GPUS=8 NODES=2 GPU=H100 ARGS="--activation_checkpointing_policy full '
    '--scale 1,4,64"': 0,
    'make plan RECIPE=mistral-7b-full GPUS=8 GPU=H100 ARGS="--per_device_train_batch_size 4 '
    '--gradient_accumulation_steps 4 --activation_checkpointing_policy full --time --rows 200000 '
    '--tokens-per-row 1400"': 0,
    'make plan RECIPE=recipes/llama-3.1-8b-lora GPUS=8 GPU=H100 ARGS="--per_device_train_batch_size 8 --fit"': 0,
    # issue 60's meshes (docs/planner.md, "Meshes"): the 128k recipe's cp mesh fits; the 70B full fine-tune does not
    # fit 2 nodes under FSDP, and --fit proposes a mesh
    'make plan RECIPE=llama-3.1-8b-lora-128k GPUS=8 GPU=H100 ARGS="--fit --comms"': 0,
    'make plan RECIPE=llama-3.1-70b-qlora-2xh100 GPUS=8 NODES=2 GPU=H100 ARGS="--load_in_4bit false --use_peft false '
    '--min_gpus 1 --fit"': 1,
    # the 70B tp recipe's mesh in the plan's words and its --comms (docs/planner.md, "Meshes")
    'make plan RECIPE=llama-3.1-70b-full-tp GPUS=8 NODES=2 GPU=H200 ARGS="--comms"': 0,
    # NeMo Automodel's setting for the 8B LoRA job on one H100 (docs/planner.md, activation checkpointing)
    'make plan RECIPE=llama-3.1-8b-lora GPUS=1 GPU=H100 ARGS="--per_device_train_batch_size 2 --lora_dropout 0 '
    '--activation_checkpointing_policy auto"': 0,
    "fsdp-recipes job --launcher k8s --help": 0,
    "fsdp-recipes job --launcher slurm mistral-small-lora --nodes 2 --gpus 8 --print": 0,
    "fsdp-recipes --help": 0,
    "mkdir -p slurm-logs": 0,  # the folder ships with a .gitignore, so this changes nothing in the checkout
}


@dataclass(frozen=True)
class RunBy:
    """`where` (a test, or CI's script) holds every line in `lines`; a make target expands (`make -n`) to `expands`."""

    where: tuple[str, ...]
    lines: tuple[str, ...]
    expands: str | None = None


RUN_BY = {
    # test_default_recipe runs the default recipe's launch.sh, copied into another project (2 steps instead of 48,
    # its own output_dir and cache); `make finetune` is that recipe's launch.sh.
    "make finetune": RunBy(("tests/test_default_recipe.py",),
                           ('DEFAULT, GPU_RECIPE = "smollm2-135m-lora"', 'run(["./launch.sh", *args]',
                            'launch_copy(project, DEFAULT, ["--max_steps"'),
                           expands="bash recipes/smollm2-135m-lora/launch.sh"),
    # The launcher's exit code for scripts, through make: test_make runs `make finetune` with EXIT_CODE_FILE for
    # each code (the launcher ending at once, tests/probes' FAKE_LAUNCH_EXIT).
    "make finetune EXIT_CODE_FILE=exit_code": RunBy(
        ("tests/test_make.py",), ('make_target(tmp_path, "finetune", "RECIPE=tiny-cpu-lora", f"EXIT_CODE_FILE={files[code]}"',
                                  'assert files[code].read_text() == f"{code}\\n"'),
        expands="FSDP_RECIPES_EXIT_CODE_FILE="),
    # The suite itself, and CI's steps: .ci/run runs these on a clean checkout.
    "make test": RunBy((".ci/run",), ("make test",), expands="-m pytest -v -n 2 --dist loadfile"),
    "make test-fast": RunBy((".ci/run",), ("make test",), expands='-m pytest -q -m "not slow"'),
    "make venv": RunBy((".ci/run",), ("make venv",)),
    "make test-serve": RunBy((".ci/run",), ("make test-serve",), expands="-m pytest -v -m serve"),
    "make arch-matrix": RunBy((".ci/run",), ("make arch-matrix",), expands="scripts/arch_matrix.py"),
    # Every recipe's smoke run; mistral-small-lora's through `make smoke` itself, the others through the launcher
    # with FSDP_RECIPES_SMOKE=1, which is what it runs.
    "make smoke RECIPE=mistral-small-lora": RunBy(
        ("tests/test_smoke.py",),
        ('["make", "--no-print-directory", "smoke", f"RECIPE={recipe}"', '@pytest.mark.parametrize("name", SMOKED)',
         "res = smoke(name, cache_dir, out)", 'THROUGH_MAKE = {"mistral-small-lora", "nope"}')),
    # The data preview on a user's Alpaca file, in process (the module `make data` runs).
    'make data RECIPE=tiny-cpu-lora ARGS="--dataset_name mine.jsonl --eval_split_size 2"': RunBy(
        ("tests/test_data_lengths.py",), ('preview(["tiny-cpu-lora", "--dataset_name", path, "--eval_split_size", "2"',),
        expands="-m fsdp_recipes.cli data tiny-cpu-lora --dataset_name mine.jsonl --eval_split_size 2"),
    # The export module on a real 2-rank sharded checkpoint.
    "make export CKPT=runs/x/checkpoint-200 OUT=exported/": RunBy(
        ("tests/test_sharded_checkpoints.py",), ('[sys.executable, "-m", "fsdp_recipes.checkpoint.export"',),
        expands="-m fsdp_recipes.cli export runs/x/checkpoint-200 exported/"),
    # The generator with the same recipe and sizes, into a temporary folder instead of k8s/generated/.
    "make k8s RECIPE=mistral-small-lora NODES=2 GPUS=8": RunBy(
        ("tests/test_k8s.py",), ('generate("mistral-small-lora", root / "m", "--nodes", "2", "--gpus", "8")',),
        expands="-m fsdp_recipes.cli job --launcher k8s mistral-small-lora --nodes 2 --gpus 8"),
    # What the launcher starts: launcher.py builds exactly this command, and test_end_to_end runs the launcher.
    "accelerate launch --config_file recipes/tiny-cpu-lora/accelerate.yaml -m fsdp_recipes.train.entry "
    "--recipe_settings /tmp/fsdp-recipes-torchrun-<id>/recipe_settings.json": RunBy(
        ("src/fsdp_recipes/launch/ranks.py", "tests/test_end_to_end.py", "src/fsdp_recipes/config/handoff.py"),
        ('["--config_file", str(recipe.accelerate_path)',
         '["-m", "fsdp_recipes.train.entry", *handoff.rank_argv(settings_file(torchrun_logs))]',
         'return torchrun_logs / "recipe_settings.json"',
         'FLAG = "--recipe_settings"',
         'launch(["tiny-cpu-lora"')),
}


@dataclass(frozen=True)
class Shown:
    doc: str
    line: int
    command: str  # as written, continuation lines joined
    output: tuple[str, ...] = ()  # console blocks: the lines shown after the command

    @property
    def key(self) -> str:
        return canonical(self.command)

    @property
    def marked(self) -> bool:
        return bool(NOT_RUNNABLE.search(self.command))

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.command}"


def canonical(command: str) -> str:
    """The command without its comment, one space between words (quotes kept out of the comparison)."""
    return " ".join(shlex.split(command, comments=True))


def shown_commands() -> list[Shown]:
    found = []
    for doc in DOCS:
        name = str(doc.relative_to(REPO))
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            marker, lang = fence.groups()
            i += 1
            block = []
            while i < len(lines) and not lines[i].strip().startswith(marker):
                block.append((i + 1, lines[i]))
                i += 1
            i += 1  # the closing fence
            if lang in SHELL_BLOCKS:
                found += commands_in(name, block, console=lang == "console")
    return found


def commands_in(doc: str, block: list[tuple[int, str]], console: bool) -> list[Shown]:
    out: list[Shown] = []
    pending: tuple[int, str] | None = None  # a command continued with a trailing backslash
    output: list[str] = []
    for number, text in block:
        if pending:
            first, so_far = pending
            pending = None
            text = so_far + " " + text.strip()
            number = first
        elif console:
            if not text.startswith("$ "):
                if out:
                    output.append(text)
                continue
            if out:
                out[-1] = Shown(out[-1].doc, out[-1].line, out[-1].command, tuple(output))
            output = []
            text = text[2:]
        elif not text.strip() or text.lstrip().startswith("#"):
            continue
        if text.rstrip().endswith("\\"):
            pending = (number, text.rstrip()[:-1].rstrip())
            continue
        out.append(Shown(doc, number, text.strip()))
    assert pending is None, f"{doc}: a command ends in a backslash"
    if console and out:
        out[-1] = Shown(out[-1].doc, out[-1].line, out[-1].command, tuple(output))
    return out


SHOWN = shown_commands()
KEYS = {canonical(k) for k in [*RUN_HERE, *RUN_BY]}
assert len(KEYS) == len(RUN_HERE) + len(RUN_BY), "a command is listed twice"


def test_docs_show_commands_at_all():
    assert len(SHOWN) >= 10 and any(s.doc == "README.md" for s in SHOWN)


def test_every_command_is_run_or_marked():
    loose = [str(s) for s in SHOWN if not s.marked and s.key not in KEYS]
    assert not loose, ("commands neither run by a test nor marked `# needs ...`; add them to RUN_HERE or RUN_BY in "
                       "tests/test_docs.py, or mark them:\n" + "\n".join(loose))


def test_marked_commands_are_not_claimed_to_run():
    both = [str(s) for s in SHOWN if s.marked and s.key in KEYS]
    assert not both, both


def test_no_listed_command_is_stale():
    """A listed command the docs no longer show would be a claim about nothing."""
    shown = {s.key for s in SHOWN}
    assert not KEYS - shown, sorted(KEYS - shown)


# ------------------------------------------------------------------ running the cheap ones


def make_dry_run(words: list[str]) -> list[str]:
    """What `make` would run for these words, without running it or (re)building the venv."""
    venv = Path(sys.prefix)
    res = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={venv}", "-o", str(venv / ".installed"),
                          *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    text = re.sub(r"\\\n\s*", " ", res.stdout)  # a recipe line continued with a backslash is one command
    return [line for line in text.splitlines() if line.strip()]


def module_call(line: str) -> tuple[str, list[str]]:
    """`<python> -m <module> <args>` -> (module, args)."""
    words = shlex.split(line)
    at = words.index("-m")
    assert Path(words[0]).name.startswith("python"), line
    return words[at + 1], words[at + 2:]


def run_module(module: str, args: list[str], monkeypatch) -> tuple[int, str]:
    """`python -m module args`, in this process: the module's `sys.exit(main())` guard, with main(args)."""
    mod = importlib.import_module(module)
    if hasattr(mod, "__path__"):  # a package (the CLI): `python -m` runs its __main__
        mod = importlib.import_module(f"{module}.__main__")
    assert "sys.exit(main())" in Path(mod.__file__).read_text(), f"{module} has no `python -m` entry of the usual form"
    monkeypatch.chdir(REPO)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = mod.main(args)
        except SystemExit as stop:  # argparse's --help and errors, the cli decorator
            code = stop.code
    return int(code or 0), out.getvalue() + err.getvalue()


def run_here(command: str, monkeypatch) -> tuple[int, str]:
    words = shlex.split(command, comments=True)
    if words[:2] == ["make", "help"]:  # no prerequisites: safe to run as is
        res = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        return res.returncode, res.stdout + res.stderr
    if words[0] == "make":
        calls = [line for line in make_dry_run(words) if " -m " in line]
        assert len(calls) == 1, f"{command}: expected make to run one module, got {calls}"
        return run_module(*module_call(calls[0]), monkeypatch)
    if words[:2] == ["python", "-m"]:
        return run_module(words[2], words[3:], monkeypatch)
    if words[0] == "fsdp-recipes":  # the console script: what `python -m fsdp_recipes.cli` runs
        return run_module("fsdp_recipes.cli", words[1:], monkeypatch)
    res = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=60)
    return res.returncode, res.stdout + res.stderr


HERE = sorted({s.key: s for s in SHOWN if s.key in {canonical(k) for k in RUN_HERE}}.values(), key=str)


@pytest.mark.parametrize("shown", HERE, ids=[s.key for s in HERE])
def test_cheap_commands_run_as_documented(shown, monkeypatch):
    expected = {canonical(k): v for k, v in RUN_HERE.items()}[shown.key]
    code, output = run_here(shown.command, monkeypatch)
    assert code == expected, f"{shown}: exit {code}, expected {expected}\n{output[-3000:]}"
    printed = [line.rstrip() for line in output.splitlines() if line.strip()]
    for same in (s for s in SHOWN if s.key == shown.key):  # every place that shows this command and its output
        missing = [line for line in same.output
                   if line.strip() and line.strip() != "..." and line.rstrip() not in printed]
        assert not missing, f"{same}: the doc shows lines the command does not print:\n" + "\n".join(missing)
        assert not unmarked_cuts(same.output, printed), f"{same}: {unmarked_cuts(same.output, printed)}"


def unmarked_cuts(shown: list[str], printed: list[str]) -> str | None:
    """Where a block shows its lines out of the printed order, or leaves printed lines out between two it shows
    without a `...` line there (a block may start and end anywhere in the output); None when it holds."""
    at, cut_marked = None, False
    for line in (x.rstrip() for x in shown if x.strip()):
        if line.strip() == "...":
            cut_marked = True
            continue
        later = [i for i, p in enumerate(printed) if p == line and (at is None or i > at)]
        if not later:
            return f"{line!r} is not printed after the line shown before it"
        if at is not None and later[0] > at + 1 and not cut_marked:
            return f"printed lines left out before {line!r} with no `...` line: {printed[at + 1:later[0]][:3]}"
        at, cut_marked = later[0], False
    return None
    if shown.key == "make help":
        assert all(name in output for name in recipes.available(REPO / "recipes"))


# ------------------------------------------------------------------ the expensive ones: who runs them


BY = sorted({s.key: s for s in SHOWN if s.key in {canonical(k) for k in RUN_BY}}.values(), key=str)


@pytest.mark.parametrize("shown", BY, ids=[s.key for s in BY])
def test_expensive_commands_are_run_by_a_named_test(shown):
    by = {canonical(k): v for k, v in RUN_BY.items()}[shown.key]
    sources = "\n".join((REPO / where).read_text() for where in by.where)
    for line in by.lines:
        assert line in sources, f"{shown}: {' or '.join(by.where)} no longer contains {line!r}"
    if by.expands:
        words = shlex.split(shown.command, comments=True)
        assert words[0] == "make"
        lines = make_dry_run(words)
        expanded = [canonical(line) for line in lines]  # quoting aside
        assert any(canonical(by.expands) in line for line in expanded), f"{shown}: make -n gives {lines}"
    if "RECIPE=" in shown.command:  # the recipe a parametrized test covers must exist
        recipe = re.search(r"RECIPE=(\S+)", shown.command).group(1)
        assert recipe in recipes.available(REPO / "recipes")


def test_launch_sh_runs_the_launcher():
    """`make finetune` -> recipes/<name>/launch.sh -> the launcher that the tests run."""
    assert 'exec "$py" -m fsdp_recipes.launch.launcher "$(cd' in (REPO / "recipes/tiny-cpu-lora/launch.sh").read_text()


# ------------------------------------------------------------------ links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in doc.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        if in_code:
            continue
        heading = re.match(r"^#{1,6} (.+)$", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(doc: Path) -> list[tuple[int, str]]:
    found, in_code = [], False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            found += [(number, target) for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))]
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_relative_links_resolve(doc):
    broken = []
    for number, target in links(doc):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{doc.name}:{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{doc.name}:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ------------------------------------------------------------------ the README


def test_readme_is_the_front_door():
    assert len(README.read_text().splitlines()) <= 250, "README.md over 250 lines: move the depth into docs/"


def test_readme_recipe_table_matches_the_recipe_budgets():
    """Each recipe has a row, and a GPU row's estimate is the `make plan` budget in the recipe's own README (which
    tests/test_configs.py keeps equal to what the planner computes today)."""
    section = README.read_text().split("\n## Recipes\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.match(r"^`([\w.-]+)`", cells[0]) if line.startswith("|") else None
        if name:
            rows[name.group(1)] = cells[-1]
    assert set(rows) == set(recipes.available(REPO / "recipes")), rows
    for name, estimate in rows.items():
        budget = re.fullmatch(r"([\d.]+) of ([\d.]+) GiB", estimate)
        cpu = {"smollm2-135m-lora": "measured above", "smollm2-135m-dpo": "measured above",
               "smollm2-135m-grpo": "measured above", "smollm2-135m-kto": "measured above",
               "smollm2-135m-rloo": "measured above", "tiny-cpu-lora": "CPU only"}
        if name in cpu:  # CPU recipes: no GPU budget to show
            assert estimate == cpu[name]
            continue
        assert budget, f"{name}: {estimate!r}"
        own = (REPO / "recipes" / name / "README.md").read_text()
        expected = f"fits: {budget.group(1)} GiB of {budget.group(2)} GiB usable per GPU"
        assert expected in own, f"{name}: README.md says {estimate}; recipes/{name}/README.md lacks {expected!r}"
