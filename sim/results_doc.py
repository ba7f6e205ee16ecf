"""Writes docs/results.md from the compare JSON files under runs/sim (see sim/run_results.sh)."""

import json
import os

from sim.presets import BASELINES
from sim.report import table

D = "runs/sim"
def load(name):
    p = f"{D}/{name}.json"
    return json.load(open(p)) if os.path.exists(p) else None
def pt(d, label, i=-1):
    return d["policies"][label]["points"][i]
def _pp(a: dict, b: dict, key: str = "slo_attainment") -> str:
    return f"{100 * (a[key] - b[key]):+.1f}"


TRACE_RUNS = (  # (JSON name, short name, what it replays): paper-trace --quick on each workload
    ("paper-trace-quick", "generator", "the built-in BurstGPT-like generator (quiet spells and peaks of 2.5x the mean)"),
    ("paper-trace-burstgpt-quick", "BurstGPT sample", "`tests/data/burstgpt_sample.csv` (8 successful requests)"),
    ("paper-trace-azure-quick", "Azure slice",
     "`tests/data/AzureLLMInferenceTrace_conv_first10min.csv`, the first 10 minutes of the Azure LLM inference "
     "conversation trace (2,867 requests, native 4.78 req/s, a nearly steady rate)"),
    ("paper-trace-azure-code-quick", "Azure code slice",
     "`tests/data/AzureLLMInferenceTrace_code_first10min.csv`, the first 10 minutes of the same trace's code "
     "service (1,482 requests, native 2.53 req/s, in bursts with quiet spells between: long prompts, short answers)"),
)


def _point(data: dict, label: str, point_label: str) -> dict | None:
    return next((p for p in data["policies"][label]["points"] if p["label"] == point_label), None)


def _moves(point: dict) -> str:
    applied = [e for e in point.get("reconfigurations", []) if e["applied"]]
    return str(len(applied))


def _signed(value: float, digits: int = 1) -> str:
    return f"{round(value, digits) + 0.0:+.{digits}f}"  # no "-0.0"


def _lead(d: dict, b: dict) -> str:
    """DiLaServe against one baseline: SLO attainment points, mean latency change, accuracy points."""
    return (f"{_signed(100 * (d['slo_attainment'] - b['slo_attainment']))} pp / "
            f"{_signed(100 * (d['mean_latency_s'] / b['mean_latency_s'] - 1))}% / "
            f"{_signed(100 * (d['accuracy'] - b['accuracy']))}")


def above_capacity(runs: dict) -> str:
    """The paper-trace comparison per workload and load: SLO attainment, latency, accuracy, moves."""
    out = ["## paper-trace above capacity (the paper's Fig. 8 and Section 5.2)\n",
           "The paper replays a 2-hour ShareGPT + BurstGPT trace (63,736 requests, its peak of 20 req/s scaled to "
           "the cluster's capacity) on 16 H100s: DiLaServe +21.1 / +30.2 pp SLO attainment and -34.7 / -46.0% "
           "latency against INFaaS / Llumnix, at a quality loss of 0.09 on a 0-10 judge score; Fig. 8 shows the "
           "trace's rate, DiLaServe's configuration and thresholds, and the three systems' SLO attainment over "
           "time (here: `runs/sim/paper-trace-quick.png` and `runs/sim/paper-trace-azure-quick.png`, at 1.5x). "
           "`paper-trace --quick` replays each workload at mean rates of 0.6, 0.9, 1.2 and 1.5x the nominal "
           "capacity. A trace is replayed whole at every point, its timestamps divided by the point's `scale` "
           "(rate / the trace's native rate, in the trace tables below), so its bursts keep their shape. Only "
           "DiLaServe reconfigures (the baselines keep 16 TP-1); *moves* counts the plans it applied. Workloads:\n"]
    out += [f"- **{short}**: {what}." for name, short, what in TRACE_RUNS if runs.get(name)]
    out += ["",
            "| workload | point | req/s | requests | SLO % DiLaServe / INFaaS / Llumnix | mean latency s | p99 latency s "
            "| accuracy % | moves | DiLaServe vs INFaaS: SLO / mean latency / accuracy | vs Llumnix |",
            "|---|---|---:|---:|---|---|---|---|---:|---|---|"]
    for name, short, _ in TRACE_RUNS:
        data = runs.get(name)
        if not data:
            continue
        for d, trio in _trios(data):
            out.append(
                f"| {short} | {d['label']} | {d['rps']:.2f} | {d['num_requests']} | "
                + " / ".join(f"{100 * p['slo_attainment']:.1f}" for p in trio) + " | "
                + " / ".join(f"{p['mean_latency_s']:.2f}" for p in trio) + " | "
                + " / ".join(f"{p['p99_latency_s']:.2f}" for p in trio) + " | "
                + " / ".join(f"{100 * p['accuracy']:.1f}" for p in trio) + f" | {_moves(d)} | "
                + " | ".join(_lead(d, o) for o in trio[1:]) + " |")
    azure = runs.get("paper-trace-azure-quick")
    top = azure and _point(azure, "dilaserve", "1.5x")
    if top:
        leads = [_point(azure, b, "1.5x") for b in BASELINES]
        slo_ok = all(top["slo_attainment"] - b["slo_attainment"] >= 0.30 for b in leads)
        lat_ok = all(top["mean_latency_s"] <= 0.54 * b["mean_latency_s"] for b in leads)
        acc_ok = all(abs(top["accuracy"] - b["accuracy"]) <= 0.01 for b in leads)
        verdict = "holds" if slo_ok and lat_ok and acc_ok else "does not hold"
        out.append(
            f"\nThe acceptance run (`dls compare --preset paper-trace --quick --trace` the Azure slice; at 1.5x at "
            f"least +30 pp SLO attainment over INFaaS and over Llumnix, mean latency at least 46% lower, accuracy "
            f"within 1 point) {verdict}: against INFaaS {_lead(top, leads[0])} points, against Llumnix "
            f"{_lead(top, leads[1])} points.")
    out.append(
        "\nWhy the gaps above capacity are larger than the paper's: the baselines admit first come, first served "
        "and run every step at 0.9, so once the mean rate exceeds what the cluster serves at 0.9 their queue "
        "grows for the rest of the replay, and their attainment and mean latency depend on how long the replay "
        "lasts; DiLaServe lowers thresholds (mean threshold in the tables) and keeps its queue bounded. The paper's "
        "trace peaks at the cluster's capacity, so its bursts overload only briefly; the nearest regime here is "
        "the generator at 0.6-0.9x, whose peaks reach 1.5-2.25x. The BurstGPT sample holds 8 requests: at any of "
        "these rates they arrive within a second on 16 instances and never queue, so it shows no difference "
        "between the policies; it is there to show that BurstGPT files replay at the point's rate."
        + _reconfiguration_note(runs))
    return "\n".join(out) + "\n"


