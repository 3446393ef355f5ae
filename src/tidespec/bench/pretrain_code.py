"""`tidespec bench pretrain-code`: does a code-pretrained draft (generic code, teacher-forced) lift τ on HumanEval?

Corpus: this interpreter's own standard library (`sysconfig` stdlib dir, top-level *.py, sorted,
cut into chunks), wrapped as chat answers ("```python ...```") and teacher-forced through the target
(one prefill per chunk: the inputs are the files' tokens, the labels the target's distribution at
every position — as the static bootstrap does with ShareGPT). The draft trained on it is the
`--init` of a `tidespec bench train` run on the fixed HumanEval snapshot.

    tidespec bench pretrain-code --chunks 300 --epochs 2 --out /tmp/code-pretrained
    .venv/bin/tidespec bench train --init /tmp/code-pretrained --fractions 1.0 --shift '' \
        --max-new-tokens 192 --epochs 6 --out /tmp/init-code

The committed figures: bench/results/pretrain-code-summary.json (this script) and
bench/results/train-init-code.{json,md} (the bench run).
"""
from __future__ import annotations

import argparse
import glob
import json
import sysconfig
import time
from pathlib import Path

from tidespec.config import load_params
from tidespec.models.load import get_target
from tidespec.steps.bootstrap import teacher_force
from tidespec.train.trainer import train_draft


def chunks(tok, n: int, max_tokens: int) -> list[list[dict]]:
    """n chat exchanges: "Write Python code from <module>." → a ```python fenced chunk of its source."""
    out = []
    for f in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py")):
        lines = Path(f).read_text(errors="ignore").splitlines()
        cur: list[str] = []
        for line in lines:
            cur.append(line)
            if len(cur) >= 40:
                out.append([{"role": "user", "content": f"Write Python code from the module {Path(f).stem}."},
                            {"role": "assistant", "content": "```python\n" + "\n".join(cur) + "\n```"}])
                cur = []
            if len(out) >= n:
                return out
    return out


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench pretrain-code` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench pretrain-code")
    ap.add_argument("--chunks", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", type=Path, required=True)
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    params = load_params(a.params)
    target, tok = get_target(params)
    t0 = time.perf_counter()
    convs = chunks(tok, a.chunks, 512)
    recs = teacher_force(target, tok, convs, 512)
    t_prefill = time.perf_counter() - t0
    tp = params.train.model_copy(update={"epochs": a.epochs, "warm_start": False})
    m = train_draft(recs[8:], recs[:8], target, params.draft, tp, a.out)
    summary = {"chunks": len(recs), "tokens": sum(int(r["input_ids"].shape[0]) for r in recs),
               "prefill_seconds": t_prefill, **{k: v for k, v in m.items() if k != "curve"}}
    (a.out / "pretrain_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))

