"""The report of `tidespec bench sequence`: the goals of per-class drafts and replay as figures
(`summarize`) and the markdown + JSON (`write_report`)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .adapt_report import ratio_spread

FORGETTING_GOAL = 0.02  # forgetting ≤ 2 % on every class after the sequence
GENERALIST_GOAL = 0.05  # the generalist within 5 % of the best class draft on every class
STATIC_GOAL = 1.25  # adapted / well-trained static tokens/s (Aurora, arXiv 2602.06932: 1.25× under shift)
IN_DOMAIN_GOAL = 1.10  # adapted / in-domain static ("train once on your own traffic") tokens/s
CODE_GOAL = 2.0  # code at c = 1 against no speculation


def forgetting(points: list[dict], classes: list[str]) -> dict[str, dict]:
    """Per class: best τ over the points from the cycle its class was first served (cycle 0 counts for
    none), τ after the last cycle, forgetting = (best − last) / best (≥ 0), and, when the points carry
    τ's standard error (`tau_se`), `noise`: 2 standard errors of best − last over best, the two points
    taken as independent (`stats.tau_standard_error`; a drop below it is inside the measurement's
    noise), else None."""
    out = {}
    for w in classes:
        first = next((p["cycle"] for p in points if p["phase"] == w), None)
        pts = [p for p in points if first is not None and p["cycle"] >= first and p["tau"].get(w)]
        if not pts:
            continue
        top = max(pts, key=lambda p: p["tau"][w])
        best, last = top["tau"][w], pts[-1]["tau"][w]
        ses = [p.get("tau_se", {}).get(w) for p in (top, pts[-1])]
        noise = 2 * math.hypot(*ses) / best if all(s is not None for s in ses) else None
        out[w] = {"best": best, "last": last, "forgetting": (best - last) / best, "noise": noise}
    return out


def summarize(rep: dict) -> dict:
    """Forgetting per class and arm; class draft vs generalist τ on each class (classes arm, last point);
    tokens/s ratios per concurrency (paired median and range over passes): classes / static, classes /
    none, single / static, with in-domain statics measured classes / in_domain and single / in_domain,
    draft for draft (both at fixed k, when measured) classes_drafts / static and / in_domain, and code
    at c = 1 / none; outputs == target-only."""
    classes = list(dict.fromkeys(rep["config"]["sequence"]))
    s: dict = {"forgetting": {a: forgetting(arm["points"], classes) for a, arm in rep["arms"].items()}}
    last = rep["arms"]["classes"]["points"][-1]
    s["class_vs_generalist"] = {w: {"class": last["tau"].get(w), "generalist": last["tau_generalist"].get(w),
                                    "served_by": last["versions"].get(w, last["versions"].get(""))}
                                for w in classes}
    best = {w: max(v for v in (x["class"], x["generalist"]) if v) for w, x in s["class_vs_generalist"].items()
            if x["class"] or x["generalist"]}
    s["generalist_gap"] = {w: 1 - (s["class_vs_generalist"][w]["generalist"] or 0) / b for w, b in best.items()}
    tp = rep.get("throughput", {})
    pooled = tp.get("pooled", {})
    pairs = [("classes/static", ("classes", "static")), ("classes/none", ("classes", "none")),
             ("single/static", ("single", "static"))]
    if any("in_domain" in by for by in pooled.values()):
        pairs += [("classes/in_domain", ("classes", "in_domain")), ("single/in_domain", ("single", "in_domain"))]
    if any("classes_drafts" in by for by in pooled.values()):  # draft for draft: both at fixed k
        pairs += [("classes_drafts/static", ("classes_drafts", "static"))] + (
            [("classes_drafts/in_domain", ("classes_drafts", "in_domain"))]
            if any("in_domain" in by for by in pooled.values()) else [])
    s["ratios"] = {name: {str(c): ratio_spread({c: by}, num, den)[c] for c, by in pooled.items()}
                   for name, (num, den) in pairs}
    code = tp.get("code", {})
    s["code_c1_over_none"] = ratio_spread(code, "classes", "none").get(1) if code else None
    s["mismatches"] = (sum(p["mismatches"] for arm in rep["arms"].values() for p in arm["points"])
                       + sum(r["mismatches"] for part in tp.values() for by in part.values() for r in by.values()))
    f = s["forgetting"].get("classes", {})
    s["goals"] = {
        "forgetting_le_2pct": all(x["forgetting"] <= FORGETTING_GOAL for x in f.values()) if f else None,
        "forgetting_inside_noise": all(x["forgetting"] <= x["noise"] for x in f.values())
        if f and all(x["noise"] is not None for x in f.values()) else None,
        "class_ge_generalist": all((x["class"] or 0) >= (x["generalist"] or 0)
                                   for x in s["class_vs_generalist"].values()),
        "generalist_within_5pct": all(g <= GENERALIST_GOAL for g in s["generalist_gap"].values()),
        "code_c1_ge_2x": None if s["code_c1_over_none"] is None else s["code_c1_over_none"][0] >= CODE_GOAL,
        "classes_over_static_ge_1_25": all(r[0] >= STATIC_GOAL for r in s["ratios"]["classes/static"].values())
        if pooled else None,
        "classes_over_in_domain_ge_1_10": all(r[0] >= IN_DOMAIN_GOAL
                                              for r in s["ratios"]["classes/in_domain"].values())
        if "classes/in_domain" in s["ratios"] else None,
        "drafts_over_static_ge_1_25": all(r[0] >= STATIC_GOAL for r in s["ratios"]["classes_drafts/static"].values())
        if "classes_drafts/static" in s["ratios"] else None,
        "drafts_over_in_domain_ge_1_10": all(r[0] >= IN_DOMAIN_GOAL
                                             for r in s["ratios"]["classes_drafts/in_domain"].values())
        if "classes_drafts/in_domain" in s["ratios"] else None,
        "lossless": s["mismatches"] == 0}
    return s


def markdown(rep: dict) -> str:
    """The report as markdown: τ per class after each cycle per arm, forgetting, class vs generalist,
    throughput and the goals."""
    cfg, s = rep["config"], rep["summary"]
    classes = list(dict.fromkeys(cfg["sequence"]))
    L = [f"# Drafts per workload class and replay over {' → '.join(cfg['sequence'])}", "",
         f"SmolLM2-135M-Instruct fp32, greedy, k={rep['k']}, {rep['cpu_threads']} CPU threads; "
         f"{cfg['traffic_prompts']} fresh prompts per cycle, {cfg['eval_prompts']} held-out prompts per class × "
         f"≤{cfg['max_new_tokens']} tokens; curate.window 1 in both arms; `classes` = "
         + ("`train.class_drafts: auto`" if cfg.get("class_drafts") == "auto" else "a draft per class") + " + the "
         f"replay buffer ({cfg['replay_fraction']:.0%}), `single` = one draft, no replay; "
         f"{cfg['train_epochs']} epochs per cycle; wall time {rep['wall_s'] / 60:.0f} min"
         + (f" (the {' and '.join(f'`{a}`' for a in rep['resumed_arms'])} arm kept from an interrupted run, not "
            "counted)" if rep.get("resumed_arms") else "") + ".", ""]
    for arm, a in rep["arms"].items():
        L += [f"## τ per class, `{arm}` (fixed k, as serve routes)", "",
              "| cycle | phase | " + " | ".join(classes) + " | drafts served |",
              "|---|---|" + "---|" * len(classes) + "---|"]
        for p in a["points"]:
            cells = [f"{p['tau'][w]:.2f}" if p["tau"].get(w) else "–" for w in classes]
            vs = ", ".join(f"{w or 'generalist'} v{v}" for w, v in sorted(p["versions"].items()))
            L.append(f"| {p['cycle']} | {p['phase'] or 'start'} | " + " | ".join(cells) + f" | {vs} |")
        L += ["", "| class | best τ | τ at the end | forgetting | noise (2 SE) |", "|---|---|---|---|---|"]
        for w, x in s["forgetting"][arm].items():
            nz = "–" if x.get("noise") is None else f"{x['noise']:.1%}"
            L.append(f"| {w} | {x['best']:.2f} | {x['last']:.2f} | {x['forgetting']:.1%} | {nz} |")
        L.append("")
    L += _retained_lines(rep)
    L += ["## Class draft vs generalist (classes arm, after the last cycle)", "",
          "| class | its own draft τ | generalist τ | served by |", "|---|---|---|---|"]
    for w, x in s["class_vs_generalist"].items():
        L.append(f"| {w} | {x['class'] or 0:.2f} | {x['generalist'] or 0:.2f} | v{x['served_by']} |")
    if rep.get("throughput"):
        L += ["", f"## Throughput (pooled held-out prompts; {_static_words(rep)})", "",
              "`classes` and `single`: each arm as `tidespec serve` runs it (goodput policy, suffix proposer, "
              "class drafts); the statics at fixed k"
              + ("; `classes_drafts`: the classes arm's drafts alone at fixed k, as the statics are (draft "
                 "for draft)" if any(n.startswith("classes_drafts") for n in s["ratios"]) else "") + ".", "",
              "| concurrency | " + " | ".join(f"{n} (median, range)" for n in s["ratios"]) + " |",
              "|---|" + "---|" * len(s["ratios"])]
        for c in sorted({c for r in s["ratios"].values() for c in r}, key=int):
            L.append(f"| {c} | " + " | ".join(f"{r[c][0]:.2f}× ({r[c][1]:.2f}–{r[c][2]:.2f})"
                                             for r in s["ratios"].values()) + " |")
        if s["code_c1_over_none"]:
            m, lo, hi = s["code_c1_over_none"]
            L += ["", f"Code at c=1, classes arm / no speculation: {m:.2f}× ({lo:.2f}–{hi:.2f})."]
    L += ["", "## Goals", ""] + [f"- {k}: {v}" for k, v in s["goals"].items()]
    L += ["", f"Command: `{rep.get('command', 'tidespec bench sequence')}`", ""]
    return "\n".join(L)


def _static_words(rep: dict) -> str:
    """Which static the throughput compares with, and the in-domain statics when measured."""
    n, prov = rep.get("static_tokens"), rep.get("static_provenance")
    if rep.get("static_given"):
        words = (f"static: the given draft `{rep['static_dir']}`"
                 + (_provenance_words(prov) if prov else f", trained on {n:,} tokens" if n else "")
                 + (", both arms' first champion" if rep.get("static_first_champion") else ""))
    else:
        words = (f"static trained once on {n:,} ShareGPT tokens: the classes arm's drafts processed "
                 f"{rep.get('static_tokens_matched', 0):,}, and the static is never smaller than `bootstrap.tokens`")
    frozen = rep.get("arms", {}).get("single", {}).get("in_domain")
    if frozen:
        words += "; in_domain: each class served by the single arm's champion after its first phase (" + ", ".join(
            f"{w} v{x['version']} at cycle {x['cycle']}" + ("" if x.get("promoted", True) else
                                                            ", not promoted there: an earlier phase's draft")
            for w, x in frozen.items()) + "), frozen"
    return words


def _retained_lines(rep: dict) -> list[str]:
    """Each generalist decision's forgetting on the retained holdout (`steps.evaluate`: teacher-forced
    τ of candidate and champion on earlier classes' requests never trained on); none when no cycle
    measured one."""
    rows = [(arm, c) for arm, a in rep["arms"].items() for c in a["cycles"] if c.get("retained")]
    if not rows:
        return []
    L = ["## Forgetting at each decision (generalist; retained holdout, teacher-forced, paired)", "",
         "| arm | cycle | phase | promoted | class: champion τ → candidate τ (forgetting), records |",
         "|---|---|---|---|---|"]
    for arm, c in rows:
        cells = "; ".join(f"{w or 'unclassified'}: {'–' if r['champion'] is None else format(r['champion'], '.2f')} → "
                          f"{r['candidate']:.2f}" + ("" if r["forgetting"] is None else f" ({r['forgetting']:+.1%})")
                          + f", {r['records']}" for w, r in sorted(c["retained"].items()))
        L.append(f"| {arm} | {c['cycle']} | {c['phase']} | {'yes' if c.get('promoted') else 'no'} | {cells} |")
    return L + [""]


def _provenance_words(prov: dict) -> str:
    """A given static's recipe from its provenance (`sequence.static_provenance`: only tokens is sure)."""
    tau = prov.get("simulated_tau")
    parts = [prov.get("source"), tau and f"its general holdout's simulated τ {tau:.2f}",
             ", ".join(str(prov[k]) for k in ("hardware", "date") if k in prov),
             prov.get("command") and f"`{prov['command']}`"]
    epochs = f" × {prov['epochs']} epochs" if "epochs" in prov else ""
    detail = "; ".join(str(x) for x in parts if x)
    return f", trained on {prov['tokens']:,} tokens{epochs}" + (f" ({detail})" if detail else "")


def write_report(rep: dict, out: Path, stem: str) -> None:
    """`out/<stem>.json` and `.md`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    (out / f"{stem}.md").write_text(markdown(rep))