def _reconfiguration_note(runs: dict) -> str:
    """What DiLaServe's plans did, where the JSON shows a pattern."""
    notes = []
    azure, generator = runs.get("paper-trace-azure-quick"), runs.get("paper-trace-quick")
    if azure:
        loaded = [p for p in azure["policies"]["dilaserve"]["points"] if p["rate_mult"] >= 0.9]
        if loaded and all(_moves(p) == "0" for p in loaded):
            notes.append("on the nearly steady Azure slice DiLaServe keeps 16 TP-1 from 0.9x on (no plan applied)")
    if generator:
        shapes = [e["instances_by_tp"] for p in generator["policies"]["dilaserve"]["points"]
                  for e in p.get("reconfigurations", []) if e["applied"]]
        if {"4": 4} in shapes and {"1": 16} in shapes:
            notes.append("with the generator it moves to 4 TP-4 instances in the quiet spells and back to 16 TP-1 "
                         "at the peaks (the reconfiguration lines under its table)")
    return (" Reconfiguration: " + "; ".join(notes) + ".") if notes else ""


LONG_RUNS = ("paper-bench-long-quick", "ablation-threshold-long-quick", "ablation-predictor-long-quick",
             "paper-bench-long")


def _long_family_at(setup: dict) -> dict | None:
    """The long family's bench figures at the preset's block length (``docs/bench/engine.json``)."""
    engine = json.load(open("docs/bench/engine.json"))
    block = str((setup.get("workload") or {}).get("block_len", ""))
    by_block = engine.get("long_family_by_block", {})
    return by_block.get(block) or engine.get("families", {}).get(engine.get("long_family", "chain"))


def _chain_time_at(profile, chain: dict, tau: str, batch: int) -> tuple[float, float]:
    """A chain request's step time at ``tau`` (batch ``batch``): its recompute and cache parts, seconds.

    One recompute step per block decoded (the dual cache's refresh), the rest cache steps."""
    blocks, steps = chain["mean_blocks"], chain["mean_steps"][tau]
    return blocks * profile.step_latency(1, batch, True), max(0.0, steps - blocks) * profile.step_latency(1, batch, False)


def threshold_reach(setup: dict, batch: int = 16) -> str:
    """How much faster a chain request runs at 0.7 than at 0.9 on the preset's profile, and what bounds it."""
    from shared.profiles import LatencyProfile
    from sim.timing import anchored

    chain = _long_family_at(setup)
    if not chain:
        return ""
    profile = anchored(LatencyProfile.load("profiles/llada-8b-h100.json"), setup["profile_anchor_context_tokens"],
                       setup["step_time_scale"])
    r9, c9 = _chain_time_at(profile, chain, "0.9", batch)
    r7, c7 = _chain_time_at(profile, chain, "0.7", batch)
    return (f"What a lower threshold buys here: in blocks of {chain['block_length']} a chain request takes "
            f"{chain['mean_steps']['0.9']:.1f} steps at 0.9 and {chain['mean_steps']['0.7']:.1f} at 0.7, of which "
            f"{chain['mean_blocks']:.1f} are the dual cache's recompute steps (one per block, whatever the "
            f"threshold); at batch {batch} a recompute step costs "
            f"{profile.step_latency(1, batch, True) / profile.step_latency(1, batch, False):.0f}x a cache step on the "
            f"profile. So a request's step time falls from {r9 + c9:.2f} s to {r7 + c7:.2f} s "
            f"({(r9 + c9) / (r7 + c7):.2f}x, against {chain['mean_steps']['0.9'] / chain['mean_steps']['0.7']:.2f}x "
            f"in steps): at 0.7 the recompute steps are {100 * r7 / (r7 + c7):.0f}% of it.{_other_blocks(profile, chain, batch)}\n")


def _other_blocks(profile, chain: dict, batch: int) -> str:
    """The same figure at the long family's other bench block lengths (fewer refreshes, more reach)."""
    engine = json.load(open("docs/bench/engine.json"))
    out = []
    for block, other in sorted(engine.get("long_family_by_block", {}).items(), key=lambda kv: int(kv[0])):
        if int(block) == chain["block_length"]:
            continue
        r9, c9 = _chain_time_at(profile, other, "0.9", batch)
        r7, c7 = _chain_time_at(profile, other, "0.7", batch)
        out.append(f"in blocks of {block} ({other['mean_blocks']:.1f} blocks per answer) 0.7 buys "
                   f"{(r9 + c9) / (r7 + c7):.2f}x")
    if not out:
        return ""
    return (" On the same profile " + "; ".join(out) + ": the fewer refreshes an answer needs, the more of its "
            "work a threshold acts on, which is why the long presets decode in LLaDA's blocks of 32.")


