"""Cost-model validation: predicted (``hgopt.cost.evaluate``) vs measured (the PyTorch runner on
emulated links) iteration time for a set of plans of a small GPT.

    sudo .venv/bin/python bench/validate_cost_model.py [--out DIR] [--steps 10] [--pace 0.2]

Steps: (1) ``hgopt profile`` measures the runner's model layer by layer as a paced device
(``--pace``: thread CPU time / pace, see hgopt/profiler/paced.py); (2) ``hgopt profile --links``
measures the loopback link between two ranks and every emulated WAN link (network namespaces + tc
tbf, small burst); (3) each plan: a fresh ``hgopt profile`` of the microbatch sizes it uses (the CPU
time of the same layer drifts by up to ~15 % over minutes on a shared host), a prediction with
``evaluate`` on an instance built from the measured figures, a run with the runner (every rank paced at
the same speed) and its median step time; (4) table, errors, rank agreement (Kendall tau) among the
candidates of one instance (all predicted from the start-up profile), scatter plot. With ``--in-situ``
(default) each plan is also predicted from its fresh profile calibrated on the run's own warm-up steps
(every stage's layers rescaled to the device time its operations took there,
``hgopt.profiler.insitu``; measured steps 4-9 are not used): that prediction tests the cost model's
composition without the emulated device's context-dependent speed (docs/validation.md). Links are emulated by the runner's ``delay`` mode (exactly the
configured bandwidth and latency); ``--netns`` emulates those without latency with network namespaces
and tc tbf instead, measured with ``hgopt profile --links`` (on a shared CPU host the kernel's packet
work is then charged to the paced ranks: docs/validation.md).
Needs root (namespaces, tc). Deterministic plan set; ~10 minutes on 2 busy cores, less on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._harness import ModelOpts, RunResult, load_average, run_plan  # noqa: E402
from hgopt.cost import evaluate  # noqa: E402
from hgopt.profiler.insitu import calibrate_profile, stage_times_from_trace  # noqa: E402
from hgopt.simulate import simulate  # noqa: E402
from hgopt.plan import Boundary, Pipeline, Plan, ReplicaGroup, Stage  # noqa: E402
from hgopt.spec import Instance, instance_from_dict  # noqa: E402

MODEL = ModelOpts(hidden=128, heads=4, vocab=256, seq=128, data="random")
BLOCKS = 4
GLOBAL_BATCH = 16
MBS = (1, 2, 4, 8)
HGOPT = [sys.executable, "-m", "hgopt.cli"]


# ---- the emulated topologies ---------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Net:
    """Two clusters (a, b) of ``devices`` paced devices each, joined by one emulated WAN link."""

    name: str
    mbit_s: float
    latency_ms: float
    devices: int = 2
    netns: bool = False
    """Emulate a link without latency with ``netns`` (tc tbf) instead of the runner's ``delay`` mode."""

    @property
    def mode(self) -> str:
        return "netns" if self.netns and self.latency_ms == 0 else "delay"


NETS = {
    "lan": Net(name="lan", mbit_s=1000.0, latency_ms=0.0, devices=4),  # plans that use cluster a only
    "w200": Net(name="w200", mbit_s=200.0, latency_ms=0.0),
    "w50": Net(name="w50", mbit_s=50.0, latency_ms=0.0),
    "w1000-20ms": Net(name="w1000-20ms", mbit_s=1000.0, latency_ms=20.0),
    "w100-50ms": Net(name="w100-50ms", mbit_s=100.0, latency_ms=50.0),
}
RANK_GROUP = "w200"
"""The instance whose candidate plans are ranked (Kendall tau, best plan)."""


def g(cluster: str, dp: int = 1, mbs: int = 4) -> ReplicaGroup:
    return ReplicaGroup(cluster=cluster, dp=dp, mbs=mbs)


