"""What the GPU runs a layer (issue 34's fixed cost): the optimized HLO of the T=1 decode window's scanned layer body,
all resident against S=E through the offload path (30B shape cut to 4 layers, random weights), its instructions
counted by kind and by the named scope of their op_name (the sixth-session script h200-2026-12-06b-offload/scripts/
body_kernels.py without its trace, whose kernels it could not name). Each instruction's line is written too.
Run on the GPU machine: python3 body_hlo.py OUT_DIR."""
import collections, glob, gzip, json, os, re, sys, time

import jax
import numpy as np

from strata_jax import Engine
from strata_jax.model.config import preset

out = sys.argv[1]
MODEL = sys.argv[2] if len(sys.argv) > 2 else "qwen3-30b-a3b"
cfg = preset(MODEL, layers=4 if MODEL != "tiny" else None)


def scope(name: str) -> str:
    parts = [p for p in name.split("/") if p.startswith("moe_") or p in ("attention", "mixer")]
    return "/".join(parts[-2:]) if parts else (name.split("/")[-1][:30] or "?")


def body_of(text: str) -> str:
    body = re.findall(r"while\([^)]*\), condition=%?[\w.\-]+, body=%?([\w.\-]+)", text)[0]
    return text.split(f"%{body} ")[1].split("\n}\n")[0]


for arm, opts in (("resident", dict(expert_cache_slots="all")),
                  ("offload_S=E", dict(cpu_threads=0, expert_cache_slots=cfg.num_experts, pcie_frac=1.0))):
    eng = Engine.from_random(cfg, seed=0, verbose=False, embed_scale=50, **opts)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 16).tolist()
    eng.generate(prompt, 8, stop_token_ids=[], draft="none", spec=0)
    text = eng.compiled.decode[1].as_text()
    open(f"{out}/{arm}_decode1.hlo.txt", "w").write(text)
    seg = body_of(text)
    kinds, scopes = collections.Counter(), collections.Counter()
    for line in seg.split("\n"):
        m = re.search(r"= [^=]*?\b(fusion|custom-call|dot|copy|concatenate|gather|scatter|sort|while|conditional|"
                      r"dynamic-slice|dynamic-update-slice|all-reduce)\(", line)
        if not m:
            continue
        kinds[m.group(1)] += 1
        op = re.search(r'op_name="([^"]*)"', line)
        scopes[(m.group(1), scope(op.group(1) if op else "?"))] += 1
    open(f"{out}/{arm}_body.txt", "w").write(seg)
    print(f"{arm}: body instructions {sum(kinds.values())}: {dict(kinds.most_common())}")
    for k, v in sorted(scopes.items(), key=lambda kv: -kv[1]):
        print(f"   {v:3d} {k[0]:12s} {k[1]}")