def long_answers(pbl, abl, pred, full=None) -> str:
    """paper-bench-long: DiLaServe vs the baselines, and the ablations, where answers span many blocks."""
    if not pbl:
        return ""
    setup = pbl.get("setup", {})
    workload = setup.get("workload") or {}
    chain = _long_family_at(setup) or {}
    out = ["## Long answers: paper-bench-long\n",
           "LLaDA's GSM8K setting (256 tokens in blocks of 32, answers ending early at EOS) scaled to the bundled "
           f"model: the `chain` family (35-125 tokens) on a {workload.get('gen_len')}-token canvas in blocks of "
           f"{workload.get('block_len')} ({chain.get('mean_blocks', float('nan')):.1f} blocks per answer on average, "
           "the last one the block that completes its EOS), the dual KV cache (a recompute step at every block "
           "start, cache steps between), 16 TP-1 instances, SLO 5x the isolated latency at 0.9.\n"]
    out.append(f"Candidate thresholds (the 1-point budget on the chain family's curve at this block length, "
               f"`{setup.get('quality_curve_key')}`): {setup.get('candidate_thresholds')}; nominal capacity "
               f"{setup.get('nominal_capacity_rps')} req/s; SLO {setup.get('slo_s')} s.\n")
    out.append("| point | DiLaServe SLO / accuracy / mean threshold | INFaaS | Llumnix | DiLaServe lead (pp vs INFaaS / Llumnix) |")
    out.append("|---|---|---|---|---|")
    for index, d in enumerate(pbl["policies"]["dilaserve"]["points"]):
        i, ll = pt(pbl, "infaas", index), pt(pbl, "llumnix", index)
        out.append(f"| {d['label']} | {100 * d['slo_attainment']:.1f}% / {100 * d['accuracy']:.1f}% / "
                   f"{d.get('mean_threshold', float('nan')):.3f} | {100 * i['slo_attainment']:.1f}% / "
                   f"{100 * i['accuracy']:.1f}% | {100 * ll['slo_attainment']:.1f}% / {100 * ll['accuracy']:.1f}% | "
                   f"{_pp(d, i)} / {_pp(d, ll)} |")
    out.append("")
    top = _point(pbl, "dilaserve", "2.0x")
    if top:
        leads = [_point(pbl, b, "2.0x") for b in BASELINES]
        slo_ok = all(top["slo_attainment"] - b["slo_attainment"] >= 0.40 for b in leads)
        acc_ok = all(abs(top["accuracy"] - b["accuracy"]) <= 0.01 + 1e-9 for b in leads)
        out.append(f"The acceptance run (`dls compare --preset paper-bench-long --quick`; at 2x at least +40 pp over "
                   f"INFaaS and over Llumnix, accuracy within 1 point) {'holds' if slo_ok and acc_ok else 'does not hold'}: "
                   f"{_pp(top, leads[0])} / {_pp(top, leads[1])} pp, accuracy {_pp(top, leads[0], 'accuracy')} / "
                   f"{_pp(top, leads[1], 'accuracy')} points.\n")
    out.append(threshold_reach(setup))
    if abl:
        out.append("Threshold ablation (`ablation-threshold-long --quick`):\n")
        out.append("| point | fixed 0.9 | SLO-aware alone | + load control | load control adds |")
        out.append("|---|---|---|---|---|")
        for index, f_ in enumerate(abl["policies"]["fixed-0.9"]["points"]):
            s_, dl = pt(abl, "dilaserve-no-loadctl", index), pt(abl, "dilaserve", index)
            out.append(f"| {f_['label']} | {100 * f_['slo_attainment']:.1f}% | {100 * s_['slo_attainment']:.1f}% "
                       f"({100 * s_['accuracy']:.1f}% acc., threshold {s_.get('mean_threshold', float('nan')):.3f}) | "
                       f"{100 * dl['slo_attainment']:.1f}% ({100 * dl['accuracy']:.1f}% acc., threshold "
                       f"{dl.get('mean_threshold', float('nan')):.3f}) | {_pp(dl, s_)} pp |")
        out.append("")
        out.append(LOAD_CONTROL_LONG + _load_control_at_top(abl))
    if pred:
        out.append("Predictor ablation (`ablation-predictor-long --quick`): *one-shot* plans every step on "
                   "the predictor's one-shot model (arrival features only), scaled by the tokens left; "
                   "*online* on the latest prediction, refreshed after every step.\n")
        out.append("| point | one-shot | online |\n|---|---|---|")
        for index, o in enumerate(pred["policies"]["dilaserve-oneshot"]["points"]):
            n = pt(pred, "dilaserve", index)
            out.append(f"| {o['label']} | {100 * o['slo_attainment']:.1f}% ({100 * o['accuracy']:.1f}% acc.) | "
                       f"{100 * n['slo_attainment']:.1f}% ({100 * n['accuracy']:.1f}% acc.) |")
        out.append("")
    if full:
        out.append("The full sweep (`paper-bench-long`, 3,000 requests per point) is in the tables below.\n")
    return "\n".join(out) + "\n"


# why load control adds what it adds on the long workload (docs/results.md, "Long answers")
LOAD_CONTROL_LONG = (
    "Why load control adds little here, far from the paper's +42.4 pp: SLO-aware thresholds alone already "
    "respond to the aggregate, because Algorithm 1 re-plans every request at every step with fresh "
    "predictions, the deadline it has left and the batch its instance runs now. Once a queue forms, batches "
    "grow and budgets shrink, so each request drops to the lowest candidate on its own within a few "
    "steps; the mean thresholds of the two columns are nearly equal. What load control still adds is "
    "costing a request's steps at the batch the whole backlog will bring (`load_aware_batch`) while "
    "instances are still filling, which moves a request to 0.7 a few steps earlier. Algorithm 2's caps "
    "rarely bind: they lower the ceiling of thresholds that Algorithm 1 has mostly left already, and the "
    "floor is the quality budget's lowest candidate, 0.7, which no control goes below. Where Algorithm 1 "
    "plans once per request instead, and over all five thresholds, load control has more to do: \"Load "
    "control (Algorithm 2), tested\" below measures it.")


def _load_control_at_top(abl: dict) -> str:
    """What load control adds at the ablation's highest load, from the figures (one sentence)."""
    index = len(abl["policies"]["dilaserve"]["points"]) - 1
    alone, with_ = pt(abl, "dilaserve-no-loadctl", index), pt(abl, "dilaserve", index)
    return (f" At the highest load ({with_['label']}) it adds {_pp(with_, alone)} points "
            f"({100 * alone['slo_attainment']:.1f}% -> {100 * with_['slo_attainment']:.1f}%), at a mean threshold of "
            f"{with_.get('mean_threshold', float('nan')):.3f} against {alone.get('mean_threshold', float('nan')):.3f}.\n")


