"""`fsdp-recipes job`: a recipe as a job for a cluster launcher, written, printed or submitted.

    fsdp-recipes job --launcher local|slurm|k8s <recipe> --nodes N --gpus G [--out DIR | --print] [--submit]
                     [the launcher's own flags: fsdp-recipes job --launcher k8s --help]

Every launcher goes through the same steps (cluster/registry.py): the recipe's facts read once, the node and GPU
counts checked against its sharding, the launcher's own check, then its files, rendered with the job's world size,
the signal its scheduler preempts with and the grace it allows. Nothing is written when a check fails.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from fsdp_recipes.cluster import registry
from fsdp_recipes.cluster.job import Job, check_topology, cpu_recipe_note, recipe_facts
from fsdp_recipes.cluster.registry import ClusterLauncher
from fsdp_recipes.config import recipes
from fsdp_recipes.errors import UserError, cli

PROG = "fsdp-recipes job"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one `error:` line like every other pack command, not usage + error
        raise UserError(f"{message}. Fix: see `{PROG} --launcher <name> --help`.")


def parser(launcher: ClusterLauncher | None) -> argparse.ArgumentParser:
    launchers = "\n".join(f"  {name:<8} {registry.load(name).DESCRIPTION}" for name in registry.names())
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=f"launchers:\n{launchers}")
    p.add_argument("--launcher", required=True, metavar="|".join(registry.names()))
    p.add_argument("recipe", help="a recipe name under recipes/ or a recipe folder")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    p.add_argument("--out", help="output folder (default <the launcher's folder>/<recipe>)")
    p.add_argument("--print", action="store_true", help="print the files instead of writing them")
    p.add_argument("--submit", action="store_true", help="write the files, then submit them (sbatch, kubectl, ...)")
    if launcher is not None:
        launcher.add_arguments(p.add_argument_group(f"{launcher.name} launcher"))
    return p


def which_launcher(argv: list[str]) -> ClusterLauncher | None:
    """The --launcher named in argv (None when it is not given, for --help and argparse's own message)."""
    probe = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    probe.add_argument("--launcher")
    name = probe.parse_known_args(argv)[0].launcher
    if name is None:
        return None
    if name not in registry.names():
        close = difflib.get_close_matches(name, registry.names(), n=1)
        hint = f"--launcher {close[0]}" if close else f"--launcher one of {', '.join(registry.names())}"
        raise UserError(f"no cluster launcher named '{name}'. Fix: {hint}.")
    return registry.load(name)


def build(launcher: ClusterLauncher, recipe: str, nodes: int, gpus: int, options: argparse.Namespace) -> Job:
    """The job as `launcher` runs it: checked against the recipe's sharding, then by the launcher itself."""
    folder = recipes.resolve(recipe)
    facts = recipe_facts(folder)
    extra = check_topology(facts, nodes, gpus)
    job = Job(recipe=facts, folder=folder, nodes=nodes, gpus=gpus, launcher=launcher.name, signal=launcher.SIGNAL,
              grace_s=int(launcher.grace_seconds(facts.grace_s)), launch_extra=extra, options=options)
    launcher.check(job)
    return job


def write(files: dict[str, str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        if name.endswith((".sh", ".sbatch")):
            path.chmod(0o755)


def submit(command: list[str]) -> int:
    if shutil.which(command[0]) is None:
        raise UserError(f"{command[0]} is not on PATH, so the job cannot be submitted from here. Fix: run "
                        f"`{shlex.join(command)}` where {command[0]} is, or leave out --submit.")
    return subprocess.run(command).returncode


@cli
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher = which_launcher(argv)
    args = parser(launcher).parse_args(argv)
    job = build(launcher, args.recipe, args.nodes, args.gpus, args)
    files = launcher.render(job)
    note = cpu_recipe_note(job)
    if note and args.print:  # the files go to stdout: the note beside them
        print(f"[job] {note}", file=sys.stderr)
    if args.print:
        for name, text in files.items():
            print(f"# ==> {name} <==\n{text}", end="" if text.endswith("\n") else "\n")
        return 0
    out = Path(args.out or Path(launcher.OUTPUT_DIR) / job.name)
    write(files, out)
    command = launcher.submit_command(job, out)
    print(f"[job] {job.name} on {launcher.name}: {job.nodes} node(s) x {job.gpus} GPU(s) = {job.world_size}, "
          f"preempted by {job.signal.name} with {job.grace_s} s to save -> {out}/")
    for name in files:
        print(f"  {out / name}")
    if note:
        print(f"[job] {note}")
    if args.submit:
        return submit(command)
    print(f"[job] submit: {shlex.join(command)}")
    return 0
