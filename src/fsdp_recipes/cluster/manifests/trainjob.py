"""Kubeflow Trainer's TrainJob (trainer.kubeflow.org/v1alpha1) on the torch-distributed runtime."""

from __future__ import annotations

from fsdp_recipes.cluster.manifests.pod import env_list, gpu_resources, meta, volume_mounts, volumes


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