def _curve_drops(key: str | None, taus: tuple[str, ...]) -> str:
    """'6.5, 13.5 and 34.5 points below 0.9 at 0.7, 0.6 and 0.5' on a quality.json curve."""
    data = json.load(open("models/dls-tiny/calibration/quality.json"))
    curve = data.get("families", {}).get(key) or data.get(key or "accuracy") or data["accuracy"]
    drops = [f"{100 * (curve['0.9'] - curve[t]):.1f}" for t in taus]
    return f"{', '.join(drops[:-1])} and {drops[-1]} points below 0.9 at {', '.join(taus[:-1])} and {taus[-1]}"


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
            "FCFS admission, so their queues grow without bound past 1x; DiLaServe's thresholds drop within its "
            f"candidates {pbq.get('setup', {}).get('candidate_thresholds')} (the 1-point budget on "
            f"`{pbq.get('setup', {}).get('quality_curve_key')}`; mean threshold in the tables), which the model pays "
            "for in accuracy (the difference above). Replay vs "
            f"model in the loop: {fid.get('slo_attainment_gap_pp', float('nan')):.2f} pp SLO attainment, "
            f"{fid.get('mean_latency_gap_pct', float('nan')):.2f}% mean latency at most over the sweep (targets 3 pp / 5%).")
    if full:
        d2 = pt(full, "dilaserve")
        line = (f"- **paper-bench (full, 4,000 requests per point).** At 2x DiLaServe {100 * d2['slo_attainment']:.1f}% "
                f"SLO attainment at {100 * d2['accuracy']:.1f}% accuracy")
        if "dilaserve-all-thresholds" in full["policies"]:
            a2 = pt(full, "dilaserve-all-thresholds")
            drops = _curve_drops(full.get("setup", {}).get("quality_curve_key"), ("0.7", "0.6", "0.5"))
            line += (f"; with all five thresholds (`dilaserve-all-thresholds`) {100 * a2['slo_attainment']:.1f}% at "
                     f"{100 * a2['accuracy']:.1f}%: the thresholds below the budget buy attainment at a cost of "
                     f"accuracy this model makes steep ({drops} on the preset's curve), which is what the quality "
                     "budget keeps out")
        out.append(line + ".")
    if pt_q:
        points = range(len(pt_q["policies"]["dilaserve"]["points"]))
        leads = all(
            pt(pt_q, "dilaserve", i)["slo_attainment"] >= pt(pt_q, other, i)["slo_attainment"]
            and pt(pt_q, "dilaserve", i)["mean_latency_s"] < pt(pt_q, other, i)["mean_latency_s"]
            for i in points for other in ("infaas", "llumnix"))
        verdict = ("at every load DiLaServe is at or above both baselines in SLO attainment and below them in "
                   "mean latency" if leads else "DiLaServe does not lead both baselines at every load")
        top = pt(pt_q, "dilaserve")
        out.append(f"- **paper-trace (quick).** Mean rates 0.6-1.5x the nominal capacity on the BurstGPT-like "
                   f"generator, the BurstGPT sample and the Azure slice: the section below. On the generator: "
                   f"{verdict}; at {top['label']} DiLaServe {100 * top['slo_attainment']:.1f}% against "
                   f"{100 * pt(pt_q, 'infaas')['slo_attainment']:.1f}% / {100 * pt(pt_q, 'llumnix')['slo_attainment']:.1f}%. "
                   "Plans roll out one node at a time (`PlacementPlan.waves`, as the live reconfigurator publishes "
                   "them): applied to every node at once, a quiet-to-peak switch drained the whole cluster at a "
                   "burst's onset and DiLaServe trailed the baselines at the lower load (97.8% vs 100%).")
    if abl:
        f_, s_, dl = pt(abl, "fixed-0.9"), pt(abl, "dilaserve-no-loadctl"), pt(abl, "dilaserve")
        gain = 100 * (dl["slo_attainment"] - s_["slo_attainment"])
        verdict = (f"load control adds {gain:.1f} points over SLO-aware alone" if gain > 0 else
                   "load control is not above SLO-aware alone here")
        out.append(
            f"- **Threshold-control ablation (quick, 2x).** Fixed 0.9 {100 * f_['slo_attainment']:.1f}%, SLO-aware "
            f"thresholds alone {100 * s_['slo_attainment']:.1f}%, with load control {100 * dl['slo_attainment']:.1f}% "
            f"(accuracy {100 * s_['accuracy']:.1f}% and {100 * dl['accuracy']:.1f}%). SLO-aware thresholds are far "
            f"above fixed; {verdict} (the paper: +42.4 pp). Load control reaches the thresholds two ways: "
            "Algorithm 2's cap on each request's allowed maximum, which is what a request's first step runs at "
            "(its threshold is planned from the first step's prediction on: `unpredicted_at_max`), so that under a queue a short answer, written "
            "in its first step, starts below 0.9; and its view of the aggregate reaching Algorithm 1, which costs "
            "a request's steps at the batch an even spread of all active requests (queued included) gives its "
            "instance (`load_aware_batch`). Without load control every first step runs at 0.9 however deep the "
            "queue.")
    out.append(
        "- **Other ablations, sweeps and the capacity search**: the tables below (predictor: online vs one-shot "
        "predictions; migration: none / any step / recompute steps only under Gamma cv 3 arrivals with the dual "
        "cache; cache: paper-bench with the dual cache, where one recompute step per block, which no threshold "
        "removes, dominates the work; input lengths 0-8 shots; capacity at 90% SLO attainment).\n")
    return "\n".join(out) + "\n"


LOADCTL_ROWS = (  # (policy label without the -no-loadctl suffix, Algorithm 1, candidate thresholds)
    ("dilaserve", "every step", "within the budget"),
    ("dilaserve-all-thresholds", "every step", "all five"),
    ("dilaserve-plan-once", "once, at arrival (one-shot prediction)", "within the budget"),
    ("dilaserve-plan-once-all-thresholds", "once, at arrival (one-shot prediction)", "all five"),
)


def _no_loadctl(label: str) -> str:
    return f"{label}-no-loadctl"


