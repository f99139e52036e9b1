"""The `moetailor serve` options for the vLLM backend (imports no vLLM)."""
from __future__ import annotations


def add_backend_arguments(p) -> None:
    p.add_argument("--backend", choices=("engine", "vllm"), default="engine",
                   help="engine: moetailor's engine; vllm: `vllm serve` with the moetailor plugin (--plan/--decode-plan "
                        "colocated, --decode-model: a prefill/decode pair with a proxy). Needs `make setup-vllm`")
    p.add_argument("--vllm-kv-cache-mib", type=int, default=512,
                   help="--backend vllm: KV cache size per instance (vLLM's CPU build otherwise reserves a share "
                        "of host memory); 0 = vLLM's default sizing")
    p.add_argument("--vllm-no-prefix-caching", action="store_true",
                   help="--backend vllm: prefix caching off, as a server that `eval`/`tune --backend vllm --vllm-url` "
                        "switches plans on needs (blocks one plan computed would otherwise serve the next)")
    p.add_argument("--vllm-experts-kernel", action="store_true",
                   help="--backend vllm on CPU: MoE layers run moetailor's experts kernel instead of vLLM's fused-MoE "
                        "(skips the routes budgets and pools drop; additional_config moetailor_experts_kernel)")
    p.add_argument("--vllm-novice", action="store_true",
                   help="--backend vllm: every MoE layer adds novice constants, so that plans switched in later "
                        "(`eval --backend vllm --vllm-url`) may replace dropped experts by them (a novice --plan "
                        "needs no flag; additional_config moetailor_novice)")