def pipe(cuts: list[int], groups: list[ReplicaGroup], m: int, precision: str = "native",
         schedule: str = "1f1b") -> Pipeline:
    stages = tuple(Stage(start=a, end=b, groups=(grp,)) for a, b, grp in zip(cuts, cuts[1:], groups))
    bounds = tuple(Boundary(fwd=precision, bwd=precision) for _ in stages[1:]) if precision != "native" else ()
    return Pipeline(stages=stages, num_microbatches=m, boundaries=bounds, schedule=schedule)  # type: ignore[arg-type]


def plans() -> list[tuple[str, str, Plan]]:
    """(name, net, plan); layers: 0 embedding, 1-4 blocks, 5 head; global batch 16."""
    one = lambda *p: Plan(pipelines=tuple(p))  # noqa: E731
    return [
        ("lan 2st m4", "lan", one(pipe([0, 3, 6], [g("a"), g("a")], 4))),
        ("lan 4st m4", "lan", one(pipe([0, 2, 3, 4, 6], [g("a")] * 4, 4))),
        # cuts other than the balanced ones: the pipelined profile's run (0, 3, 6) is not this plan's partition
        ("lan 2st uneven m4", "lan", one(pipe([0, 2, 6], [g("a"), g("a")], 4))),
        ("w200 2st a|b m4", "w200", one(pipe([0, 3, 6], [g("a"), g("b")], 4))),
        ("w200 4st aa|bb m4", "w200", one(pipe([0, 2, 3, 4, 6], [g("a"), g("a"), g("b"), g("b")], 4))),
        ("w200 2st a|b mbs2 m8", "w200", one(pipe([0, 3, 6], [g("a", mbs=2), g("b", mbs=2)], 8))),
        ("w200 2st aa m4", "w200", one(pipe([0, 3, 6], [g("a"), g("a")], 4))),
        ("w200 dp a+b", "w200", one(pipe([0, 6], [g("a", mbs=4)], 2), pipe([0, 6], [g("b", mbs=4)], 2))),
        ("w200 2st dp2 a|b", "w200", one(pipe([0, 3, 6], [g("a", dp=2, mbs=2), g("b", dp=2, mbs=2)], 4))),
        ("w50 2st a|b m4", "w50", one(pipe([0, 3, 6], [g("a"), g("b")], 4))),
        ("w50 2st a|b bf16 m4", "w50", one(pipe([0, 3, 6], [g("a"), g("b")], 4, precision="bf16"))),
        ("w50 3st a|a|b gpipe", "w50", one(pipe([0, 2, 4, 6], [g("a"), g("a"), g("b")], 4, schedule="gpipe"))),
        ("w1000+20ms 4st aa|bb", "w1000-20ms", one(pipe([0, 2, 3, 4, 6], [g("a"), g("a"), g("b"), g("b")], 4))),
        ("w100+50ms 2st a|b m4", "w100-50ms", one(pipe([0, 3, 6], [g("a"), g("b")], 4))),
        ("w100+50ms 3st a|b|b m8", "w100-50ms", one(pipe([0, 2, 4, 6], [g("a", mbs=2), g("b", mbs=2), g("b", mbs=2)], 8))),
    ]