def load_control_experiment(short: dict | None, long: dict | None) -> str:
    """What Algorithm 2 adds where Algorithm 1 plans per step or once, within the budget or over all
    five thresholds (the presets ablation-loadctl and ablation-loadctl-long)."""
    runs = [(name, data) for name, data in (("short answers (`ablation-loadctl --quick`)", short),
                                            ("long answers (`ablation-loadctl-long --quick`)", long)) if data]
    if not runs:
        return ""
    out = ["## Load control (Algorithm 2), tested\n",
           "Each cell: SLO attainment without load control -> with it (the difference in points), and the "
           "accuracy with it. *Once*: Algorithm 1 chooses a request's threshold at its first placement from "
           "the predictor's one-shot model (arrival features only) and keeps it (`plan_once`, "
           "`prediction: oneshot`); load control, "
           "when on, still caps it at every step. *Every step*: DiLaServe as it runs. *All five*: the paper's "
           "0.5-0.9 whatever the accuracy costs; *within the budget*: the candidates the 1-point quality "
           "budget keeps.\n"]
    gains = []
    for name, data in runs:
        points = [p["label"] for p in data["policies"]["dilaserve"]["points"]]
        out.append(f"{name}:\n")
        out.append("| Algorithm 1 plans | thresholds | " + " | ".join(points) + " |")
        out.append("|---|---|" + "---|" * len(points))
        for label, plans, thresholds in LOADCTL_ROWS:
            if label not in data["policies"] or _no_loadctl(label) not in data["policies"]:
                continue
            cells = []
            for index in range(len(points)):
                on, off = pt(data, label, index), pt(data, _no_loadctl(label), index)
                gain = 100 * (on["slo_attainment"] - off["slo_attainment"])
                gains.append((gain, name.split(" (")[0], plans, thresholds, points[index]))
                cells.append(f"{100 * off['slo_attainment']:.1f} -> {100 * on['slo_attainment']:.1f}% "
                             f"({_signed(gain)}), acc. {100 * on['accuracy']:.1f}%")
            out.append(f"| {plans} | {thresholds} | " + " | ".join(cells) + " |")
        out.append("")
    best = max(gains)
    per_step = [g for g in gains if g[2] == "every step"]
    once = [g for g in gains if g[2] != "every step"]
    out.append(
        f"What it adds: at most {_signed(best[0])} points ({best[1]}, Algorithm 1 {best[2]}, {best[3]} thresholds, "
        f"{best[4]}). Where Algorithm 1 re-plans every step it adds {min(g[0] for g in per_step):+.1f} to "
        f"{max(g[0] for g in per_step):+.1f} points; where it plans once, {min(g[0] for g in once):+.1f} to "
        f"{max(g[0] for g in once):+.1f}. "
        + ("Load control adds nothing anywhere here. " if best[0] <= 0.5 else "")
        + ("Where Algorithm 1 re-plans every step, a request's threshold already follows the load by itself; "
           "planned once, it does not, and load control's caps are what lower it. "
           if max(g[0] for g in once) > max(g[0] for g in per_step) and max(g[0] for g in per_step) < 5 else "")
        + ("Where it re-plans every step, what load control adds is mostly the first step's threshold (the cap "
           "it runs at before any prediction), which decides a short answer. "
           if max(g[0] for g in per_step) >= 5 else "")
        + ("The paper's +42.4 pp is the gain over Algorithm 1 alone; none of these regimes comes near it.\n"
           if best[0] < 20 else "\n"))
    return "\n".join(out) + "\n"


BREAKDOWN_RUNS = (("paper-bench-quick", "paper-bench"), *((name, short) for name, short, _ in TRACE_RUNS))


def loss_breakdown(runs: dict) -> str:
    """Where each policy's time went at each point: queueing, reconfiguration, migration, and the mean
    threshold it ran at (``breakdown`` in each point of the compare JSON)."""
    out = ["## Where the time goes (loss breakdown)\n",
           "Per request, on average: seconds from arrival to the first step (*queue*), the instance-seconds "
           "plans kept out of service (starting up, draining) spread over the requests (*reconf.*), seconds "
           "its state spent moving (*migr.*); *instance-s*: those instance-seconds over the whole run; *tau*: "
           "the mean threshold of the steps run; *SLO*: the attainment. DiLaServe / INFaaS / Llumnix in each "
           "cell.\n",
           "| workload | point | SLO % | queue s | reconf. s | migr. s | instance-s | tau |",
           "|---|---|---|---|---|---|---|---|"]
    for name, short in BREAKDOWN_RUNS:
        data = runs.get(name)
        if not data or "dilaserve" not in data["policies"]:
            continue
        for d in data["policies"]["dilaserve"]["points"]:
            trio = [d] + [_point(data, b, d["label"]) for b in BASELINES if b in data["policies"]]
            if any(p is None or "breakdown" not in p for p in trio):
                continue
            b = [p["breakdown"] for p in trio]
            out.append(
                f"| {short} | {d['label']} | " + " / ".join(f"{100 * p['slo_attainment']:.1f}" for p in trio)
                + " | " + " / ".join(f"{x['queueing_s']:.2f}" for x in b)
                + " | " + " / ".join(f"{x['reconfiguration_s']:.2f}" for x in b)
                + " | " + " / ".join(f"{x['migration_s']:.3f}" for x in b)
                + " | " + " / ".join(f"{x['reconfiguration_instance_s']:.0f}" for x in b)
                + " | " + " / ".join(f"{x['mean_threshold'] or float('nan'):.3f}" for x in b) + " |")
    out.append("\nPrediction error is not in this breakdown: `python -m bench.predictor` measures it apart "
               "(`by_family`, `by_canvas`, `by_block_index`).\n")
    return "\n".join(out) + "\n"


MEASURED_PROFILE = "profiles/llada-8b-h200-measured.json"
MEASURED_SUFFIX = "-h200"  # a run on the measured profile: the modelled run's JSON name plus this
HEADLINE_RUNS = (  # (modelled run's JSON name, what it is, its top point): each also run on the measured profile
    ("paper-bench-quick", "paper-bench (quick)", "2.0x"),
    ("paper-bench-long-quick", "paper-bench-long (quick)", "2.0x"),
    ("paper-trace-azure-quick", "paper-trace, Azure conversation slice (quick)", "1.5x"),
    ("paper-trace-azure-code-quick", "paper-trace, Azure code slice (quick)", "1.5x"),
)


def _profile_label(data: dict) -> str:
    profile = data["setup"].get("profile") or {"path": "profiles/llada-8b-h100.json", "measured": False,
                                               "derived_tp": []}
    derived = f", TP-{'/'.join(map(str, profile['derived_tp']))} derived" if profile["derived_tp"] else ""
    return f"`{profile['path']}` ({'measured' if profile['measured'] else 'modelled'}{derived})"


