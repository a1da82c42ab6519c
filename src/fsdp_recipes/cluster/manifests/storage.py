"""What a cluster holds besides the job: the checkpoint claim (ReadWriteMany) and a low, non-preempting
PriorityClass."""

from __future__ import annotations


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
