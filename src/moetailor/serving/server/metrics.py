"""/metrics: the engine's counters, the last step's expert traffic, the workers and the collapse
guard, in Prometheus text format."""
from __future__ import annotations

from ..client import EngineClient


def prometheus_text(llm: EngineClient) -> str:
    s = llm.stats()
    lines = []

    def metric(name, kind, help_, value, labels=""):
        lines.extend([f"# HELP moetailor_{name} {help_}", f"# TYPE moetailor_{name} {kind}",
                      f"moetailor_{name}{labels} {value}"])
    metric("requests_waiting", "gauge", "Requests queued for prefill.", s["waiting"])
    metric("requests_running", "gauge", "Requests holding KV blocks.", s["running"])
    metric("kv_blocks_total", "gauge", "KV blocks in the pool.", s["kv_blocks_total"])
    metric("kv_cache_usage", "gauge", "Fraction of KV blocks in use.", f"{s['kv_usage']:.4f}")
    metric("preemptions_total", "counter", "Sequences preempted for recompute.", s["preemptions"])
    metric("generated_tokens_total", "counter", "Tokens generated.", s["tokens_generated"])
    metric("decode_tokens_per_second", "gauge", "Decode throughput over recent steps.", f"{s['decode_tokens_per_s']:.2f}")
    last = llm.step_log[-1] if llm.step_log else None
    lines += ["# HELP moetailor_step_distinct_experts Distinct experts read per MoE layer in the last step.",
              "# TYPE moetailor_step_distinct_experts gauge"]
    if last is not None:
        for layer, n in sorted(last.distinct_experts.items()):
            lines.append(f'moetailor_step_distinct_experts{{layer="{layer}",phase="{last.phase}"}} {n}')
    metric("step_expert_bytes", "gauge", "Expert weight bytes read in the last step.", last.expert_bytes if last else 0)
    workers = llm.health()["workers"]
    if workers:   # disaggregated: one line per worker
        lines += ["# HELP moetailor_worker_up Worker process ready (1) or not (0: starting, dead or down).",
                  "# TYPE moetailor_worker_up gauge"]
        lines += [f'moetailor_worker_up{{worker="{k}"}} {int(w["state"] == "ready")}' for k, w in workers.items()]
        lines += ["# HELP moetailor_worker_restarts_total Times a worker was replaced after it died.",
                  "# TYPE moetailor_worker_restarts_total counter"]
        lines += [f'moetailor_worker_restarts_total{{worker="{k}"}} {w["restarts"]}' for k, w in workers.items()]
    if llm.guard is not None and llm.guard.enabled:
        lines.extend(guard_metrics(llm.guard.snapshot()))
    return "\n".join(lines) + "\n"


def guard_metrics(snap: dict) -> list[str]:
    """The collapse guard's state per expert policy, in Prometheus text format."""
    from ..guard import STATES

    families = {
        "guard_policy_state": ("gauge", "Guard state per policy: 0 active, 1 probation, 2 tripped (full pool)."),
        "guard_trips_total": ("counter", "Times the guard switched a policy to the full pool."),
        "guard_decode_steps_total": ("counter", "Decode steps of guarded requests by pool: reduced, fallback "
                                                "(sent back to the full pool) or shadow (full-pool comparison)."),
        "guard_rescued_requests_total": ("counter", "Running requests moved to the full pool, by reason."),
        "guard_window_budget_hit_share": ("gauge", "Share of recent requests (those whose length says something) that "
                                                  "ran to max_tokens past the full pool's overrun limit."),
        "guard_window_p90_tokens": ("gauge", "p90 output length of recent requests that ended on EOS."),
        "guard_window_entropy_nats": ("gauge", "Mean next-token entropy of recent requests."),
    }
    samples: dict[str, list[str]] = {name: [] for name in families}

    def window(policy: str, w: dict) -> None:
        for name, key in (("guard_window_budget_hit_share", "budget_hit_share"), ("guard_window_p90_tokens", "p90"),
                          ("guard_window_entropy_nats", "entropy")):
            if w["requests"]:
                samples[name].append(f'moetailor_{name}{{policy="{policy}"}} {w[key]:.4f}')

    window("full", snap["reference"])
    for policy, p in snap["policies"].items():
        label = f'policy="{policy}"'
        samples["guard_policy_state"].append(f"moetailor_guard_policy_state{{{label}}} {STATES.index(p['state'])}")
        samples["guard_trips_total"].append(f"moetailor_guard_trips_total{{{label}}} {p['trips']}")
        for pool, n in p["decode_steps"].items():
            samples["guard_decode_steps_total"].append(f'moetailor_guard_decode_steps_total{{{label},pool="{pool}"}} {n}')
        for reason, n in p["rescued"].items():
            samples["guard_rescued_requests_total"].append(
                f'moetailor_guard_rescued_requests_total{{{label},reason="{reason}"}} {n}')
        window(policy, p["window"])
    lines = []
    for name, (kind, help_) in families.items():
        lines += [f"# HELP moetailor_{name} {help_}", f"# TYPE moetailor_{name} {kind}", *samples[name]]
    return lines