def _trios(data: dict):
    """Each DiLaServe point with its trio (DiLaServe, INFaaS, Llumnix) at that label; labels a baseline
    lacks are skipped."""
    for d in data["policies"]["dilaserve"]["points"]:
        others = [_point(data, b, d["label"]) for b in BASELINES]
        if all(o is not None for o in others):
            yield d, (d, *others)


def _ahead_at(data: dict, label: str) -> tuple[bool, str]:
    """Whether DiLaServe's SLO attainment is above both baselines' at ``label``, and by how much."""
    d = _point(data, "dilaserve", label)
    others = [_point(data, b, label) for b in BASELINES]
    if d is None or any(o is None for o in others):
        return False, "no such point"
    ahead = all(d["slo_attainment"] > o["slo_attainment"] for o in others)
    return ahead, " / ".join(_pp(d, o) for o in others) + " pp"


def measured_headlines(load_run) -> str:
    """The headline comparisons on the modelled H100 profile and the measured H200 profile, side by side."""
    pairs = [(name, what, top, load_run(name), load_run(name + MEASURED_SUFFIX)) for name, what, top in HEADLINE_RUNS]
    pairs = [row for row in pairs if row[3] and row[4]]
    if not pairs:
        return ""
    from shared.profiles import LatencyProfile

    measured_1, modelled_1 = (LatencyProfile.load(path).beta(1, 1) * 1000 for path in
                              (MEASURED_PROFILE, "profiles/llada-8b-h100.json"))
    out = ["## The headlines on a measured profile\n",
           f"Every run above is timed by the modelled H100 profile `profiles/llada-8b-h100.json`. These are the "
           f"headline runs again on `{MEASURED_PROFILE}`: LLaDA-8B's shape measured on one H200 (the engine as it was "
           f"then: SDPA per request, no CUDA graphs; a cache step of {measured_1:.1f} ms at batch 1 where the model says "
           f"{modelled_1:.1f}), at TP "
           "1 only, TP 2, 4 and 8 derived from it through the modelled profile's TP model (the trace runs reconfigure "
           "to TP 2 and 4), the cache step at batch 2 "
           "smoothed (`profiles/README.md`). The same commands with `--profile` and the JSON name with "
           f"`{MEASURED_SUFFIX}`. Each row says which profile timed it; SLOs (5x the isolated latency) and nominal "
           "capacities are each profile's own, so a point is the same multiple of each profile's capacity.\n",
           "| run | profile | SLO s | nominal req/s | point | req/s | SLO % DiLaServe / INFaaS / Llumnix | accuracy % "
           "| mean threshold | DiLaServe lead, pp vs INFaaS / Llumnix |",
           "|---|---|---:|---:|---|---:|---|---|---:|---|"]
    verdicts = []
    for _, what, top, modelled, measured in pairs:
        for data in (modelled, measured):
            setup = data["setup"]
            for d, trio in _trios(data):
                out.append(
                    f"| {what} | {_profile_label(data)} | {setup['slo_s']:.2f} | {setup['nominal_capacity_rps']:.1f} | "
                    f"{d['label']} | {d['rps']:.2f} | " + " / ".join(f"{100 * p['slo_attainment']:.1f}" for p in trio)
                    + " | " + " / ".join(f"{100 * p['accuracy']:.1f}" for p in trio)
                    + f" | {d.get('mean_threshold', float('nan')):.3f} | "
                    + " / ".join(_pp(d, o) for o in trio[1:]) + " |")
        cells = []
        for data, which in ((modelled, "modelled"), (measured, "measured")):
            ahead, by = _ahead_at(data, top)
            cells.append(f"{which} {'ahead' if ahead else 'NOT ahead'} ({by})")
        verdicts.append(f"- {what} at {top}: " + "; ".join(cells) + ".")
    out += ["", "DiLaServe against both baselines at each run's top point:\n", *verdicts, ""]
    return "\n".join(out) + "\n"


def multi_model(data: dict | None, fast: dict | None) -> str:
    """The multi-model preset (``sim/multimodel.py``): the GPUs divided between two models whose mix flips."""
    if not data:
        return ""
    setup, top = data["setup"], data["points"][-1]
    names = list(setup["models"])
    out = ["## Several models: multi-model\n",
           f"`dls compare --preset multi-model --quick`: {setup['num_gpus']} GPUs, "
           + ", ".join(f"{n} (SLO {m['slo_s']:.2f} s, switch {m['switch_s']:g} s, shares {m['shares']})"
                       for n, m in setup["models"].items())
           + f", phases of {setup['phase_s'][0]:g} s, reconfiguration every {setup['reconfig_period_s']:g} s, "
             f"at {top['rate_mult']}x the nominal {setup['nominal_capacity_rps']:.1f} req/s "
             f"({top['rps']:.1f} req/s). Best static split in hindsight: {top.get('best_static_split')} "
             f"(splits tried: " + ", ".join(f"{t['split'][names[0]]}:{t['split'][names[1]]} "
                                             f"{100 * t['slo_attainment']:.1f}%" for t in top.get("static_splits", []))
           + ").\n",
           "| policy | SLO % | " + " | ".join(f"{n} SLO % | {n} acc % | {n} after flips (of steady)" for n in names)
           + " | moves |", "|---|---:|" + "---:|---:|---|" * len(names) + "---:|"]
    for label, s in top["policies"].items():
        cells = []
        for n in names:
            f = s["by_model"][n]
            flips = ", ".join("-" if x["of_steady"] is None else f"{x['of_steady']:.2f}" for x in f["after_flips"]["flips"])
            cells.append(f"{100 * f['slo_attainment']:.1f} | {100 * f['accuracy']:.1f} | {flips}")
        out.append(f"| {label} | {100 * s['slo_attainment']:.1f} | " + " | ".join(cells) + f" | {len(s['reconfigurations'])} |")
    h = data["headline"]
    out.append("")
    lead = ", ".join(f"{_signed(h[k])} points over {k.removeprefix('lead_over_').removesuffix('_pp')}"
                     for k in h if k.startswith("lead_over_"))
    gpu = data.get("gpu_hours")
    saving = (" Each model alone on the fewest GPUs reaching the attainment DiLaServe gave it: "
              + ", ".join(f"{n} {p['gpus']}" for n, p in gpu["peak_gpus_by_model"].items())
              + f" GPUs ({gpu['each_model_its_peak']} GPU-hours against {gpu['dilaserve']}: saving "
                f"{100 * gpu['saving']:.0f}%).") if gpu else ""
    out.append(f"DiLaServe's joint division: {lead}.{saving}")
    bridge = {n: m for n, m in h.get("by_model", {}).items() if "pre_flip_thresholds" in m}
    if bridge:
        out.append("\nThe threshold bridge: in the two minutes after each flip, each model's requests inside their SLO "
                   "with thresholds lowered as load control chooses (`dilaserve`) and held at the threshold the "
                   "model ran at in the minute before the flip (`dilaserve-frozen`): "
                   + "; ".join(f"{n} " + ", ".join(
                       f"{100 * a:.1f}% against {100 * b:.1f}% (" + ("not held" if t is None else f"ran at {t:.2f} before, held at {round(t, 1):.1f}") + ")"
                       for a, b, t in zip(m["after_flips"], m["after_flips_thresholds_held"], m["pre_flip_thresholds"],
                                          strict=False)) for n, m in bridge.items()) + ".")
    if fast:
        f_top = fast["points"][-1]["policies"]
        out.append("\nWith a switch of "
                   f"{next(iter(fast['setup']['models'].values()))['switch_s']:g} s (both models' weights resident, "
                   "a switch is a drain: `--switch-s`): "
                   + ", ".join(f"{label} {100 * s['slo_attainment']:.1f}%" for label, s in f_top.items()) + ".")
    out.append("")
    return "\n".join(out)


