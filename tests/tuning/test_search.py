"""`tune` end to end on tiny checkpoints of every architecture: the front, the choice, resuming, the
decode traces of prompt/answer traffic, and a checkpoint scored layer by layer."""
import json

import pytest

from moetailor.models import load_model
from moetailor.models.tiny import char_tokenizer, tiny_grouped_model, tiny_model
from moetailor.plans import Plan
from moetailor.serving import LLM, SamplingParams
from moetailor.tuning.search import Tuner, TuneSettings

SMALL = dict(calib_tokens=512, kl_tokens=256, kl_window=32, criteria=("reap", "ean"))


def save(arch, path, shard=None):
    model = tiny_grouped_model() if arch == "deepseek_v3-grouped" else tiny_model(arch, num_experts=8, top_k=2,
                                                                                   layers=3)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    char_tokenizer().save_pretrained(path)
    return path


def tune(path, out, **kw):
    settings = TuneSettings(model=str(path), data=kw.pop("data", "mix"), out=out, **{**SMALL, **kw})
    tuner = Tuner(settings, log=lambda m: None, progress=False)
    return tuner, tuner.run()


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "mixtral", "deepseek_v3-grouped"])
def test_tune_chooses_the_best_plan_at_the_target(arch, tmp_path):
    path = save(arch, tmp_path / "model")
    tuner, result = tune(path, tmp_path / "out", max_kl=10.0, budget=0.6)
    assert result.choice.met
    chosen = result.choice.chosen
    at_target = [r for r in tuner.scored.values() if r["budget"] <= 0.6 and not tuner._is_probe(r)]
    assert chosen["budget"] <= 0.6 and chosen["kl"] == min(r["kl"] for r in at_target)
    plan = Plan.load(tmp_path / "out" / "plan.json")
    model = load_model(path)
    plan.check_model(model)
    assert plan.prefill.is_identity and not plan.decode.is_identity        # phase-aware
    if plan.merges:   # a merged decoder is its own stock checkpoint
        model, plan = load_model(chosen["merged"]), None
    llm = LLM(model, plan, tokenizer=char_tokenizer(), max_num_seqs=2)
    assert llm.generate(["add 1 + 2"], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids
    data = json.loads((tmp_path / "out" / "front.json").read_text())
    assert data["choice"]["chosen"] == chosen["key"] and data["points"][0]["label"] == "full model"
    assert (tmp_path / "out" / "front.png").stat().st_size > 1000
    front = [r for r in result.front if r is not result.full]
    assert all(a["budget"] < b["budget"] and a["kl"] > b["kl"] for a, b in zip(front, front[1:]))
    kinds = {(r["candidate"]["pool_mode"], r["candidate"]["allocation"]) for r in tuner.scored.values()}
    assert ("fold", "uniform") in kinds and ("mask", "sensitivity") in kinds and ("novice", "uniform") in kinds
    novice_probes = [r for r in tuner.scored.values() if r["candidate"]["pool_mode"] == "novice" and tuner._is_probe(r)]
    assert len(novice_probes) >= len(tuner.layers) and ("novice", "sensitivity") in kinds   # per-layer novice pools

    def one_transfer_from_uniform(sizes):     # what the descent from a uniform pool (plan --layers search) tries first
        rest = sorted(sizes)[1:-1]
        return len(set(rest)) <= 1 and sorted(sizes)[0] + 2 * tuner.step == sorted(sizes)[-1] and \
            (not rest or rest[0] == sorted(sizes)[0] + tuner.step)
    assert any(one_transfer_from_uniform(r["candidate"]["sizes"]) for r in novice_probes), arch
    assert (("merge", "uniform") in kinds) == (arch != "deepseek_v3-grouped")   # no merging of grouped routers
    if arch == "deepseek_v3-grouped":   # 4 routing groups: every pool keeps a multiple of 4 experts
        assert all(s % 4 == 0 for r in tuner.scored.values() for s in r["candidate"]["sizes"])


def test_a_missed_floor_names_the_best_on_each_side_and_a_rerun_resumes(tmp_path):
    path = save("qwen2_moe", tmp_path / "model")
    tuner, result = tune(path, tmp_path / "out", max_kl=0.0, budget=0.5)
    c = result.choice
    assert not c.met and not (tmp_path / "out" / "plan.json").exists()
    assert c.cheapest_meeting_floor["label"] == "full model"
    best = min((r for r in tuner.scored.values() if r["budget"] <= 0.5 and not tuner._is_probe(r)),
               key=lambda r: r["kl"])
    assert c.best_at_target["key"] == best["key"] and (tmp_path / "out" / "best-at-target.json").is_file()
    files = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out" / "candidates").iterdir()}
    again, result2 = tune(path, tmp_path / "out", max_kl=0.0, budget=0.5)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out" / "candidates").iterdir()} == files
    assert result2.choice.best_at_target["key"] == best["key"]
    with pytest.raises(ValueError, match="another model, traffic or setting"):
        tune(path, tmp_path / "out", max_kl=0.0, budget=0.5, kl_tokens=512)


def test_prompt_answer_traffic_is_calibrated_on_the_full_models_own_answers(tmp_path):
    path = save("qwen2_moe", tmp_path / "model")
    tok = char_tokenizer()
    llm = LLM(load_model(path), tokenizer=tok, max_num_seqs=8)
    prompts = [f"add {a} + {b}\n" for a in range(3) for b in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    lines = [{"prompt": p, "answer": o.text.strip(), "match": "contains"} for p, o in zip(prompts, outs) if o.text.strip()]
    assert len(lines) >= 6
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tuner, result = tune(path, tmp_path / "out", data=str(traffic), min_quality=0.5, budget=0.6, evaluate=3, n=50,
                         criteria=("reap",), allocation=False)
    assert tuner.task_traffic and result.summary["prompts"] == len(lines)
    traces = [json.loads(x)["text"] for x in (tmp_path / "out" / "traces.jsonl").read_text().splitlines()]
    assert traces[0].startswith(lines[0]["prompt"]) and len(traces[0]) > len(lines[0]["prompt"])
    assert result.full["accuracy"] == 1.0                        # each answer is what the full model says
    evaluated = [r for r in result.points if r is not result.full]
    assert 1 <= len(evaluated) <= 3
    for r in evaluated:
        assert r["of_full"] == r["accuracy"] and r["vs_full"]["gained"] == 0
        assert r["vs_full"]["lost"] == round((1 - r["accuracy"]) * len(lines))


def test_the_named_plans_verdicts_come_from_prompts_that_did_not_pick_them(tmp_path):
    """The plans tune names run a second prompt set (a task file's next --n lines) and keep only that
    set's verdict. With the full model's own answers there too, the choice is confirmed; where the second
    set's answers are ones the full model never gives, nothing can be proven there, so a plan that met
    the floor on the prompts that picked it is not chosen and no plan.json is written."""
    path = save("qwen2_moe", tmp_path / "model")
    llm = LLM(load_model(path), tokenizer=char_tokenizer(), max_num_seqs=8)
    prompts = [f"add {a} + {b}\n" for a in range(5) for b in range(5)]
    outs = [o.text.strip() for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))]
    lines = [(p, o[:2]) for p, o in zip(prompts, outs) if o][:24]     # a tiny random model: its first characters
    assert len(lines) == 24

    def run(name, answers):
        traffic = tmp_path / f"{name}.jsonl"
        traffic.write_text("".join(json.dumps({"prompt": p, "answer": a, "match": "contains"}) + "\n"
                                   for (p, _), a in zip(lines, answers)))
        return tune(path, tmp_path / name, data=str(traffic), min_quality=0.5, budget=0.9, evaluate=2, n=12,
                    criteria=("reap",), allocation=False, merge=False, protect_super=0)

    tuner, result = run("own", [o for _, o in lines])
    assert result.summary["prompts"] == result.summary["fresh_prompts"] == 12
    assert result.full["fresh"]["accuracy"] == 1.0 and result.choice.met
    chosen = result.choice.chosen
    assert chosen["fresh"]["prompts"] == 12 and chosen["fresh"]["floor"]["verdict"] == "meets"
    assert (tmp_path / "own" / "plan.json").is_file()
    assert result.choice.cheapest_meeting_floor["fresh"]["floor"]["verdict"] == "meets"
    assert "fresh prompts: of full (95% CI)" in (tmp_path / "own" / "front.md").read_text()

    tuner, result = run("other", [o for _, o in lines[:12]] + ["never said"] * 12)
    best = result.choice.best_at_target
    assert best["floor"]["verdict"] == "meets"                        # on the prompts that picked it
    assert result.full["fresh"]["accuracy"] == 0.0 and tuner.floor_verdict(best) == "not enough prompts to tell"
    assert not result.choice.met and not (tmp_path / "other" / "plan.json").exists()
    assert result.choice.cheapest_meeting_floor is result.full    # every plan that met it first is unproven now


