"""`tidespec bench classes`: which request signal separates code, math and chat best on the shipped
sets, for the workload classes the policy and the reports key on (`serve.workload`).

Labelled prompts: HumanEval → code; GSM8K en/ko/ja → math; MT-Bench by category (coding → code,
math → math, the rest → chat), turn 2 preceded by turn 1 as a chat request carries it. Compared:
the content rules (`serve.workload.content_class`), and online clustering without labels — k-means
(k = 3, cosine, best of several seeds) over hashed TF-IDF of the target tokenizer's ids, each
cluster named by its majority class (an upper bound for a clusterer that must name classes itself).
Reported: the confusion matrix, recall per class, accuracy, µs per request; and how the rules
spread ShareGPT (unlabelled, mixed chat) over the classes.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from ..assets import prompts
from ..hashing import unit_hash
from ..serve.workload import CHAT, CODE, MATH, content_class

CLASSES = (CODE, MATH, CHAT)
HASH_DIMS = 8192


def labelled(keys: bool = False) -> list[tuple]:
    """(class, text) of the labelled shipped prompts (module docstring); with `keys`, (class, text,
    split key): the prompt id, a GSM8K problem's id for every language of it, an MT-Bench question's
    for both turns (`held_out` keeps each whole on one side)."""
    out = [(CODE, p.text, p.id) for p in prompts.load("humaneval")]
    out += [(MATH, p.text, p.category) for s in ("gsm-en", "gsm-ko", "gsm-ja") for p in prompts.load(s)]
    mt = prompts.mtbench(turns=(0, 1))
    first = {p.id.rsplit("/", 1)[0]: p.text for p in mt if p.id.endswith("t0")}
    for p in mt:
        q = p.id.rsplit("/", 1)[0]
        if p.id.endswith("t1"):
            p = replace(p, text=first[q] + "\n" + p.text)
        out.append((CODE if p.category == "coding" else MATH if p.category == "math" else CHAT, p.text, q))
    return out if keys else [(c, t) for c, t, _ in out]


def held_out(keys: list[str], fraction: float, seed: int) -> list[bool]:
    """Which prompts are held out: `prompts.split`'s rule (a seeded hash of the key below `fraction`),
    the same prompts the benchmarks replay and never serve."""
    return [unit_hash(f"{seed}:{k}") < fraction for k in keys]


def logistic(x: torch.Tensor, y: list[int], k: int, steps: int = 300, weight_decay: float = 1e-3) -> torch.Tensor:
    """A multinomial logistic regression `[D, k]` (+ bias row) fit by L-BFGS on rows `x` `[n, D]` fp32
    and labels `y`: the tiny learned classifier a cycle could fit on its curated traffic."""
    w = torch.zeros(x.shape[1] + 1, k, requires_grad=True)
    xb = torch.cat([x, torch.ones(len(x), 1)], 1)
    t = torch.tensor(y)
    opt = torch.optim.LBFGS([w], max_iter=steps, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        v = torch.nn.functional.cross_entropy(xb @ w, t) + weight_decay * (w[:-1] ** 2).sum()
        v.backward()
        return v
    opt.step(loss)
    return w.detach()


def confusion(truth: list[str], pred: list[str]) -> dict:
    """{"matrix": {true: {predicted: n}}, "recall": {class: r}, "accuracy": a}."""
    m = {c: Counter() for c in CLASSES}
    for t, p in zip(truth, pred):
        m[t][p] += 1
    recall = {c: m[c][c] / max(1, sum(m[c].values())) for c in CLASSES}
    return {"matrix": {c: dict(m[c]) for c in CLASSES}, "recall": recall,
            "accuracy": sum(t == p for t, p in zip(truth, pred)) / len(truth)}


def tfidf(docs: list[list[int]], fit: list[bool] | None = None) -> torch.Tensor:
    """Unit-norm hashed TF-IDF `[n, HASH_DIMS]` fp32 of token-id documents; the IDF from the rows
    `fit` marks (default all: no labels are used either way)."""
    x = torch.zeros(len(docs), HASH_DIMS)
    for i, d in enumerate(docs):
        x[i].index_add_(0, torch.tensor(d, dtype=torch.int64) % HASH_DIMS, torch.ones(len(d)))
    ref = x if fit is None else x[torch.tensor(fit)]
    idf = torch.log((1 + len(ref)) / (1 + (ref > 0).sum(0).float())) + 1
    x = torch.log1p(x) * idf
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-9)


def kmeans(x: torch.Tensor, k: int, seeds: int = 8, iters: int = 30) -> list[int]:
    """Spherical k-means (cosine) on unit rows `x`; the assignment of the seed with the highest
    total similarity."""
    best, best_sim = None, -1.0
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        c = x[torch.randperm(len(x), generator=g)[:k]].clone()
        for _ in range(iters):
            a = (x @ c.T).argmax(1)
            c = torch.stack([x[a == j].sum(0) if bool((a == j).any()) else c[j] for j in range(k)])
            c = c / c.norm(dim=1, keepdim=True).clamp_min(1e-9)
        sim = float((x @ c.T).max(1).values.sum())
        if sim > best_sim:
            best, best_sim = a.tolist(), sim
    return best


def run(tokenizer, out: Path, sharegpt: int = 2000, holdout_fraction: float = 0.3, seed: int = 0) -> dict:
    """Measure the signals; writes `out/classes.json` and `out/classes.md`, returns the result. On the
    held-out part (`held_out`: `workload.holdout_fraction` / `seed`, the prompts benchmarks replay),
    the rules and a logistic regression on TF-IDF fit on the rest (`logistic`)."""
    data = labelled(keys=True)
    truth, texts = [c for c, _, _ in data], [t for _, t, _ in data]
    t0 = time.perf_counter()
    rules = [content_class(t) for t in texts]
    us = 1e6 * (time.perf_counter() - t0) / len(texts)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    clusters = kmeans(tfidf(ids), len(CLASSES))
    name = {j: Counter(t for t, a in zip(truth, clusters) if a == j).most_common(1)[0][0] for j in set(clusters)}
    named = [name[a] for a in clusters]
    hold = held_out([k for _, _, k in data], holdout_fraction, seed)
    fit = [not h for h in hold]
    x = tfidf(ids, fit)
    w = logistic(x[torch.tensor(fit)], [CLASSES.index(c) for c, f in zip(truth, fit) if f], len(CLASSES))
    learned = [CLASSES[int(j)] for j in (torch.cat([x, torch.ones(len(x), 1)], 1) @ w).argmax(1)]
    on = [i for i, h in enumerate(hold) if h]
    sg = Counter(content_class(p.text) for p in prompts.load("sharegpt")[:sharegpt])
    res = {"benchmark": "classes", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "prompts": dict(Counter(truth)), "rules": confusion(truth, rules) | {"us_per_request": us},
           "kmeans_tfidf": confusion(truth, named) | {"clusters_named": {str(j): c for j, c in name.items()}},
           "held_out": {"fraction": holdout_fraction, "seed": seed, "prompts": dict(Counter(truth[i] for i in on)),
                        "rules": confusion([truth[i] for i in on], [rules[i] for i in on]),
                        "logistic_tfidf": confusion([truth[i] for i in on], [learned[i] for i in on])},
           "sharegpt_by_rules": {"prompts": sharegpt, "classes": dict(sg)}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "classes.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "classes.md").write_text(markdown(res))
    return res


def markdown(res: dict) -> str:
    """The result of `run` as markdown: accuracy and recall per signal, the rules' confusion matrix,
    their cost per request and how they spread ShareGPT."""
    lines = ["# Workload classes from the request: which signal separates code, math and chat", "",
             f"{res['date']} · `tidespec bench classes` · labelled prompts {res['prompts']} (HumanEval → code, "
             "GSM8K en/ko/ja → math, MT-Bench by category: coding → code, math → math, the rest → chat; turn 2 "
             "with turn 1 before it).", "",
             "| signal | accuracy | recall code | recall math | recall chat |", "|---|---|---|---|---|"]
    for key, label in (("rules", "content rules (`serve.workload`)"),
                       ("kmeans_tfidf", "k-means on token TF-IDF, clusters named by majority (no labels)")):
        r = res[key]
        lines.append(f"| {label} | {r['accuracy']:.3f} | " + " | ".join(f"{r['recall'][c]:.3f}" for c in CLASSES)
                     + " |")
    lines += ["", "Confusion of the content rules (rows: true class, columns: predicted):", "",
              "| | " + " | ".join(CLASSES) + " |", "|---|" + "---|" * len(CLASSES)]
    for c in CLASSES:
        lines.append(f"| {c} | " + " | ".join(str(res["rules"]["matrix"][c].get(p, 0)) for p in CLASSES) + " |")
    h = res["held_out"]
    lines += ["", f"On the held-out part only ({h['prompts']}: the prompts benchmarks replay, never served; "
              f"fraction {h['fraction']}, seed {h['seed']}), against a logistic regression on token TF-IDF fit on "
              "the other part (the learned alternative):", "",
              "| signal | accuracy | recall code | recall math | recall chat |", "|---|---|---|---|---|"]
    for key, label in (("rules", "content rules"), ("logistic_tfidf", "logistic regression, TF-IDF (learned)")):
        r = h[key]
        lines.append(f"| {label} | {r['accuracy']:.3f} | " + " | ".join(f"{r['recall'][c]:.3f}" for c in CLASSES)
                     + " |")
    lines += ["", "Confusion on the held-out part (rows: true class; columns: rules → predicted | learned → "
              "predicted):", "", "| | " + " | ".join(CLASSES) + " | " + " | ".join(CLASSES) + " |",
              "|---|" + "---|" * (2 * len(CLASSES))]
    for c in CLASSES:
        lines.append(f"| {c} | " + " | ".join(str(h["rules"]["matrix"][c].get(p, 0)) for p in CLASSES) + " | "
                     + " | ".join(str(h["logistic_tfidf"]["matrix"][c].get(p, 0)) for p in CLASSES) + " |")
    sg = res["sharegpt_by_rules"]
    lines += ["", f"The rules cost {res['rules']['us_per_request']:.0f} µs per request. On {sg['prompts']} ShareGPT "
              f"first turns (unlabelled; users ask for code and arithmetic there too) they give {sg['classes']}.", ""]
    return "\n".join(lines)
