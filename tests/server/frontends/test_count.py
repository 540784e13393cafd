"""frontends/count.py: how many front ends a pod starts, from its cgroup's CPU quota."""

import pytest

from embedserve.config import Settings


@pytest.mark.parametrize(
    "files, cores",
    [
        # Quotas under one CPU, so that they show on a machine of any size (CI has 2 cores).
        ({"cpu.max": "50000 100000\n"}, 1),  # cgroup v2: half a CPU, rounded up
        ({"cpu.max": "max 100000\n"}, None),  # v2, no quota: the CPUs it may run on
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
        ({"cpu,cpuacct/cpu.cfs_quota_us": "30000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no quota
        ({}, None),
    ],
)
def test_container_cores_reads_the_cpu_quota_of_either_cgroup_version(tmp_path, files, cores):
    """FRONTENDS on a GPU node is sized from this: without v1's files a 4-CPU pod on a v1 node
    would start 8 front ends."""
    import os

    from embedserve.frontends.count import container_cores, frontend_count

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    runnable = len(os.sched_getaffinity(0))
    expected = runnable if cores is None else min(cores, runnable)
    assert container_cores(tmp_path) == expected
    assert frontend_count(Settings.from_env({}), gpu=True, cores=container_cores(tmp_path)) == max(1, min(8, expected - 2))