def test_a_checkpoint_scored_layer_by_layer(tmp_path):
    path = save("olmoe", tmp_path / "model", shard="60KB")
    tuner, result = tune(path, tmp_path / "out", max_kl=10.0, budget=0.5, stream="on", criteria=("reap",),
                         kl_tokens=64)
    assert result.summary["streamed"] and result.choice.met
    assert all(r["candidate"]["pool_mode"] == "mask" for r in tuner.scored.values())
    with pytest.raises(ValueError, match="--max-kl"):
        tune(path, tmp_path / "out2", min_quality=0.9, budget=0.5, stream="on", tasks="addition")


def test_speed_targets_projected_on_a_gpu_and_measured_by_the_engine(tmp_path):
    path = save("qwen3_moe", tmp_path / "model")
    kw = dict(max_kl=10.0, criteria=("reap",), allocation=False, fold=False)
    tuner, result = tune(path, tmp_path / "gpu", min_tok_s=2e5, gpu="h200", model_shape="qwen3-30b-a3b", batch=256,
                         **kw)
    speeds = [(r["pool_share"], r["tok_s"]) for r in sorted(result.points, key=lambda r: r["pool_share"])]
    assert all(r["tok_s_kind"] == "projected h200 qwen3-30b-a3b" for r in result.points)
    assert all(a[1] >= b[1] for a, b in zip(speeds, speeds[1:]))      # a smaller pool projects faster
    if result.choice.met:
        assert result.choice.chosen["tok_s"] >= 2e5
    tuner, result = tune(path, tmp_path / "engine", min_tok_s=1e-3, batch=2, **kw)
    assert all(r["tok_s"] > 0 and r["tok_s_kind"].startswith("measured") for r in result.points)