ACCEPTANCE_RUNS = (  # (JSON name, what it is): every preset at quick size, DiLaServe against both baselines
    ("paper-bench-quick", "paper-bench"), ("paper-bench-long-quick", "paper-bench-long"),
    ("ablation-threshold-quick", "ablation-threshold"), ("ablation-loadctl-quick", "ablation-loadctl"),
    ("ablation-predictor-quick", "ablation-predictor"), ("ablation-migration-quick", "ablation-migration"),
    ("ablation-cache-quick", "ablation-cache"), ("ablation-threshold-long-quick", "ablation-threshold-long"),
    ("ablation-loadctl-long-quick", "ablation-loadctl-long"), ("ablation-predictor-long-quick", "ablation-predictor-long"),
    ("paper-trace-azure-quick", "paper-trace, Azure conversation slice"),
    ("paper-trace-azure-code-quick", "paper-trace, Azure code slice"), ("mixed-slo-quick", "mixed-slo"),
    ("sweep-input-quick", "sweep-input"),
)
TOP_LEAD_PP = 5.0  # DiLaServe's lead at a preset's top point over the better baseline
ACCURACY_PP = 1.0  # the accuracy it may give up against either


def gaps(result: dict) -> dict[str, tuple[float, float]]:
    """Per point label of a compare JSON: (DiLaServe's SLO attainment minus the better baseline's, the
    better baseline's accuracy minus DiLaServe's), both in points (``every_preset`` and ``bench.guard``)."""
    points = {label: {p["label"]: p for p in result["policies"][label]["points"]} for label in ("dilaserve", *BASELINES)}
    out = {}
    for label, point in points["dilaserve"].items():
        base = [points[b][label] for b in BASELINES]
        out[label] = (100 * (point["slo_attainment"] - max(b["slo_attainment"] for b in base)),
                      100 * (max(b["accuracy"] for b in base) - point["accuracy"]))
    return out


def every_preset(load_run) -> str:
    """DiLaServe against the better of INFaaS and Llumnix at every point of every preset: at or above
    both everywhere, at least ``TOP_LEAD_PP`` ahead at the top point, accuracy within ``ACCURACY_PP``."""
    out = ["## Every preset against both baselines\n",
           f"`dls compare --quick` on every preset (the commands above). Per point: SLO attainment (accuracy) "
           f"of DiLaServe and of each baseline, and DiLaServe's lead over the better one. A preset holds when "
           f"DiLaServe is at or above both baselines at every point, at least {TOP_LEAD_PP:g} points ahead at the "
           f"top point, at accuracy within {ACCURACY_PP:g} point of each.\n",
           "| preset | point | DiLaServe | INFaaS | Llumnix | lead, pp | holds |", "|---|---|---|---|---|---:|---|"]
    missing = []
    for name, what in ACCEPTANCE_RUNS:
        data = load_run(name)
        if not data or not all(k in data["policies"] for k in ("dilaserve", *BASELINES)):
            missing.append(name)
            continue
        points = data["policies"]["dilaserve"]["points"]
        by_point = gaps(data)
        for n, d in enumerate(points):
            base = [_point(data, b, d["label"]) for b in BASELINES]
            lead, acc = by_point[d["label"]]
            need = TOP_LEAD_PP if n == len(points) - 1 else 0.0
            verdict = "yes" if lead >= need - 1e-9 and acc <= ACCURACY_PP + 1e-9 else (
                "no: accuracy" if lead >= need - 1e-9 else "no: behind" if lead < 0 else f"no: lead under {need:g}")
            cells = [f"{100 * x['slo_attainment']:.1f} ({100 * x['accuracy']:.1f})" for x in (d, *base)]
            out.append(f"| {what if n == 0 else ''} | {d['label']} | {' | '.join(cells)} | {_signed(lead)} | {verdict} |")
    if missing:
        out.append(f"\nNot run (or without both baselines): {', '.join(missing)}.")
    return "\n".join(out) + "\n"


