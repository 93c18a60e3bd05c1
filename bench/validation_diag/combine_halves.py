"""Diagnostics: one table of several runs of bench/validation_diag/validate_halves.sh (OUT-a, OUT-b each):
per plan measured, evaluate, simulate, layers-only and in-situ errors per run, then median / max per run.
  python bench/validation_diag/combine_halves.py /tmp/v3/r1 /tmp/v3/r2 ...
"""
import json, sys, statistics
runs = sys.argv[1:]
def rows(tag):
    out = []
    for h in "ab":
        try: out += json.load(open(f"{tag}-{h}/rows.json"))
        except FileNotFoundError: pass
    return out
hdr = "| plan | ranks | " + " | ".join(f"{t}: load | {t}: measured (s) | {t}: evaluate (s) / error | {t}: simulate (s) / error | {t}: layers only: evaluate error | {t}: in situ: evaluate / simulate error" for t in runs) + " |"
print(hdr); print("|---|---:|" + "---:|" * (6 * len(runs)))
R = {t: {r["name"]: r for r in rows(t)} for t in runs}
names = [r["name"] for r in rows(runs[0])]
e = lambda p, m: (p - m) / m
for n in names:
    cells = []
    for t in runs:
        r = R[t].get(n)
        if r is None: cells.append(" | ".join(["-"] * 6)); continue
        m = r["measured_s"]
        cells.append(f"{r['load']:.1f} | {m:.3f} | {r['predicted_s']:.3f} / {e(r['predicted_s'], m):+.1%} | {r['simulated_s']:.3f} / {e(r['simulated_s'], m):+.1%} | {e(r['layers_s'], m):+.1%} | {e(r['insitu_s'], m):+.1%} / {e(r['insitu_sim_s'], m):+.1%}")
    print(f"| {n.replace('|', chr(92) + '|')} | {R[runs[0]][n]['ranks']} | " + " | ".join(cells) + " |")
print()
print("| run | plans | load | evaluate median / max | simulate median / max | layers only: evaluate median / max | in situ: evaluate median / max | in situ: simulate median / max |")
print("|---|---:|---|---|---|---|---|---|")
for t in runs:
    rs = rows(t)
    def mm(key):
        xs = [abs(e(r[key], r["measured_s"])) for r in rs]
        return f"{statistics.median(xs):.1%} / {max(xs):.1%}"
    loads = [r["load"] for r in rs]
    print(f"| {t} | {len(rs)} | {min(loads):.0f}–{max(loads):.0f} | {mm('predicted_s')} | {mm('simulated_s')} | {mm('layers_s')} | {mm('insitu_s')} | {mm('insitu_sim_s')} |")