@pytest.mark.slow     # distils, then serves through the disaggregated engine's two worker processes
def test_distillation_adds_a_served_decoder_point(tmp_path):
    path = save("qwen2_moe", tmp_path / "model")
    tok = char_tokenizer()
    llm = LLM(load_model(path), tokenizer=tok, max_num_seqs=8)
    prompts = [f"sort {a} {b}\n" for a in range(3) for b in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt": p, "answer": o.text.strip(), "match": "contains"}) + "\n"
                               for p, o in zip(prompts, outs) if o.text.strip()))
    tuner, result = tune(path, tmp_path / "out", data=str(traffic), min_quality=0.5, budget=0.5, evaluate=1,
                         criteria=("reap",), allocation=False, fold=False, top_k=False, distill_steps=2)
    distilled = [r for r in result.points if r.get("distilled")]
    assert len(distilled) == 1 and distilled[0]["key"].endswith("+distilled2")
    assert (tmp_path / "out" / "distilled").is_dir() and "of_full" in distilled[0]


def test_servable_vllm_keeps_to_plans_the_vllm_plugin_applies(tmp_path):
    """Masked, folded and novice plans run in vLLM's plugin (folding and novice constants through the
    plan's fold_stats), so all are searched; every plan tune saved passes the checks the plugin runs at
    start. A distilled decoder is engine-only: asking for one with --servable vllm is refused by name."""
    from moetailor.integrations.vllm.plan import load_checked_plan

    path = save("qwen3_moe", tmp_path / "model")
    tuner, result = tune(path, tmp_path / "out", max_kl=10.0, budget=0.5, servable="vllm", criteria=("reap",))
    assert result.choice.met and all(r["vllm"] for r in result.front)
    modes = {r["candidate"]["pool_mode"] for r in tuner.scored.values()}
    assert modes == {"mask", "fold", "novice", "merge"}
    plans = sorted((tmp_path / "out" / "plans").glob("*.json"))
    assert any("-fold" in p.name for p in plans)
    for plan_path in [tmp_path / "out" / "plan.json", *plans]:
        if Plan.load(plan_path).merges:   # served as its merged checkpoint, which the plugin refuses to emulate
            with pytest.raises(ValueError, match="merged checkpoint"):
                load_checked_plan(plan_path, "decode", path)
            continue
        plan = load_checked_plan(plan_path, "decode", path)   # what vLLM's plugin checks at start
        assert not plan.decode.is_identity
    with pytest.raises(ValueError, match="--distill makes a distilled decoder.*drop --distill or --servable vllm"):
        TuneSettings(model=str(path), data="mix", out=tmp_path / "x", max_kl=1.0, budget=0.5, servable="vllm",
                     distill_steps=2).validate()

