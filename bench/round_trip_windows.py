"""Deep multi-region pipelines (one stage group per cluster, m = global batch): [C3] with suffix windows
only (the previous model) vs every window (this round's) vs an exact replay of the runner's 1F1B order
(the kernel's pipeline.replay_stage_ends). Command: PYTHONPATH=$PWD .venv/bin/python bench/round_trip_windows.py"""
from hgopt.instances import load_instance
from hgopt.cost import evaluate
from hgopt.cost.pipeline import pipeline_bottleneck, pipeline_time, replay_stage_ends
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.cost.schedule import stage_ops
for name, per in (("geo-3r-gpt1.3b", 2), ("geo-4r-llama7b", 2), ("geo-6r-llama13b", 1), ("geo-5r-fp16-gpt2.7b", 2), ("geo-8r-llama70b", 1)):
    inst = load_instance(name)
    L = inst.model.num_layers
    cl = [c for c in inst.topology.clusters]
    S = min(per * len(cl), L)
    cuts = [round(i * L / S) for i in range(S + 1)]
    tp = lambda c: max(t for t in inst.model.tps(c.gpu) if c.gpus_per_node % t == 0)
    stages = tuple(Stage(start=cuts[i], end=cuts[i + 1], groups=(ReplicaGroup(cluster=cl[i * len(cl) // S].name, tp=tp(cl[i * len(cl) // S])),)) for i in range(S))
    m = inst.job.global_batch
    ev = evaluate(Plan(pipelines=(Pipeline(stages=stages, num_microbatches=m),)), inst)
    if not ev.pipelines:
        print(name, ev.violations[:2]); continue
    st = ev.stages
    f, b, cf, cb = [s.fwd_s for s in st], [s.bwd_s for s in st], [s.send_fwd_s for s in st], [s.send_bwd_s for s in st]
    fill = ev.pipelines[0].fill_drain_s
    suf = pipeline_time(m, pipeline_bottleneck("1f1b", f, b, cf, cb, m, "suffix"), fill)
    allw = pipeline_time(m, pipeline_bottleneck("1f1b", f, b, cf, cb, m, "all"), fill)
    rep = max(replay_stage_ends(stage_ops, "1f1b", f, b, cf, cb, m))
    print(f"{name}: {S} stages over {len(cl)} clusters, m={m}: replay {rep:.3f} s; suffix windows {suf:.3f} s ({(suf/rep-1)*100:+.1f} %); all windows {allw:.3f} s ({(allw/rep-1)*100:+.1f} %); evaluate pipeline_time_s {ev.pipeline_time_s:.3f}")
