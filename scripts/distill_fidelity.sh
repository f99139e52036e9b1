#!/usr/bin/env bash
# The distilled rows of the fidelity table (docs/results.md) on one bundled model: task-calibrated EAN
# pools of 50% and 25% of the decode experts, each distilled for STEPS steps on the task domain, then
# served as deployed (prefill on the original, decode on the distilled checkpoint) on the same 300
# prompts (50 per task, seed 0, greedy) as every other row. Heavy steps go under the machine-wide lock.
#   scripts/distill_fidelity.sh MODEL [OUT] [STEPS]     (default build/distill-MODEL, 400)
#   KEEPS="0.25" scripts/distill_fidelity.sh ...         (the pools to distil; default "0.5 0.25")
# Paired sign tests between the rows: python scripts/paired_eval.py OUT/eval-* --against baseline
set -euo pipefail
M=${1:?usage: scripts/distill_fidelity.sh MODEL [OUT] [STEPS]}
OUT=${2:-build/distill-$M}
STEPS=${3:-400}
MT=${MT:-.venv/bin/moetailor}
LOCK="flock /tmp/moetailor-heavy.lock"
mkdir -p "$OUT/plans"
# a model without a shared expert has no SE2 to add: its student trains router and norms only
SE2=$(${PY:-.venv/bin/python} -c 'import sys; from moetailor.models.loading import read_config
c = read_config(sys.argv[1]); print("" if getattr(c, "shared_expert_intermediate_size", 0) or getattr(c, "n_shared_experts", 0) else "--no-se2")' "$M")
[ -f "$OUT/stats.safetensors" ] || $LOCK $MT calibrate "$M" --data tasks --tokens 50000 --out "$OUT/stats.safetensors"
for keep in ${KEEPS:-0.5 0.25}; do
    plan="$OUT/plans/ean-$keep.json"
    [ -f "$plan" ] || $MT plan "$OUT/stats.safetensors" --criterion ean --keep $keep --model "$M" --out "$plan"
    dir="$OUT/distilled/ean-$keep-$STEPS"
    [ -f "$dir/config.json" ] || $LOCK $MT distill "$M" "$plan" --data tasks --steps "$STEPS" --lr 1e-3 $SE2 \
        --out "$dir" --overwrite
    $LOCK $MT eval "$M" --plan "$plan" --configs baseline,phase-aware,distilled:"$dir" --n 50 --seeds 1 \
        --out "$OUT/eval-ean-$keep"
done
