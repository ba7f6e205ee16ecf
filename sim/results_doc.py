"""Writes docs/results.md from the compare JSON files under runs/sim (see sim/run_results.sh)."""

import json
import os

from sim.report import table

D = "runs/sim"
def load(name):
    p = f"{D}/{name}.json"
    return json.load(open(p)) if os.path.exists(p) else None
def pt(d, label, i=-1):
    return d["policies"][label]["points"][i]
def _pp(a: dict, b: dict, key: str = "slo_attainment") -> str:
    return f"{100 * (a[key] - b[key]):+.1f}"


def narrative(pbq, full, pt_q, abl) -> str:
    """What the numbers say, computed from the JSON where it can be (so it cannot go stale)."""
    out = ["## What the numbers say\n"]
    if pbq:
        d, i, ll = pt(pbq, "dilaserve"), pt(pbq, "infaas"), pt(pbq, "llumnix")
        fid = pbq.get("fidelity") or {}
        out.append(
            f"- **paper-bench (quick).** At {d['rate_mult']}x the nominal capacity DiLaServe keeps "
            f"{100 * d['slo_attainment']:.1f}% of requests inside the SLO, INFaaS {100 * i['slo_attainment']:.1f}% and "
            f"Llumnix {100 * ll['slo_attainment']:.1f}% ({_pp(d, i)} / {_pp(d, ll)} points; the acceptance asks for "
            f"+40), at {100 * d['accuracy']:.1f}% accuracy against {100 * i['accuracy']:.1f}% "
            f"({_pp(d, i, 'accuracy')} points; the acceptance allows -1.5). The baselines run every step at 0.9 with "
            "FCFS admission, so their queues grow without bound past 1x; DiLaServe's thresholds drop to 0.7-0.8 "
            "(mean threshold in the tables), which the stage-4 model pays for with about a point of accuracy. Replay vs "
            f"model in the loop: {fid.get('slo_attainment_gap_pp', float('nan')):.2f} pp SLO attainment, "
            f"{fid.get('mean_latency_gap_pct', float('nan')):.2f}% mean latency at most over the sweep (targets 3 pp / 5%).")
    if full:
        d2 = pt(full, "dilaserve")
        line = (f"- **paper-bench (full, 4,000 requests per point).** At 2x DiLaServe {100 * d2['slo_attainment']:.1f}% "
                f"SLO attainment at {100 * d2['accuracy']:.1f}% accuracy")
        if "dilaserve-all-thresholds" in full["policies"]:
            a2 = pt(full, "dilaserve-all-thresholds")
            line += (f"; with all five thresholds (`dilaserve-all-thresholds`) {100 * a2['slo_attainment']:.1f}% at "
                     f"{100 * a2['accuracy']:.1f}%: 0.6 and 0.5 buy a little more attainment at a cost of accuracy this "
                     "model makes steep (15 and 29 points on its own curve), which is what the quality budget keeps out")
        out.append(line + ".")
    if pt_q:
        lines = []
        for point in range(len(pt_q["policies"]["dilaserve"]["points"])):
            a, b, c = (pt(pt_q, name, point) for name in ("dilaserve", "infaas", "llumnix"))
            lines.append(f"at {a['label']} DiLaServe {100 * a['slo_attainment']:.1f}% / {a['mean_latency_s']:.2f} s mean "
                         f"latency, INFaaS {100 * b['slo_attainment']:.1f}% / {b['mean_latency_s']:.2f} s, Llumnix "
                         f"{100 * c['slo_attainment']:.1f}% / {c['mean_latency_s']:.2f} s")
        points = range(len(pt_q["policies"]["dilaserve"]["points"]))
        leads = all(
            pt(pt_q, "dilaserve", i)["slo_attainment"] >= pt(pt_q, other, i)["slo_attainment"]
            and pt(pt_q, "dilaserve", i)["mean_latency_s"] < pt(pt_q, other, i)["mean_latency_s"]
            for i in points for other in ("infaas", "llumnix"))
        verdict = ("At every load DiLaServe is at or above both baselines in SLO attainment and below them in "
                   "mean latency" if leads else "DiLaServe does not lead both baselines at every load")
        out.append("- **paper-trace (quick).** " + "; ".join(lines) + ". The reconfigurator moves DiLaServe's "
                   "cluster to fewer, larger TP instances in the quiet phases and back to TP-1 at the peaks (the "
                   f"reconfiguration lines under the table). {verdict}. Plans roll out one node at a time "
                   "(`PlacementPlan.waves`, as the live reconfigurator publishes them): applied to every node at "
                   "once, a quiet-to-peak switch drained the whole cluster at a burst's onset and DiLaServe "
                   "trailed the baselines at the lower load (97.8% vs 100%, docs/notes.md).")
    if abl:
        f_, s_, dl = pt(abl, "fixed-0.9"), pt(abl, "dilaserve-no-loadctl"), pt(abl, "dilaserve")
        gain = 100 * (dl["slo_attainment"] - s_["slo_attainment"])
        verdict = (f"load control adds {gain:.1f} points over SLO-aware alone" if gain > 0 else
                   "load control is not above SLO-aware alone here")
        out.append(
            f"- **Threshold-control ablation (quick, 2x).** Fixed 0.9 {100 * f_['slo_attainment']:.1f}%, SLO-aware "
            f"thresholds alone {100 * s_['slo_attainment']:.1f}%, with load control {100 * dl['slo_attainment']:.1f}% "
            f"(accuracy {100 * s_['accuracy']:.1f}% and {100 * dl['accuracy']:.1f}%). SLO-aware thresholds are far "
            f"above fixed; {verdict} (the paper: +42.4 pp). What load control contributes here is its view of "
            "the aggregate reaching Algorithm 1: a request's steps are costed at the batch an even spread of all "
            "active requests (queued included) gives its instance, not at the batch of the moment "
            "(`load_aware_batch`), so requests on an emptier instance, or arriving while a queue forms, do not "
            "plan at a threshold the coming batches will not allow. Algorithm 2's threshold caps themselves bind "
            "rarely: they compare the active requests' worst-case work with a whole SLO window of capacity, and "
            "with thresholds 0.7-0.9 Algorithm 1 has usually dropped to 0.7 before the backlog exceeds a window.")
    out.append(
        "- **Other ablations, sweeps and the capacity search**: the tables below (predictor: online vs one-shot "
        "predictions; migration: none / any step / recompute steps only under Gamma cv 3 arrivals with the dual "
        "cache; cache: paper-bench with the dual cache, where one recompute step per block, which no threshold "
        "removes, dominates the work; input lengths 0-8 shots; capacity at 90% SLO attainment).\n")
    return "\n".join(out) + "\n"


