"""The launcher's GPU inventory: one line per GPU and one NVLink line, from nvidia-smi."""

import os

from fsdp_recipes.config import hardware

# `nvidia-smi nvlink --status` as it prints on a 2-GPU NVLink machine (trimmed to 3 links per GPU), one link down
NVLINK_STATUS = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: 26.562 GB/s
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)
\t Link 0: 26.562 GB/s
\t Link 1: <inactive>
\t Link 2: 26.562 GB/s
"""


def fake_nvidia_smi(bin_dir, listing: str, nvlink: str) -> None:
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   f'case "$1" in nvlink) printf %s "{nvlink}" ;; *) printf %s "{listing}" ;; esac\n')
    smi.chmod(0o755)


def test_inventory_is_one_line_per_gpu_and_one_nvlink_line(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, "0, NVIDIA H100 80GB HBM3, 81559 MiB, 570.86\n1, NVIDIA H100 80GB HBM3, 81559 MiB, "
                              "570.86\n", NVLINK_STATUS)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert hardware.gpu_inventory().splitlines() == [
        "GPU 0, NVIDIA H100 80GB HBM3, 81559 MiB, 570.86",
        "GPU 1, NVIDIA H100 80GB HBM3, 81559 MiB, 570.86",
        "NVLink: 2 GPUs, 2-3 links up per GPU (26.562 GB/s per link)",
    ]


def test_nvlink_summary_without_links_says_pcie():
    assert hardware.nvlink_summary("GPU 0: NVIDIA L4 (UUID: x)\n\t Link 0: <inactive>\n") == \
        "NVLink: none active on 1 GPU(s) (PCIe only)"
    assert hardware.nvlink_summary(NVLINK_STATUS.replace("<inactive>", "26.562 GB/s")) == \
        "NVLink: 2 GPUs, 3 links up on each (26.562 GB/s per link)"


def test_no_nvidia_smi_is_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert hardware.gpu_inventory() == "GPUs: none (no nvidia-smi on PATH, or it failed); running on CPU"