def test_tune_searches_novice_merged_and_protected_pools_and_evaluates_merged_decoders(tmp_path):
    """Novice pools, merged experts (both methods) and protected super experts are scored beside the
    masked pools; a merged point is scored and evaluated on its own merged checkpoint (prefill on the
    model, decode on the checkpoint) and, if chosen, named with that checkpoint."""
    path = save("qwen2_moe", tmp_path / "model")
    tok = char_tokenizer()
    llm = LLM(load_model(path), tokenizer=tok, max_num_seqs=8)
    prompts = [f"add {a} + {b}\n" for a in range(3) for b in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt": p, "answer": o.text.strip(), "match": "contains"}) + "\n"
                               for p, o in zip(prompts, outs) if o.text.strip()))
    tuner, result = tune(path, tmp_path / "out", data=str(traffic), min_quality=0.5, budget=0.5, evaluate=6,
                         criteria=("reap",), allocation=False, fold=False, top_k=False, protect_super=1)
    cands = [r["candidate"] for r in tuner.scored.values()]
    assert {c.get("merge") for c in cands if c["pool_mode"] == "merge"} == {"hcsmoe", "msmoe"}
    assert any(c["pool_mode"] == "novice" and c["criterion"] == "mone" for c in cands)
    assert any(c.get("protect_super") == 1 for c in cands)
    merged = [r for r in tuner.scored.values() if r["candidate"]["pool_mode"] == "merge"]
    assert all(load_model(r["merged"]).config.num_experts == r["candidate"]["sizes"][0] for r in merged)
    evaluated = {r["candidate"]["pool_mode"] for r in result.points if r is not result.full}
    assert {"merge", "novice"} <= evaluated           # second opinions of each kind at the target
    for r in result.points:
        if r is not result.full:
            assert r["floor"]["verdict"] in ("meets", "misses", "not enough prompts to tell")