def main() -> None:
    pbq = load("paper-bench-quick")
    out = []
    w = out.append
    w("# Simulator results\n")
    w("Produced by `sim/run_results.sh` (commands below) on this machine (2 shared CPU cores), with the "
      "bundled model `models/dls-tiny` at stage 4 (each JSON's `setup.model_key` names the weights' digest; "
      "its replay trace was recorded from them), the step predictor of issue 4 (`--prediction auto` found it), "
      "and the modelled H100 profile `profiles/llada-8b-h100.json`. The `paper-bench` and `paper-trace` tables "
      "are from the `--quick` sizes (the acceptance runs); `paper-bench` also from the full size (replay only); "
      "ablations from `--quick`. DiLaServe's candidate thresholds are the paper's 0.5-0.9 within a 1-point "
      "quality budget on the model's measured curve (`sim/README.md`): 0.7, 0.8, 0.9 for this model; "
      "`dilaserve-all-thresholds` runs all five.\n")
    w("How virtual time, SLOs and capacities are made, and why `paper-bench` runs without a KV cache, is in "
      "`sim/README.md`. In short: SLO = 5x the isolated TP-1 latency at 0.9 (6.49 s); the *nominal capacity* "
      "(15.4 req/s for 16 TP-1) is the fixed-0.9 throughput with every request inside the SLO; rates are "
      "multiples of it; each bundled-model step is timed as ~10 LLaDA-8B steps.\n")
    w("## Commands\n\n```\n" + open("sim/run_results.sh").read().split("set -x\n")[1] + "```\n")
    w("Figures: `runs/sim/paper-bench-quick.png`, `runs/sim/paper-bench.png` (Fig. 9 style: SLO attainment, "
      "accuracy and mean threshold against request rate), `runs/sim/paper-trace-quick.png` (Fig. 8 style: "
      "arrivals, DiLaServe's configuration, thresholds and SLO attainment over time), "
      "`runs/sim/ablation-threshold-quick.png` (Fig. 10 style). The figures and JSON files are run outputs "
      "(not committed); regenerate them with the commands above.\n")
    # side by side
    d, i, ll = pt(pbq, "dilaserve"), pt(pbq, "infaas"), pt(pbq, "llumnix")
    w("## Side by side with the paper\n")
    w("| claim | paper (LLaDA-8B, 16 H100) | here (bundled model, modelled H100, simulated) |\n|---|---|---|")
    w(f"| SLO attainment vs INFaaS at high load | +55 pp | +{100*(d['slo_attainment']-i['slo_attainment']):.1f} pp at 2x nominal capacity (quick, replay) |")
    w(f"| SLO attainment vs Llumnix at high load | +56.6 pp | +{100*(d['slo_attainment']-ll['slo_attainment']):.1f} pp |")
    w(f"| accuracy loss at high load | 0.7 / 0.9 % | {100*(i['accuracy']-d['accuracy']):.1f} / {100*(ll['accuracy']-d['accuracy']):.1f} points (replay); model in the loop: see the fidelity table |")
    fid = pbq.get("fidelity")
    if fid:
        w(f"| simulator fidelity | (Vidur: <9% latency error) | replay vs model in the loop: {fid['slo_attainment_gap_pp']:.2f} pp SLO, {fid['mean_latency_gap_pct']:.2f}% mean latency (largest over the quick sweep) |")
    full = load("paper-bench")
    if full:
        d2, i2, l2 = pt(full, "dilaserve"), pt(full, "infaas"), pt(full, "llumnix")
        w(f"| same, full paper-bench (4,000 requests per point) | +55 / +56.6 pp, 0.7 / 0.9 % | +{100*(d2['slo_attainment']-i2['slo_attainment']):.1f} / +{100*(d2['slo_attainment']-l2['slo_attainment']):.1f} pp, accuracy -{100*(i2['accuracy']-d2['accuracy']):.1f} / -{100*(l2['accuracy']-d2['accuracy']):.1f} points |")
    pt_q = load("paper-trace-quick")
    if pt_q:
        a, b, c = pt(pt_q, "dilaserve"), pt(pt_q, "infaas"), pt(pt_q, "llumnix")
        w(f"| real trace: SLO attainment vs INFaaS / Llumnix | +21.1 / +30.2 pp | +{100*(a['slo_attainment']-b['slo_attainment']):.1f} / +{100*(a['slo_attainment']-c['slo_attainment']):.1f} pp (BurstGPT-like, mean 0.9x capacity) |")
        w(f"| real trace: latency vs INFaaS / Llumnix | -34.7 / -46.0 % | {100*(a['mean_latency_s']/b['mean_latency_s']-1):.1f} / {100*(a['mean_latency_s']/c['mean_latency_s']-1):.1f} % mean latency |")
    abl = load("ablation-threshold-quick")
    if abl:
        f_, s_, dl = pt(abl, "fixed-0.9"), pt(abl, "dilaserve-no-loadctl"), pt(abl, "dilaserve")
        w(f"| dynamic threshold vs fixed | +70.8 pp | {100*(s_['slo_attainment']-f_['slo_attainment']):+.1f} pp at 2x (quick) |")
        w(f"| + load control | +42.4 pp | {100*(dl['slo_attainment']-s_['slo_attainment']):+.1f} pp at 2x (quick) |")
    w("")
    w(narrative(pbq, full, pt_q, abl))
    w("## Tables\n")
    for name in ("paper-bench-quick", "paper-bench", "paper-trace-quick", "ablation-threshold-quick",
                 "ablation-predictor-quick", "ablation-migration-quick", "ablation-cache-quick", "sweep-input-quick"):
        data = load(name)
        if data:
            w(f"### {name}\n")
            w(table(data) + "\n")
            if name.startswith("paper-trace"):
                for label, entry in data["policies"].items():
                    for p in entry["points"]:
                        applied = [e for e in p.get("reconfigurations", []) if e["applied"]]
                        if applied:
                            w(f"Reconfigurations ({label}, {p['label']}): " + "; ".join(
                                f"t={e['time_s']:.0f}s -> {e['instances_by_tp']}" for e in applied) + "\n")
    cap = [load("capacity-dilaserve"), load("capacity-infaas")]
    if all(cap):
        w("### capacity (paper-bench --quick, target 90% SLO attainment)\n")
        w("| policy | max req/s | x nominal |\n|---|---:|---:|")
        for c in cap:
            w(f"| {c['policy']} | {c['max_rps']:.2f} | {c['max_rate_mult']:.3f} |")
        w("")
    open("docs/results.md", "w").write("\n".join(out))
    print("written")



if __name__ == "__main__":
    main()