def main() -> None:
    pbq = load("paper-bench-quick")
    out = []
    w = out.append
    w("# Simulator results\n")
    w("Produced by `sim/run_results.sh` (commands below) on a 2-core CPU machine shared with other jobs, with "
      "the bundled model `models/dls-tiny` (its model card; each JSON's `setup.model_key` names the weights' digest; "
      "its replay trace was recorded from them), its step predictor (`models/dls-tiny/calibration/predictor`; `--prediction auto` found it), "
      "and the modelled H100 profile `profiles/llada-8b-h100.json` (the headline runs also on the profile measured on "
      "an H200: \"The headlines on a measured profile\"). The `paper-bench` and `paper-trace` tables "
      "are from the `--quick` sizes (the acceptance runs); `paper-bench` also from the full size (replay only); "
      "ablations from `--quick`. DiLaServe's candidate thresholds are the paper's 0.5-0.9 within a 1-point "
      "quality budget on the model's measured curve (`sim/README.md`; each JSON's `setup.candidate_thresholds`); "
      "`dilaserve-all-thresholds` runs all five. The simulator runs the live step loop: overlap and step "
      "pipelining on (`setup.pipelining`, `setup.overlap`).\n")
    w("How virtual time, SLOs and capacities are made, and why `paper-bench` runs without a KV cache, is in "
      "`sim/README.md`. In short: SLO = 5x the isolated TP-1 latency at 0.9 "
      f"({pbq['setup']['slo_s']:.2f} s for paper-bench); the *nominal capacity* "
      f"({pbq['setup']['nominal_capacity_rps']:.1f} req/s for 16 TP-1) is the fixed-0.9 throughput with every "
      "request inside the SLO; rates are multiples of it; each bundled-model step is timed as "
      f"{pbq['setup']['step_time_scale']:.1f} LLaDA-8B steps (80 over the model's steps per request at 0.9).\n")
    w("## Commands\n\n```\n" + open("sim/run_results.sh").read().split("set -x\n")[1] + "```\n")
    w("Figures: `runs/sim/paper-bench-quick.png`, `runs/sim/paper-bench.png` (Fig. 9 style: SLO attainment, "
      "accuracy and mean threshold against request rate), `runs/sim/paper-trace-quick.png` and "
      "`runs/sim/paper-trace-azure-quick.png` (Fig. 8 style, at the 1.5x point: arrivals, DiLaServe's configuration, "
      "thresholds and SLO attainment over time), "
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
    runs = {name: load(name) for name, _, _ in TRACE_RUNS}
    trace_cells = {"slo": [], "latency": [], "quality": []}
    for name, what, point_label in (("paper-trace-azure-quick", "Azure slice", "1.5x"),
                                    ("paper-trace-quick", "generator", "1.5x"),
                                    ("paper-trace-quick", "generator", "0.9x")):
        a = runs[name] and _point(runs[name], "dilaserve", point_label)
        if not a:
            continue
        b, c = _point(runs[name], "infaas", point_label), _point(runs[name], "llumnix", point_label)
        where = f"{what} at {point_label}"
        trace_cells["slo"].append(f"{_pp(a, b)} / {_pp(a, c)} pp ({where})")
        trace_cells["latency"].append(f"{100*(a['mean_latency_s']/b['mean_latency_s']-1):.1f} / "
                                      f"{100*(a['mean_latency_s']/c['mean_latency_s']-1):.1f} % ({where})")
        trace_cells["quality"].append(f"{_signed(100 * (a['accuracy'] - b['accuracy']))} / "
                                      f"{_signed(100 * (a['accuracy'] - c['accuracy']))} points of accuracy ({where})")
    if trace_cells["slo"]:
        w(f"| trace: SLO attainment vs INFaaS / Llumnix | +21.1 / +30.2 pp | {'; '.join(trace_cells['slo'])} (paper-trace quick; below) |")
        w(f"| trace: mean latency vs INFaaS / Llumnix | -34.7 / -46.0 % | {'; '.join(trace_cells['latency'])} |")
        w(f"| trace: quality vs INFaaS / Llumnix | -0.09 (judge score, 0-10) | {'; '.join(trace_cells['quality'])} |")
    abl = load("ablation-threshold-quick")
    if abl:
        f_, s_, dl = pt(abl, "fixed-0.9"), pt(abl, "dilaserve-no-loadctl"), pt(abl, "dilaserve")
        w(f"| dynamic threshold vs fixed | +70.8 pp | {100*(s_['slo_attainment']-f_['slo_attainment']):+.1f} pp at 2x (quick) |")
        w(f"| + load control | +42.4 pp | {100*(dl['slo_attainment']-s_['slo_attainment']):+.1f} pp at 2x (quick) |")
    pbl, abl_long = load("paper-bench-long-quick"), load("ablation-threshold-long-quick")
    top = pbl and _point(pbl, "dilaserve", "2.0x")
    if top:
        i3, l3 = _point(pbl, "infaas", "2.0x"), _point(pbl, "llumnix", "2.0x")
        w(f"| long answers: SLO attainment vs INFaaS / Llumnix at high load | +55 / +56.6 pp | {_pp(top, i3)} / "
          f"{_pp(top, l3)} pp at 2x, accuracy {_pp(top, i3, 'accuracy')} / {_pp(top, l3, 'accuracy')} points "
          "(paper-bench-long quick; \"Long answers\" below) |")
    if abl_long:
        rows = [(p_["label"], _pp(p_, pt(abl_long, "dilaserve-no-loadctl", n)), _pp(pt(abl_long, "dilaserve-no-loadctl", n),
                                                                                 pt(abl_long, "fixed-0.9", n)))
                for n, p_ in enumerate(abl_long["policies"]["dilaserve"]["points"])]
        w(f"| long answers: dynamic threshold vs fixed; + load control | +70.8; +42.4 pp | "
          f"{'; '.join(f'{fixed} pp; {lc} pp at {label}' for label, lc, fixed in rows)} (ablation-threshold-long quick) |")
    w("")
    w(every_preset(load))
    w(narrative(pbq, full, pt_q, abl))
    w(long_answers(*(load(name) for name in LONG_RUNS)))
    w(load_control_experiment(load("ablation-loadctl-quick"), load("ablation-loadctl-long-quick")))
    w(above_capacity(runs))
    w(measured_headlines(load))
    w(loss_breakdown({**runs, "paper-bench-quick": pbq}))
    w(multi_model(load("multi-model-quick"), load("multi-model-quick-switch2")))
    w("## Tables\n")
    for name in ("paper-bench-quick", "paper-bench", *LONG_RUNS, *(n for n, _, _ in TRACE_RUNS), "ablation-threshold-quick",
                 "ablation-loadctl-quick", "ablation-loadctl-long-quick", "ablation-predictor-quick", "ablation-migration-quick", "ablation-cache-quick", "mixed-slo-quick", "sweep-input-quick",
                 *(n + MEASURED_SUFFIX for n, _, _ in HEADLINE_RUNS)):
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
