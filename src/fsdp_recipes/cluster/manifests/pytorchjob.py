"""Kubeflow Training Operator's PyTorchJob (kubeflow.org/v1): 1 Master + N-1 Workers, restartPolicy ExitCode."""

from __future__ import annotations

from fsdp_recipes.cluster.manifests.pod import meta, pod_template


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
