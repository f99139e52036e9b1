"""`bench vllm`'s core binding: every instance's worker gets the same CPUs (vLLM's automatic binding
gives an instance with a KV connector more cores than a colocated one on a small machine)."""
from __future__ import annotations

import os

from moetailor.integrations.vllm.bench import binding, same_cores_for_every_instance


def test_every_instance_gets_the_colocated_binding_unless_the_caller_set_one(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    expected = cpus[:-1] if len(cpus) > 1 else cpus
    assert same_cores_for_every_instance() == ",".join(map(str, expected))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert same_cores_for_every_instance() == ",".join(map(str, expected))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")
    assert same_cores_for_every_instance() == "0-1|2-3"


def test_binding_reads_each_threads_cpus():
    mine = binding({os.getpid()})
    assert len(mine) == 1 and mine[0]["pid"] == os.getpid()
    assert sum(mine[0]["threads_by_cpus"].values()) == len(os.listdir(f"/proc/{os.getpid()}/task"))
