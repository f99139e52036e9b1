"""Core binding of vLLM instances: in `bench vllm` every instance's worker gets the same CPUs (vLLM's
automatic binding gives an instance with a KV connector more cores than a colocated one on a small
machine), and a served pair's two instances get disjoint ones."""
from __future__ import annotations

import os

import subprocess
import sys

from moetailor.bench.vllm import binding, cpu_list, off_the_workers_cores, same_cores_for_every_instance


def test_every_instance_gets_the_colocated_binding_unless_the_caller_set_one(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    expected = cpus[:-1] if len(cpus) > 1 else cpus
    assert same_cores_for_every_instance() == ",".join(map(str, expected))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert same_cores_for_every_instance() == ",".join(map(str, expected))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")
    assert same_cores_for_every_instance() == "0-1|2-3"


def test_the_runs_other_processes_leave_the_workers_cores():
    """An engine core (here: any child process) goes to the CPUs no worker is bound to; where there
    are none it keeps its own."""
    assert cpu_list("0") == {0} and cpu_list("0-2|5") == {0, 1, 2, 5} and cpu_list("auto") == set()
    cpus = os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        workers = {min(cpus)}
        off_the_workers_cores({child.pid}, workers)
        assert os.sched_getaffinity(child.pid) == (cpus - workers or cpus)
    finally:
        child.kill()
        child.wait()


def test_binding_reads_each_threads_cpus():
    mine = binding({os.getpid()})
    assert len(mine) == 1 and mine[0]["pid"] == os.getpid()
    assert sum(mine[0]["threads_by_cpus"].values()) == len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_a_served_pair_gets_disjoint_cores_unless_the_caller_bound_them(monkeypatch):
    from moetailor.integrations.vllm.disagg import pair_core_binding

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert pair_core_binding([0, 1]) == ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"})
    prefill, decode = pair_core_binding([3, 0, 2, 1, 5])
    assert prefill["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and decode["VLLM_CPU_OMP_THREADS_BIND"] == "2,3,5"
    assert pair_core_binding([0]) == ({}, {})
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    assert pair_core_binding([0, 1, 2, 3]) == ({}, {})
