"""Kubernetes manifests for a recipe: Kubeflow PyTorchJob, Kubeflow Trainer TrainJob and Run:ai, from one source.

    python -m fsdp_recipes.cluster.k8s <recipe> --nodes N --gpus G [--out DIR] [--image IMG] [--pvc-checkpoints NAME] ...
    make k8s RECIPE=<recipe> NODES=N GPUS=G

Writes k8s/generated/<recipe>/ (or --out):
    pytorchjob.yaml        kubeflow.org/v1 PyTorchJob: 1 Master + N-1 Workers, restartPolicy ExitCode
    trainjob.yaml          trainer.kubeflow.org/v1alpha1 TrainJob on the torch-distributed runtime
    runai.yaml             run.ai/v2alpha1 TrainingWorkload (1 node) or DistributedWorkload (N nodes)
    runai-submit.sh        the same workload through the Run:ai CLI (runai training [pytorch] submit)
    pvc-checkpoints.yaml   the ReadWriteMany claim the checkpoints live on (skip it if the claim exists)
    priorityclass.yaml     a low, non-preempting PriorityClass (cluster admins apply it once, or pass your own)

Every output is built from `workload()`: the container command, environment, volumes and resources are written
once there, and each platform's function only arranges them the way its API wants. Each pod runs
k8s/entrypoint.sh, which calls the recipe's own launch.sh with the node's rendezvous settings.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

import yaml

from fsdp_recipes.config import recipes, yaml_keys
from fsdp_recipes.errors import UserError, cli

WORKDIR = "/workspace/fsdp-recipes"  # where the image holds this repository (the entrypoint runs from here)
DATA_MOUNT, CKPT_MOUNT = "/data", "/checkpoints"
GRACE_MARGIN_S = 60  # on top of preemption_grace_s: torchrun's shutdown and the launcher's summary
RETRYABLE_EXIT = 138  # what k8s/entrypoint.sh turns the pack's preemption exit 75 into
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
NCCL_ENV = {
    # Collective errors and hangs surface as an exception (and a pod restart) instead of a stuck job.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_DEBUG": "WARN",
}


# ---------------------------------------------------------------- recipe facts and the node-count rules


def recipe_facts(folder: Path) -> dict:
    """What the generator needs from a recipe's two YAML files."""
    loaded = recipes.load(folder)
    raw, acc = loaded.raw, loaded.accelerate
    fsdp = acc.get("fsdp_config") or {}
    par = acc.get("parallelism_config") or {}
    return {
        "name": folder.name,
        "trainer": loaded.trainer,
        "distributed_type": str(acc.get("distributed_type", "NO")),
        "fsdp_version": int(fsdp.get("fsdp_version", 1)),
        "sharding": str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")),
        "dp_replicate": int(par.get("parallelism_config_dp_replicate_size", 1)),
        "dp_shard": int(par.get("parallelism_config_dp_shard_size", 0)) or None,
        "min_gpus": int(raw.get("min_gpus", 0)),
        "grace_s": int(raw.get("preemption_grace_s", 120)),
    }


def is_hsdp(facts: dict) -> bool:
    """Hybrid sharding: shard inside a node, replicate across nodes (FSDP1 HYBRID_SHARD or FSDP2 dp_replicate)."""
    return facts["distributed_type"] == "FSDP" and ("HYBRID" in facts["sharding"].upper() or facts["dp_replicate"] > 1)


