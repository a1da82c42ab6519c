"""What every Kubernetes manifest shares: the container's command, environment, volumes and GPUs, the pod's grace
period and labels, written once in `workload()`; each platform's module (pytorchjob.py, trainjob.py, runai.py)
only arranges them the way its API wants. Each pod runs k8s/entrypoint.sh, which calls the recipe's own launch.sh
with the node's rendezvous settings.
"""

from __future__ import annotations

import shlex

import yaml

from fsdp_recipes.cluster.job import Job, slug

WORKDIR = "/workspace/fsdp-recipes"  # where the image holds this repository (the entrypoint runs from here)
DATA_MOUNT, CKPT_MOUNT = "/data", "/checkpoints"
NCCL_ENV = {
    # Collective errors and hangs surface as an exception (and a pod restart) instead of a stuck job.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_DEBUG": "WARN",
}


def job_name(recipe: str) -> str:
    return f"ft-{slug(recipe)}"[:50].rstrip("-")  # room for the operators' "-master-0" / "-node-0-0" suffixes


def workload(job: Job) -> dict:
    """Everything the platforms share: image, command, environment, volumes, GPUs, grace period, labels."""
    recipe, opts = job.name, job.options
    command = ["bash", "k8s/entrypoint.sh", recipe, "--output_dir", f"{CKPT_MOUNT}/{recipe}"]
    if job.nodes > 1 and job.recipe.min_gpus > job.gpus:
        # launch.sh checks min_gpus against the GPUs of its own node; the total was checked before.
        command += ["--min_gpus", str(job.gpus)]
    env = {
        "FSDP_NNODES": str(job.nodes),
        "FSDP_GPUS_PER_NODE": str(job.gpus),
        **({"FSDP_K8S_LAUNCH_EXTRA": shlex.join(job.launch_extra)} if job.launch_extra else {}),
        # Model downloads and the pack's asset cache live on the data claim, so a restarted pod does not fetch
        # the weights again.
        "HF_HOME": f"{DATA_MOUNT}/hf-home",
        "FSDP_RECIPES_CACHE": f"{DATA_MOUNT}/fsdp-recipes-cache",
        "PYTHONUNBUFFERED": "1",
        **NCCL_ENV,
        **dict(kv.split("=", 1) for kv in opts.env),
    }
    return {
        "name": opts.name or job_name(recipe),
        "recipe": recipe,
        "namespace": opts.namespace,
        "image": opts.image,
        "command": command,
        "env": env,
        "nodes": job.nodes,
        "gpus": job.gpus,
        "pvc_data": opts.pvc_data,
        "pvc_checkpoints": opts.pvc_checkpoints,
        "shm_size": opts.shm_size,
        "checkpoint_size": opts.checkpoint_size,
        "storage_class": opts.storage_class,
        "priority_class": opts.priority_class,
        "runtime": opts.trainjob_runtime,
        "grace_s": job.grace_s,  # the kubelet's SIGTERM-to-SIGKILL time (k8s.grace_seconds)
        "labels": {"app.kubernetes.io/name": "fsdp-recipes", "fsdp-recipes/recipe": slug(recipe)},
        "regenerate": f"make k8s RECIPE={recipe} NODES={job.nodes} GPUS={job.gpus}",
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


class _Dumper(yaml.SafeDumper):
    """Indents list items under their key, the style yamllint's default `indentation` rule expects."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)

    def ignore_aliases(self, data):  # the Master and Worker templates are one dict: write it out twice, no &id001
        return True


def to_yaml(w: dict, obj: dict, *notes: str) -> str:
    """The manifest's text under a header: how it was generated, then the notes (how to apply it)."""
    head = "\n".join([f"# Generated by `{w['regenerate']}`; regenerate, do not edit.", *(f"# {n}" for n in notes)])
    body = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)
    return f"{head}\n{body}"