# ---- measuring the inputs ------------------------------------------------------------------------
def _hgopt(args: list[str]) -> None:
    """One ``hgopt`` measurement; once more if it fails (a rendezvous can time out on a loaded host)."""
    if subprocess.run([*HGOPT, *args], cwd=ROOT, stdout=subprocess.DEVNULL).returncode != 0:
        print(f"  hgopt {args[0]} failed, running it again", flush=True)
        subprocess.run([*HGOPT, *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def profile_model(path: Path, pace: float, mbs: tuple[int, ...] = MBS, repeat: int = 10,
                  tenants: int = 1, pipeline: tuple[int, int] | None = None) -> dict[str, Any]:
    """``hgopt profile --pace``, timed with ``tenants - 1`` paced co-tenants: as the ranks of a plan with
    ``tenants`` ranks share the machine (hgopt/profiler/tenants.py); with ``pipeline`` (N, D), then each
    stage's layers rescaled to their device time in a short N-stage pipelined run of the runner, D replicas
    per stage (hgopt/profiler/pipelined.py; the runs and the layer-by-layer profile kept next to ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = (["--pipeline", str(pipeline[0]), "--pipeline-dp", str(pipeline[1]), "--pipeline-dir",
              str(path.parent / "pipelined")] if pipeline else [])
    _hgopt(["profile", "--tenants", str(tenants), "--blocks", str(BLOCKS), "--hidden", str(MODEL.hidden), "--heads", str(MODEL.heads),
            "--vocab", str(MODEL.vocab), "--seq", str(MODEL.seq), "--mbs", ",".join(map(str, mbs)),
            "--pace", str(pace), "--warmup", "2", "--repeat", str(repeat), "-o", str(path), *extra])
    return json.loads(path.read_text())


def pipeline_shape(plan: Plan, shape: str) -> tuple[int, int]:
    """The profiling pipeline for ``plan``: ``ranks``: as many stages as the plan has ranks, one replica
    each; ``plan``: the plan's deepest pipeline's stage count, and as many replicas per stage as make up
    its ranks (its cuts, clusters, links and microbatch count are not used)."""
    if shape == "ranks":
        return plan.num_gpus(), 1
    stages = max(len(p.stages) for p in plan.pipelines)
    return stages, max(1, plan.num_gpus() // stages)


def plan_mbs(plan: Plan) -> tuple[int, ...]:
    return tuple(sorted({g.mbs for p in plan.pipelines for s in p.stages for g in s.groups}))


def measure_links(out: Path, burst: int, nets: dict[str, Net]) -> dict[str, dict[str, float]]:
    """Loopback (ranks of one cluster) and every netns WAN link, as {gbyte_s, latency_ms}."""
    figures = {}
    path = out / "links-loopback.json"
    _hgopt(["profile", "--links", "--ranks", "2", "--repeat", "5", "--sizes", "65536,262144,1048576,4194304",
            "-o", str(path)])
    figures["loopback"] = json.loads(path.read_text())["point_to_point"]
    for net in nets.values():
        if net.mode != "netns" or net.name == "lan":
            continue
        path = out / f"links-{net.name}.json"
        _hgopt(["profile", "--links", "--emulate", str(net.mbit_s), "--burst", str(burst), "--repeat", "3",
                "--sizes", "65536,262144,1048576,2097152", "-o", str(path)])
        figures[net.name] = json.loads(path.read_text())["point_to_point"]
    return figures


def instance(net: Net, prof: dict[str, Any], links: dict[str, dict[str, float]]) -> Instance:
    """Measured compute and loopback; the WAN link as measured (netns) or as emulated by the runner's
    delay mode (exactly the configured bandwidth and latency)."""
    local = {"gbyte_s": links["loopback"]["gbyte_s"], "latency_ms": links["loopback"]["latency_ms"]}
    if net.mode == "netns" and net.name in links:
        wan = dict(links[net.name])  # the fitted intercept: per-message cost of TCP, tbf and wake-ups
    else:
        wan = {"gbit_s": net.mbit_s / 1000.0, "latency_ms": net.latency_ms}
    # What the emulation implements: one shaped veth (netns) or one shared hop in the delay mode's
    # ledger (hgopt/runner/linkemu.py) per cluster pair and direction, which every flow between the two
    # clusters shares -- a shared pipe, not per-flow links.
    wan = {"kind": "shared_pipe", **wan, "source": f"emulated: {net.mode} link of {net.mbit_s:g} Mbit/s"
           + (f" + {net.latency_ms:g} ms" if net.latency_ms else "") + " per cluster pair and direction"}
    clusters = [{"name": c, "region": f"r{c}", "gpu": "cpu", "gpu_memory_gb": 16, "nodes": 1,
                 "gpus_per_node": net.devices, "intra_node": local, "inter_node": local} for c in ("a", "b")]
    return instance_from_dict({
        "name": f"validate-{net.name}", "model": prof,
        "topology": {"clusters": clusters, "links": {"default": wan}},
        "job": {"global_batch": GLOBAL_BATCH, "seq_len": MODEL.seq, "precision": "fp32"},
    })


# ---- statistics ----------------------------------------------------------------------------------
def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b of two equally long lists (ties count as neither concordant nor discordant)."""
    conc = disc = tx = ty = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif dx * dy > 0:
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return (conc - disc) / denom if denom else float("nan")


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    name: str
    net: str
    ranks: int
    predicted_s: float
    common_s: float
    """The prediction from the profile measured once at the start (used to rank the candidates)."""
    before_s: float
    """The prediction without the 1F1B round-trip term (evaluate before change 1 of bench/RESULTS.md)."""
    simulated_s: float
    """``hgopt simulate``'s iteration time on the same instance (the event replay of the runner's order)."""
    measured_s: float
    run: RunResult
    insitu_s: float = float("nan")
    """``evaluate`` on the plan's profile calibrated in situ (its run's warm-up steps)."""
    insitu_sim_s: float = float("nan")
    """``simulate`` on the same."""
    layers_s: float = float("nan")
    """evaluate from the fresh profile's layer-by-layer timing alone (before its pipelined run)."""

    def relative(self, predicted_s: float) -> float:
        """(``predicted_s`` − measured) / measured: every error column below."""
        return (predicted_s - self.measured_s) / self.measured_s

    @property
    def error(self) -> float:
        return self.relative(self.predicted_s)

    @property
    def error_sim(self) -> float:
        return self.relative(self.simulated_s)

    @property
    def error_insitu(self) -> float:
        return self.relative(self.insitu_s)

    @property
    def error_insitu_sim(self) -> float:
        return self.relative(self.insitu_sim_s)

    @property
    def error_before(self) -> float:
        return self.relative(self.before_s)


def without_round_trip(ev: Any, plan: Plan) -> float:
    """Iteration time as [C3] had it before the round-trip term: (m-1)·max(t_s, c_s) + fill."""
    times = []
    for pi, pipe in enumerate(plan.pipelines):
        st = [s for s in ev.stages if s.pipeline == pi]
        if pipe.schedule == "gpipe":
            times.append(ev.pipelines[pi].time_s)
            continue
        bott = max(max(s.fwd_s + s.bwd_s, s.send_fwd_s, s.send_bwd_s) for s in st)
        times.append((pipe.num_microbatches - 1) * bott + ev.pipelines[pi].fill_drain_s)
    return max(times) + ev.sync_optimizer_time_s


def _planner_candidate(inst: Instance) -> tuple[str, Plan] | None:
    """The plan of the project's own planner for the rank group (exact MILP first, else the heuristic),
    without ZeRO sharding (the runner keeps full optimizer state on every replica, so a zero-1 plan
    runs as its zero-0 twin)."""
    try:
        from hgopt.search import PlanOptions, get_planner
    except ImportError:
        return None
    for name in ("milp", "heuristic"):
        try:
            res = get_planner(name)(inst, PlanOptions(time_limit_s=30.0))
        except Exception as exc:  # a planner that cannot handle this instance must not stop the validation
            print(f"  planner {name} failed: {type(exc).__name__}: {exc}")
            continue
        if res.plan is not None and res.plan.num_gpus() <= 4:
            print(f"  planner {name}: {res.status}, predicted {res.iteration_time_s:.3f} s")
            plain = tuple(replace(p, stages=tuple(replace(st, zero=0) for st in p.stages)) for p in res.plan.pipelines)
            return f"planner {name}", replace(res.plan, pipelines=plain)
    return None


def scatter(rows: list[Row], path: Path) -> None:
    """Predicted vs measured per plan, coloured by instance; hollow: the prediction before change 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    hi = max(max(r.predicted_s, r.measured_s) for r in rows) * 1.1
    xs = [0, hi]
    ax.plot(xs, xs, color="black", lw=1, label="predicted = measured")
    for f, style in ((0.10, ":"), (0.25, "--")):
        ax.plot(xs, [x * (1 + f) for x in xs], color="grey", lw=0.8, ls=style, label=f"±{f:.0%}")
        ax.plot(xs, [x * (1 - f) for x in xs], color="grey", lw=0.8, ls=style)
    ax.scatter([r.measured_s for r in rows], [r.before_s for r in rows], s=28, facecolors="none",
               edgecolors="grey", label="without the 1F1B round-trip term")
    for net in NETS:
        sel = [r for r in rows if r.net == net]
        if sel:
            dots = ax.scatter([r.measured_s for r in sel], [r.predicted_s for r in sel], label=net, s=28)
            ax.scatter([r.measured_s for r in sel], [r.simulated_s for r in sel], marker="x", s=24,
                       color=dots.get_facecolor()[0])
            situ = [r for r in sel if not math.isnan(r.insitu_s)]
            ax.scatter([r.measured_s for r in situ], [r.insitu_s for r in situ], marker="^", s=18,
                       color=dots.get_facecolor()[0])
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured iteration time (s), runner median")
    ax.set_ylabel("predicted (s): evaluate (dots), simulate (x), evaluate in situ (^)")
    ax.set_title("hgopt cost model vs runner on emulated links")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ---- main ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/hgopt-validate", help="folder for profiles, runs and the table")
    ap.add_argument("--steps", type=int, default=9, help="runner steps per plan (the first 3 are warm-up)")
    ap.add_argument("--pace", type=float, default=0.15, help="device speed of every rank, in cores")
    ap.add_argument("--nice", type=int, default=-10, help="CPU priority of the paced ranks (root for < 0)")
    ap.add_argument("--max-lag", type=float, default=0.1,
                    help="rerun a plan once when a rank's pace lagged by more than this fraction of the run")
    ap.add_argument("--netns", action="store_true",
                    help="emulate the links without latency with netns (tc tbf, measured with hgopt profile --links) "
                         "instead of the delay mode: distorted on a shared CPU host, see docs/validation.md")
    ap.add_argument("--burst", type=int, default=30000,
                    help="token-bucket burst of the netns links (bytes). Not smaller: with a burst of a few packets "
                         "tbf releases packets one by one from its timer, and that softirq work is charged to "
                         "whichever paced rank runs (measured: +56 %% CPU time for the same work at 200 Mbit/s, "
                         "burst 3000 B; none at 30000 B)")
    ap.add_argument("--only", default="", help="comma-separated plan names (default: all)")
    ap.add_argument("--no-tenants", action="store_true",
                    help="profile alone (the method before this round's fix) instead of with as many paced "
                         "co-tenants as the plan has ranks")
    ap.add_argument("--no-device-regions", action="store_true",
                    help="pace every CPU second of a rank's main thread (the method before this round's fix) "
                         "instead of only its device work (model, autograd, loss, codec, optimizer)")
    ap.add_argument("--rt", type=int, default=1 if os.geteuid() == 0 else 0, metavar="PRIO",
                    help="paced ranks and profiles under SCHED_RR at PRIO once pacing starts (root; 0: off; "
                         "hgopt.profiler.paced.realtime_from_env)")
    ap.add_argument("--in-situ", action=argparse.BooleanOptionalAction, default=True,
                    help="also predict each plan from its profile calibrated on the run's warm-up steps "
                         "(the ranks' operations timed by bench/_op_trace.py; hgopt/profiler/insitu.py)")
    ap.add_argument("--pipelined", action=argparse.BooleanOptionalAction, default=True,
                    help="each plan's fresh profile: the layers timed one by one, then each stage's layers rescaled "
                         "to their device time in a short pipelined run of the runner with as many stages as the "
                         "plan has ranks (hgopt profile --pipeline N; hgopt/profiler/pipelined.py)")
    ap.add_argument("--pipeline-shape", choices=("plan", "ranks"), default="plan",
                    help="--pipelined: the profiling pipeline has the plan's depth (stages of its deepest pipeline) "
                         "and width (replicas per stage), or (ranks) as many stages as the plan has ranks")
    ap.add_argument("--calibrate-steps", default="2,3",
                    help="the steps (1-based; step 1 runs unpaced) whose operations calibrate the in-situ profile")
    ap.add_argument("--heartbeat", type=float, default=60.0, help="runner heartbeat timeout (s) on a busy host")
    ap.add_argument("--png", default=str(ROOT / "bench" / "validate_cost_model.png"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the scatter plot from --out's rows.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rt:
        os.environ["HGOPT_PACE_RT"] = str(args.rt)  # inherited by the profiles and the ranks
    os.environ["HGOPT_PACE_NICE"] = str(args.nice)  # the pipelined profiles' ranks, as the plans' ranks
    if args.plot_only:
        scatter([_row_from_json(d) for d in json.loads((out / "rows.json").read_text())], Path(args.png))
        return 0
    t0 = time.perf_counter()
    load0 = load_average()
    todo = plans()
    tenants = (lambda plan: 1) if args.no_tenants else (lambda plan: plan.num_gpus())  # noqa: E731
    # the start-up profiles (one per rank count: a paced device's speed depends on how many share the host)
    profs = {n: profile_model(out / f"profile-{n}.json", args.pace, tenants=n)
             for n in sorted({tenants(p) for _, _, p in todo})}
    prof = profs[max(profs)]  # the planner's instance: its plans use up to 4 ranks
    nets = {k: replace(v, netns=args.netns) for k, v in NETS.items()}
    links = measure_links(out, args.burst, nets)
    print(f"profile and links measured in {time.perf_counter() - t0:.0f} s; loopback "
          f"{links['loopback']['gbyte_s']:.2f} GB/s; " + ", ".join(
              f"{k} {v['gbyte_s'] * 8e3:.1f} Mbit/s" for k, v in links.items() if k != "loopback"))
    insts = {name: instance(net, prof, links) for name, net in nets.items()}
    cand = _planner_candidate(insts[RANK_GROUP])
    picked = None
    if cand is not None:
        same = [n for n, net, p in todo if net == RANK_GROUP and p.pipelines == cand[1].pipelines]
        picked = f"{cand[0]} -> {same[0]}" if same else cand[0]
        if not same:
            todo.append((cand[0], RANK_GROUP, cand[1]))
    if args.only:
        keep = set(args.only.split(","))
        todo = [t for t in todo if t[0] in keep]
    rows = []
    for name, net, plan in todo:
        common = evaluate(plan, instance(nets[net], profs.get(tenants(plan), prof), links))
        if not common.feasible:
            raise SystemExit(f"plan {name!r} is not feasible: {common.violations}")
        folder = out / "runs" / name.replace(" ", "_").replace("|", "-").replace("+", "p")
        # the device as it is now: a fresh profile of the microbatch sizes the plan uses, just before its run
        fresh = profile_model(folder / "profile.json", args.pace, plan_mbs(plan), repeat=8 if args.pipelined else 15,
                              tenants=tenants(plan),
                              pipeline=pipeline_shape(plan, args.pipeline_shape) if args.pipelined else None)
        inst = instance(nets[net], fresh, links)
        ev = evaluate(plan, inst)
        layered = folder / "pipelined" / "profile-layers.json"
        layers_s = (evaluate(plan, instance(nets[net], json.loads(layered.read_text()), links)).iteration_time_s
                    if args.pipelined else float("nan"))
        run = _run(plan, inst, folder, nets[net], args)
        insitu = {}
        if args.in_situ:
            cal = calibrated(fresh, plan, folder / "trace", args.pace, [int(x) for x in args.calibrate_steps.split(",")])
            (folder / "profile-insitu.json").write_text(json.dumps(cal, indent=1))
            cinst = instance(nets[net], cal, links)
            insitu = {"insitu_s": evaluate(plan, cinst).iteration_time_s,
                      "insitu_sim_s": simulate(plan, cinst).iteration_time_s}
        row = Row(name=name, net=net, ranks=plan.num_gpus(), predicted_s=ev.iteration_time_s,
                  common_s=common.iteration_time_s, before_s=without_round_trip(ev, plan),
                  simulated_s=simulate(plan, inst).iteration_time_s, measured_s=run.median_s, run=run,
                  layers_s=layers_s, **insitu)
        rows.append(row)
        print(f"{name:<26} evaluate {row.predicted_s:7.3f} s  simulate {row.simulated_s:7.3f} s  measured "
              f"{row.measured_s:7.3f} s  error {row.error:+6.1%}, simulate {row.error_sim:+6.1%}; in situ "
              f"{row.error_insitu:+6.1%}, simulate {row.error_insitu_sim:+6.1%} "
              f"(without round trip {row.error_before:+6.1%}; layers only "
              f"{row.relative(row.layers_s):+6.1%})  "
              f"(lag {run.lag_s:.2f} s, load {run.load_before:.1f}, run {run.wall_s:.0f} s)", flush=True)
    report(rows, out, Path(args.png), args, load0, time.perf_counter() - t0, picked)
    return 0


def calibrated(profile: dict[str, Any], plan: Plan, trace_dir: Path, pace: float, steps: list[int]) -> dict[str, Any]:
    """``profile`` calibrated in situ on the ranks' traces (bench/_op_trace.py) of ``steps``."""
    stages = []
    for f in sorted(trace_dir.glob("ops-*.json")):
        trace = json.loads(f.read_text())
        if not trace:
            continue
        st = plan.pipelines[trace[0]["pipeline"]].stages[trace[0]["stage"]]
        stages.append(stage_times_from_trace(trace, pace=pace, use_steps=steps, layers=(st.start, st.end),
                                             mbs=st.groups[0].mbs))
    if not stages:
        raise RuntimeError(f"no operation traces in {trace_dir}")
    return calibrate_profile(profile, stages, note=f"steps {','.join(map(str, steps))} of the run")


def _row_from_json(d: dict[str, Any]) -> Row:
    run = RunResult(step_s=tuple(d["steps_s"]), median_s=d["measured_s"], losses=(), bytes_last_step={}, wall_s=0.0,
                    load_before=d.get("load", 0.0), load_after=0.0, returncode=0, lag_s=d["lag_s"])
    return Row(name=d["name"], net=d["net"], ranks=d["ranks"], predicted_s=d["predicted_s"], common_s=d["common_s"],
               before_s=d["before_s"], simulated_s=d.get("simulated_s", float("nan")), measured_s=d["measured_s"],
               run=run, insitu_s=d.get("insitu_s", float("nan")), insitu_sim_s=d.get("insitu_sim_s", float("nan")),
               layers_s=d.get("layers_s", float("nan")))


def _lag_fraction(run: RunResult) -> float:
    return run.lag_s / max(sum(run.step_s[1:]), 1e-9)


def _run(plan: Plan, inst: Instance, folder: Path, net: Net, args: argparse.Namespace) -> RunResult:
    """One run; a second one when the machine was too busy to hold the devices' pace (the lag is
    reported in the table either way)."""
    run = None
    for attempt in range(2):
        run = run_plan(plan, inst, folder, model=MODEL, steps=args.steps, warmup_steps=3, mode=net.mode,
                       pace=args.pace, nice=args.nice, burst_bytes=args.burst,
                       device_regions=not args.no_device_regions, heartbeat_s=args.heartbeat, op_trace=args.in_situ)
        if _lag_fraction(run) <= args.max_lag:
            break
        print(f"  pace lagged {_lag_fraction(run):.0%} of the run (load {run.load_after:.1f})"
              + ("; running it again" if attempt == 0 else "; keeping this run"))
    assert run is not None
    return run


def report(rows: list[Row], out: Path, png: Path, args: argparse.Namespace, load0: float, wall: float,
           picked: str | None) -> None:
    errs = [abs(r.error) for r in rows]
    lines = ["| plan | ranks | load | measured (s) | evaluate (s) | simulate (s) | evaluate error | "
             "simulate error | in situ: evaluate (s) | in situ: simulate (s) | in situ: evaluate error | "
             "in situ: simulate error | without round trip | layers only: evaluate | step spread | pace lag |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        later = r.run.step_s[3:]
        spread = (max(later) - min(later)) / r.measured_s if later else 0.0
        lines.append(f"| {r.name.replace('|', chr(92) + '|')} | {r.ranks} | {r.run.load_before:.1f} | "
                     f"{r.measured_s:.3f} | {r.predicted_s:.3f} | {r.simulated_s:.3f} | {r.error:+.1%} | "
                     f"{r.error_sim:+.1%} | {r.insitu_s:.3f} | {r.insitu_sim_s:.3f} | {r.error_insitu:+.1%} | "
                     f"{r.error_insitu_sim:+.1%} | {r.before_s:.3f} ({r.error_before:+.1%}) | "
                     f"{r.layers_s:.3f} ({r.relative(r.layers_s):+.1%}) | {spread:.0%} | "
                     f"{_lag_fraction(r.run):.0%} |")
    group = [r for r in rows if r.net == RANK_GROUP]
    tau = kendall_tau([r.common_s for r in group], [r.measured_s for r in group]) if len(group) > 1 else float("nan")
    best_pred = min(group, key=lambda r: r.common_s) if group else None
    best_meas = min(group, key=lambda r: r.measured_s) if group else None
    before = [abs(r.error_before) for r in rows]
    sims = [abs(r.error_sim) for r in rows]
    situ = [abs(r.error_insitu) for r in rows if not math.isnan(r.insitu_s)]
    situ_sim = [abs(r.error_insitu_sim) for r in rows if not math.isnan(r.insitu_sim_s)]
    lay = [abs(r.relative(r.layers_s)) for r in rows if not math.isnan(r.layers_s)]
    summary = [
        f"plans: {len(rows)}; evaluate: median |error| {statistics.median(errs):.1%}, max |error| {max(errs):.1%}; "
        f"simulate: median |error| {statistics.median(sims):.1%}, max |error| {max(sims):.1%} "
        f"(without the round-trip term: median {statistics.median(before):.1%}, max {max(before):.1%})",
        (f"in situ (profile calibrated on steps {args.calibrate_steps} of each run): evaluate median |error| "
         f"{statistics.median(situ):.1%}, max {max(situ):.1%}; simulate median {statistics.median(situ_sim):.1%}, "
         f"max {max(situ_sim):.1%}" if situ else "in situ: not run"),
        (f"fresh profile: pipelined (hgopt profile --pipeline N --pipeline-dp D, shape {args.pipeline_shape}); "
         f"from its layer-by-layer timing alone "
         f"evaluate median |error| {statistics.median(lay):.1%}, max {max(lay):.1%}" if lay
         else "fresh profile: layer by layer (--no-pipelined)"),
        f"rank agreement on {RANK_GROUP} ({len(group)} candidates, predicted from the start-up profile): "
        f"Kendall tau {tau:.2f}; "
        f"best predicted: {best_pred.name if best_pred else '-'}; fastest measured: {best_meas.name if best_meas else '-'}"
        + (f" (best predicted measured {best_pred.measured_s / best_meas.measured_s - 1:+.1%} slower)"
           if best_pred and best_meas and best_pred is not best_meas else ""),
        f"the project's planner on {RANK_GROUP} picks: {picked or '- (no planner available)'}",
        f"load average {load0:.1f} at start, {load_average():.1f} at end; {wall:.0f} s in all; "
        f"pace {args.pace} core per rank, {args.steps} steps per plan (median of the last {args.steps - 3}); "
        f"profiles {'alone' if args.no_tenants else 'with as many paced co-tenants as the plan has ranks'}; "
        f"{'every main-thread CPU second paced' if args.no_device_regions else 'device regions paced, engine bookkeeping host work'}",
    ]
    text = "\n".join(lines + [""] + summary)
    print("\n" + text)
    (out / "table.md").write_text(text + "\n")
    (out / "rows.json").write_text(json.dumps([{"name": r.name, "net": r.net, "ranks": r.ranks,
                                                "predicted_s": r.predicted_s, "common_s": r.common_s,
                                                "before_s": r.before_s, "simulated_s": r.simulated_s,
                                                "measured_s": r.measured_s, "load": r.run.load_before,
                                                "insitu_s": r.insitu_s, "insitu_sim_s": r.insitu_sim_s,
                                                "layers_s": r.layers_s,
                                                "steps_s": r.run.step_s, "lag_s": r.run.lag_s} for r in rows], indent=1))
    scatter(rows, png)
    print(f"scatter plot: {png}")


if __name__ == "__main__":
    sys.exit(main())
