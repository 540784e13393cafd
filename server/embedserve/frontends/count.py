"""How many front-end processes serve the ports (FRONTENDS resolved): as set, else one on a CPU and,
on a GPU, the container's cores less two (the model process's loop and the worker), at most 8.
The container's cores are its cgroup's CPU quota, not the node's CPUs."""

from __future__ import annotations

import math
import os
from pathlib import Path

from embedserve.config import Settings


def container_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this container may use: its cgroup's CPU quota when there is one (rounded up),
    else the CPUs it may run on."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(cgroup)
    return cores if quota is None else min(cores, max(1, math.ceil(quota)))


def cgroup_cpu_quota(cgroup: Path) -> float | None:
    """CPUs of the CFS quota: cgroup v2 `cpu.max` ("max 100000" or "200000 100000"), else v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none), which GPU node images still run."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for controller in ("cpu", "cpu,cpuacct"):
        try:
            quota_us = int((cgroup / controller / "cpu.cfs_quota_us").read_text())
            period_us = int((cgroup / controller / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 else quota_us / period_us
    return None


def frontend_count(settings: Settings, gpu: bool | None = None, cores: int | None = None) -> int:
    """FRONTENDS resolved: as set, else 1 on CPU and the cores less two (1..8) on a GPU."""
    if settings.frontends:
        return settings.frontends
    if settings.model_path.startswith("sim:"):
        return 1
    if gpu is None:
        import torch

        gpu = settings.device.startswith("cuda") or (settings.device == "auto" and torch.cuda.is_available())
    return max(1, min(8, (container_cores() if cores is None else cores) - 2)) if gpu else 1