def test_backend_vllm_searches_the_replacing_pools_and_says_where_each_was_scored(tmp_path, monkeypatch):
    """--backend vllm runs stage 3c too. Here the vLLM evaluator is the embedded engine under vLLM's name
    (the real one: tests/integrations/vllm/test_vllm_evaluator.py), standing for a --vllm-url server
    started without --vllm-novice: protected super experts are searched and scored on it; novice pools
    are left out with a note naming the fix (and refused by name when --novice asks for them); merged
    decoders are scored on the embedded engine, each row saying so."""
    from moetailor.eval import backends
    from moetailor.tuning.report import rows

    class ServerWithoutNovice(backends.EngineBackend):
        name, novice = "vllm", False

    asked = []
    monkeypatch.setattr(backends, "check_backend", lambda backend, url, model: {"novice": False, "name": "m"})
    monkeypatch.setattr(backends, "make_backend", lambda backend, model, tok, path, url=None, novice=True:
                        asked.append(novice) or ServerWithoutNovice(model, tok))
    path = save("qwen2_moe", tmp_path / "model")
    kw = dict(max_kl=10.0, budget=0.5, servable="vllm", backend="vllm", vllm_url="http://127.0.0.1:1",
              criteria=("reap",), allocation=False, fold=False, top_k=False, protect_super=1)
    tuner, result = tune(path, tmp_path / "out", **kw)
    assert asked == [True]
    cands = {r["key"]: r["candidate"] for r in tuner.scored.values()}
    assert not any(c["pool_mode"] == "novice" for c in cands.values())
    assert any(c["pool_mode"] == "mask" and c.get("protect_super") == 1 for c in cands.values())
    merged = {k for k, c in cands.items() if c["pool_mode"] == "merge"}
    assert merged and all((tuner.scored[k]["scored_by"] == "engine") == (k in merged) for k in cands)
    assert tuner.scored[next(iter(merged))]["scored_by"] == "engine"
    notes = result.summary["notes"]
    assert len(notes) == 2 and "novice pools not searched" in notes[0] and "--vllm-novice" in notes[0]
    assert "merged experts are scored on moetailor's engine" in notes[1]
    data = json.loads((tmp_path / "out" / "front.json").read_text())
    assert data["summary"]["notes"] == notes
    assert {p["key"] for p in data["proxy"] if p["scored_by"] == "engine"} == merged
    cols, table = rows(tuner, result, list(tuner.scored.values()))
    where = dict(zip(tuner.scored, (row[cols.index("scored on")] for row in table)))
    assert {k for k, v in where.items() if v == "engine"} == merged and set(where.values()) == {"engine", "vLLM"}
    with pytest.raises(ValueError, match=r"--novice: the vLLM server .* adds no novice constants.*--vllm-novice"):
        tune(path, tmp_path / "asked", novice=True, **kw)
    assert not (tmp_path / "asked").exists()
    tuner.s.backend = "engine"        # the engine scores every row: no column for it
    assert "scored on" not in rows(tuner, result, [])[0]


def test_tune_computes_in_float32_as_eval_does_unless_only_the_stored_dtype_fits(tmp_path, monkeypatch):
    """`eval` generates in float32 whatever the checkpoint stores; tune does too by default, so its
    verdicts are eval's (in the bundled models' stored bf16 one near-tie prompt of 300 scored
    differently). --dtype auto asks for the stored dtype; so does a checkpoint that fits in memory only
    in it, rather than being scored layer by layer."""
    import torch

    from moetailor.models import checkpoint

    path = tmp_path / "model"
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2, layers=3).to(torch.bfloat16)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    assert checkpoint.stored_dtype(path) == torch.bfloat16

    def setup(out, **kw):
        tuner = Tuner(TuneSettings(model=str(path), data="mix", out=tmp_path / out, max_kl=1.0, budget=0.5,
                                   **{**SMALL, **kw}), log=lines.append, progress=False)
        tuner._setup()
        return tuner

    lines = []
    assert setup("default").model.dtype == torch.float32 and not lines
    assert setup("auto", dtype="auto").model.dtype == torch.bfloat16
    real = checkpoint.should_stream
    monkeypatch.setattr(checkpoint, "should_stream",      # float32 would not fit, bf16 does
                        lambda p, dtype, mode="auto", **kw: mode == "on" or (mode == "auto" and dtype == torch.float32))
    tuner = setup("tight")
    assert tuner.model.dtype == torch.bfloat16 and not tuner.streamed
    assert lines and "float32 does not fit in memory" in lines[-1]
    monkeypatch.setattr(checkpoint, "should_stream", real)