def check_topology(facts: dict, nodes: int, gpus: int) -> list[str]:
    """Refuse node/GPU counts the recipe's sharding cannot use; return extra `accelerate launch` options."""
    name, total = facts["name"], nodes * gpus
    if nodes < 1 or gpus < 1:
        raise UserError(
            f"NODES and GPUS must be at least 1 (got NODES={nodes} GPUS={gpus}). Fix: make k8s NODES=1 GPUS=8."
        )
    if facts["distributed_type"] == "NO" and total > 1:
        raise UserError(
            f"recipe {name} runs one process (distributed_type: NO) and cannot use {nodes} node(s) x {gpus} GPU(s). "
            "Fix: NODES=1 GPUS=1."
        )
    if total < facts["min_gpus"]:
        raise UserError(
            f"recipe {name} needs at least {facts['min_gpus']} GPUs and NODES={nodes} x GPUS={gpus} gives {total}. "
            f"Fix: raise NODES or GPUS so that NODES*GPUS >= {facts['min_gpus']}."
        )
    if not is_hsdp(facts):
        return []
    if nodes < 2:
        raise UserError(
            f"recipe {name} uses hybrid sharding (HSDP: shard inside a node, replicate across nodes) and needs "
            f"NODES >= 2, got NODES={nodes}. Fix: NODES=2 (or a FULL_SHARD recipe for one node)."
        )
    shard = facts["dp_shard"]
    if shard is None:  # FSDP1 HYBRID_SHARD: torch makes each node one shard group
        return []
    if gpus % shard:
        raise UserError(
            f"recipe {name} shards the model over groups of {shard} GPUs (parallelism_config_dp_shard_size), which "
            f"must fit whole inside a node of {gpus} GPUs so sharding traffic stays on NVLink. "
            f"Fix: GPUS={shard} or a multiple of it."
        )
    # The recipe's replicate size was written for its own node count; this many nodes needs total/shard replicas.
    return ["--parallelism_config_dp_replicate_size", str(total // shard)]


def check_name(value: str | None, flag: str, what: str) -> str:
    if not value:
        raise UserError(f"{what} is missing: {flag} is empty. Fix: {flag} <name of an existing PersistentVolumeClaim>.")
    if len(value) > 63 or not DNS_LABEL.match(value):
        raise UserError(
            f"{flag} '{value}' is not a valid Kubernetes name (lowercase letters, digits and '-', at most 63). "
            f"Fix: {flag} <a name like fsdp-checkpoints>."
        )
    return value


def slug(recipe: str) -> str:
    """A DNS label from the recipe name: dots and capitals are not allowed in pod and service names."""
    return re.sub(r"[^a-z0-9-]+", "-", recipe.lower()).strip("-")[:63].rstrip("-")


def job_name(recipe: str) -> str:
    return f"ft-{slug(recipe)}"[:50].rstrip("-")  # room for the operators' "-master-0" / "-node-0-0" suffixes


# ---------------------------------------------------------------- the one template source


def workload(args, facts: dict, launch_extra: list[str]) -> dict:
    """Everything the platforms share: image, command, environment, volumes, GPUs, grace period, labels."""
    recipe = facts["name"]
    command = ["bash", "k8s/entrypoint.sh", recipe, "--output_dir", f"{CKPT_MOUNT}/{recipe}"]
    if args.nodes > 1 and facts["min_gpus"] > args.gpus:
        # launch.sh checks min_gpus against the GPUs of its own node; the total was checked above.
        command += ["--min_gpus", str(args.gpus)]
    env = {
        "FSDP_NNODES": str(args.nodes),
        "FSDP_GPUS_PER_NODE": str(args.gpus),
        **({"FSDP_K8S_LAUNCH_EXTRA": shlex.join(launch_extra)} if launch_extra else {}),
        # Model downloads and the pack's asset cache live on the data claim, so a restarted pod does not fetch
        # the weights again.
        "HF_HOME": f"{DATA_MOUNT}/hf-home",
        "FSDP_RECIPES_CACHE": f"{DATA_MOUNT}/fsdp-recipes-cache",
        "PYTHONUNBUFFERED": "1",
        **NCCL_ENV,
        **dict(kv.split("=", 1) for kv in args.env),
    }
    return {
        "name": args.name or job_name(recipe),
        "recipe": recipe,
        "namespace": args.namespace,
        "image": args.image,
        "command": command,
        "env": env,
        "nodes": args.nodes,
        "gpus": args.gpus,
        "pvc_data": args.pvc_data,
        "pvc_checkpoints": args.pvc_checkpoints,
        "shm_size": args.shm_size,
        "checkpoint_size": args.checkpoint_size,
        "storage_class": args.storage_class,
        "priority_class": args.priority_class,
        "runtime": args.trainjob_runtime,
        "grace_s": facts["grace_s"] + GRACE_MARGIN_S,
        "labels": {"app.kubernetes.io/name": "fsdp-recipes", "fsdp-recipes/recipe": slug(recipe)},
    }


def env_list(w: dict) -> list[dict]:
    return [{"name": k, "value": v} for k, v in w["env"].items()]


def volumes(w: dict) -> list[dict]:
    return [
        {"name": "data", "persistentVolumeClaim": {"claimName": w["pvc_data"]}},
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": w["pvc_checkpoints"]}},
        # NCCL and the DataLoader workers use /dev/shm; the container runtime's default is 64 MB.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": w["shm_size"]}},
    ]


def volume_mounts() -> list[dict]:
    return [
        {"name": "data", "mountPath": DATA_MOUNT},
        {"name": "checkpoints", "mountPath": CKPT_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]


def gpu_resources(w: dict) -> dict:
    return {"limits": {"nvidia.com/gpu": w["gpus"]}, "requests": {"nvidia.com/gpu": w["gpus"]}}


def pod_template(w: dict) -> dict:
    """A PodTemplateSpec (the PyTorchJob replicas use it as is)."""
    return {
        "metadata": {"labels": dict(w["labels"])},
        "spec": {
            "priorityClassName": w["priority_class"],
            # Long enough for the pack's preemption save (preemption_grace_s) before the kubelet's SIGKILL.
            "terminationGracePeriodSeconds": w["grace_s"],
            "containers": [
                {
                    "name": "pytorch",  # the PyTorchJob operator looks for a container of this name
                    "image": w["image"],
                    "workingDir": WORKDIR,
                    "command": w["command"],
                    "env": env_list(w),
                    "ports": [{"name": "pytorchjob-port", "containerPort": 29500}],
                    "resources": gpu_resources(w),
                    "volumeMounts": volume_mounts(),
                }
            ],
            "volumes": volumes(w),
        },
    }


def meta(w: dict, **extra) -> dict:
    return {"name": w["name"], "namespace": w["namespace"], "labels": dict(w["labels"]), **extra}


# ---------------------------------------------------------------- one function per platform


def pytorchjob(w: dict) -> dict:
    # ExitCode: the operator recreates a pod whose exit code it deems retryable (138, see k8s/entrypoint.sh) and
    # fails the job on permanent ones (1-127), so a preempted pod resumes and a config error is not retried.
    replica = {"restartPolicy": "ExitCode", "template": pod_template(w)}
    specs = {"Master": {"replicas": 1, **replica}}
    if w["nodes"] > 1:
        specs["Worker"] = {"replicas": w["nodes"] - 1, **replica}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": meta(w),
        "spec": {
            "nprocPerNode": str(w["gpus"]),
            "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def trainjob(w: dict) -> dict:
    # The runtime (a ClusterTrainingRuntime) owns the pod template: v1alpha1 TrainJobs cannot set the grace
    # period or priority class, and restarts follow the runtime's JobSet failurePolicy. See k8s/README.md.
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": meta(w),
        "spec": {
            "runtimeRef": {"name": w["runtime"]},
            "trainer": {
                "image": w["image"],
                "command": w["command"],
                "env": env_list(w),
                "numNodes": w["nodes"],
                "numProcPerNode": w["gpus"],
                "resourcesPerNode": gpu_resources(w),
            },
            "podSpecOverrides": [
                {
                    "targetJobs": [{"name": "node"}],  # the torch-distributed runtime's replicated job
                    "volumes": volumes(w),
                    "containers": [{"name": "node", "volumeMounts": volume_mounts()}],
                }
            ],
        },
    }


def runai_workload(w: dict) -> dict:
    """Run:ai's own CRD: every field is wrapped as {value: ...}; multi-node is a DistributedWorkload (PyTorchJob)."""
    v = lambda x: {"value": x}  # noqa: E731
    # No namespace: Run:ai's is runai-<project>, given with `kubectl apply -n` (or by `runai workload submit`).
    metadata = {"name": w["name"], "labels": dict(w["labels"])}
    spec = {
        "name": v(w["name"]),
        "image": v(w["image"]),
        "workingDir": v(WORKDIR),
        "command": v(w["command"][0]),
        "arguments": v(" ".join(shlex.quote(a) for a in w["command"][1:])),
        "gpu": v(str(w["gpus"])),
        "largeShm": v(True),
        "environment": {"items": {k: v(val) for k, val in w["env"].items()}},
        "pvcs": {
            "items": {
                "pvc--0": v({"claimName": w["pvc_data"], "existingPvc": True, "path": DATA_MOUNT}),
                "pvc--1": v({"claimName": w["pvc_checkpoints"], "existingPvc": True, "path": CKPT_MOUNT}),
            }
        },
    }
    # Training workloads are Run:ai's low-priority, preemptible class ("train") by default; nothing to set.
    if w["nodes"] == 1:
        return {"apiVersion": "run.ai/v2alpha1", "kind": "TrainingWorkload", "metadata": metadata, "spec": spec}
    # Run:ai counts workers besides the master pod: N nodes = 1 master + N-1 workers.
    spec.update(jobType="PyTorchJob", workers=v(w["nodes"] - 1))
    return {"apiVersion": "run.ai/v2alpha1", "kind": "DistributedWorkload", "metadata": metadata, "spec": spec}


def runai_submit_script(w: dict) -> str:
    multi = w["nodes"] > 1
    flags = [
        f"-i {shlex.quote(w['image'])}",
        f"-g {w['gpus']}",
        *([f"--workers {w['nodes'] - 1}"] if multi else []),
        f"--existing-pvc claimname={w['pvc_data']},path={DATA_MOUNT}",
        f"--existing-pvc claimname={w['pvc_checkpoints']},path={CKPT_MOUNT}",
        "--large-shm",
        f"--termination-grace-period {w['grace_s']}s",
        '--priority "${RUNAI_PRIORITY:-train}"',
        f"--working-dir {WORKDIR}",
        *(f"-e {shlex.quote(f'{k}={val}')}" for k, val in w["env"].items()),
    ]
    body = " \\\n  ".join(flags)
    kind = "pytorch submit" if multi else "submit"
    make = f"make k8s RECIPE={w['recipe']} NODES={w['nodes']} GPUS={w['gpus']}"
    return f"""#!/usr/bin/env bash
# Generated by `{make}`; regenerate, do not edit.
# Submits {w['name']} with the Run:ai CLI v2: {w['nodes']} node(s) x {w['gpus']} GPU(s), checkpoints on the
# claim {w['pvc_checkpoints']}, so a preempted run resumes when Run:ai schedules it again.
# RUNAI_PROJECT picks the project. RUNAI_PRIORITY defaults to "train", the low-priority preemptible class
# (on Run:ai versions with separate preemptibility, use RUNAI_PRIORITY=low and add --preemptibility preemptible).
# RUNAI=echo prints the command instead of running it.
set -euo pipefail
project="${{RUNAI_PROJECT:?set RUNAI_PROJECT to your Run:ai project}}"
"${{RUNAI:-runai}}" training {kind} {w['name']} -p "$project" \\
  {body} \\
  --command -- {shlex.join(w['command'])}
"""


def checkpoint_pvc(w: dict) -> dict:
    spec = {
        # Every node's rank 0 and the sharded (DCP) checkpoint writers of all ranks write here at once.
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": w["checkpoint_size"]}},
    }
    if w["storage_class"]:
        spec["storageClassName"] = w["storage_class"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": w["pvc_checkpoints"], "namespace": w["namespace"], "labels": dict(w["labels"])},
        "spec": spec,
    }


def priority_class(w: dict) -> dict:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": w["priority_class"]},
        "value": 100,
        "globalDefault": False,
        # Fine-tuning waits for free GPUs instead of evicting other work; higher classes may preempt it.
        "preemptionPolicy": "Never",
        "description": "Preemptible fine-tuning jobs (fsdp-recipes): low priority, never preempts others.",
    }


# ---------------------------------------------------------------- writing


class _Dumper(yaml.SafeDumper):
    """Indents list items under their key, the style yamllint's default `indentation` rule expects."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)

    def ignore_aliases(self, data):  # the Master and Worker templates are one dict: write it out twice, no &id001
        return True


def to_yaml(obj: dict, header: str) -> str:
    body = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)
    return f"{header}\n{body}"


def render(w: dict) -> dict[str, str]:
    """File name -> text for every output."""
    cmd = f"make k8s RECIPE={w['recipe']} NODES={w['nodes']} GPUS={w['gpus']}"
    head = f"# Generated by `{cmd}`; regenerate, do not edit."
    return {
        "pytorchjob.yaml": to_yaml(pytorchjob(w), f"{head}\n# kubectl apply -f pytorchjob.yaml"),
        "trainjob.yaml": to_yaml(
            trainjob(w),
            f"{head}\n# kubectl apply -f trainjob.yaml. The runtime {w['runtime']} must give the pod "
            f"terminationGracePeriodSeconds >= {w['grace_s']}\n# for the preemption checkpoint (see k8s/README.md).",
        ),
        "runai.yaml": to_yaml(runai_workload(w), f"{head}\n# kubectl apply -f runai.yaml -n runai-<project>"),
        "runai-submit.sh": runai_submit_script(w),
        "pvc-checkpoints.yaml": to_yaml(checkpoint_pvc(w), f"{head}\n# Create the checkpoint claim once."),
        "priorityclass.yaml": to_yaml(
            priority_class(w), f"{head}\n# Cluster-scoped: a cluster admin applies it once (or pass --priority-class)."
        ),
    }


def write(files: dict[str, str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one `error:` line like every other pack command, not usage + error
        raise UserError(f"{message}. Fix: see `python -m fsdp_recipes.cluster.k8s --help`.")


def parse(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m fsdp_recipes.cluster.k8s", description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    p.add_argument("--out", help="output folder (default k8s/generated/<recipe>)")
    p.add_argument("--name", help="job name (default ft-<recipe>)")
    p.add_argument("--image", default="fsdp-recipes:latest", help=f"an image holding this repository at {WORKDIR}")
    p.add_argument("--namespace", default="default")
    p.add_argument("--pvc-data", default="fsdp-data", help=f"existing claim mounted at {DATA_MOUNT}")
    p.add_argument("--pvc-checkpoints", default="fsdp-checkpoints", help=f"claim mounted at {CKPT_MOUNT}")
    p.add_argument("--checkpoint-size", default="1Ti", help="size requested by pvc-checkpoints.yaml")
    p.add_argument("--storage-class", default="", help="storageClassName of pvc-checkpoints.yaml (RWX)")
    p.add_argument("--priority-class", default="fsdp-finetune-low")
    p.add_argument("--trainjob-runtime", default="torch-distributed", help="ClusterTrainingRuntime of the TrainJob")
    p.add_argument("--shm-size", default="64Gi", help="size of the /dev/shm memory volume")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra env, e.g. NCCL_SOCKET_IFNAME=eth0"
    )
    return p.parse_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    recipe = recipes.resolve(args.recipe)
    check_name(args.pvc_checkpoints, "--pvc-checkpoints", "the output volume (checkpoint claim)")
    check_name(args.pvc_data, "--pvc-data", "the data volume")
    check_name(args.priority_class, "--priority-class", "the priority class")
    if args.name:
        check_name(args.name, "--name", "the job name")
    bad_env = [kv for kv in args.env if "=" not in kv or not kv.split("=", 1)[0]]
    if bad_env:
        raise UserError(f"--env {bad_env[0]!r} is not KEY=VALUE. Fix: --env NCCL_SOCKET_IFNAME=eth0")
    facts = recipe_facts(recipe)
    launch_extra = check_topology(facts, args.nodes, args.gpus)
    w = workload(args, facts, launch_extra)
    out = Path(args.out or Path("k8s/generated") / recipe.name)
    write(render(w), out)
    print(f"[k8s] {recipe.name}: {args.nodes} node(s) x {args.gpus} GPU(s) -> {out}/")
    for name in render(w):
        print(f"  {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
