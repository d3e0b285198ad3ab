"""The user's number beside the peer's: our generate loop and llama.cpp's llama-bench on the same model shape, the
same GPU, in one run, one table.

    python -m benchmarks.peer_bench --layers=24 --llama_bench=/tmp/llama.cpp/build/bin/llama-bench --gguf=/tmp/m24.gguf

One question: how many tokens per second does a user get from `generate` (default engine settings, the loop that
`make run` runs) against llama.cpp decoding the same shape? llama.cpp is built from source on the GPU machine
(benchmarks/peer/: trim_llama_src.sh here, build_llama.sh there, write_gguf.py writes the F16 GGUF of our preset).

Peer arms: `llama-bench -ngl 99 -fa 1 -p 0 -n N` (all on the GPU) and `-ncmoe C` (the experts of C layers on the CPU)
for each --ncmoe. llama-bench's tg N: N tokens after an empty prompt, no speculation, mean of --reps.
Our arms (--ours): `engine option=value` sets, each an Engine.from_random of the same shape (defaults otherwise,
i.e. what `make run` does on that shape); a request of --prompt_tokens random ids then --n_gen new tokens with stop
tokens off, the first one from the prefill; decode tok/s = (n_gen - 1) / decode time, median of --reps requests
after one warm-up request. The default arm speculates (window 4, n-gram drafts): its windows and accepted drafts
are printed beside it; `spec=0` is the plain one-token loop, the like of llama-bench's tg.
Run the peer first: JAX takes most of the GPU's memory once it starts.

--quant=Q4_K_M,Q2_K (issue 36): llama-quantize makes each type from the F16 GGUF (<stem>-<type>.gguf beside it, kept
when there), then per type the peer's arms and ours both read that file (our arms: Engine.from_pretrained of it, its
experts kept packed); one table with a type column, the share of the expert bytes in VRAM, the ratio to the peer at
the same share, hit rate and PCIe MB a token. The routing spread is the file's (write_gguf.py's random routers):
--embed_scale applies to random weights only.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "qwen3-30b-a3b", "Model preset from configs/.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 24, "Cut the model to its first N layers (0 = all).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("llama_bench", "/tmp/llama.cpp/build/bin/llama-bench", "The peer's llama-bench binary ('' = no "
                    "peer arms).", flag_values=FLAGS)
flags.DEFINE_string("gguf", "", "The peer's GGUF of the same shape; written with benchmarks/peer/write_gguf.py when "
                    "missing ('' = /tmp/<model>-<layers>.gguf).", flag_values=FLAGS)
flags.DEFINE_string("gguf_py", "/tmp/llama.cpp/gguf-py", "gguf-py of the peer's source tree (to write the GGUF).",
                    flag_values=FLAGS)
flags.DEFINE_string("ncmoe", "", "Peer offload arms: layers whose experts stay on the CPU, comma-separated.",
                    flag_values=FLAGS)
flags.DEFINE_integer("threads", 0, "CPU threads of the peer's offload arms (0 = the cores this process may use).",
                     lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("peer_sampling", "", "The peer's sampled arms: llama-completion (built beside llama-bench) with "
                    "these settings, e.g. temperature=0.7,top_k=20,top_p=0.8 (min_p 0, no penalties), all on the GPU "
                    "and at each --ncmoe; '' = none.", flag_values=FLAGS)
flags.DEFINE_string("ours", "default;spec=0", "Our arms, ';'-separated; each a ','-separated list of "
                    "option=value (engine or request options; 'default' = none).", flag_values=FLAGS)
flags.DEFINE_integer("n_gen", 128, "Tokens generated per request (llama-bench -n).", lower_bound=2, flag_values=FLAGS)
flags.DEFINE_integer("prompt_tokens", 16, "Random prompt ids of our requests.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("reps", 3, "Timed requests per arm (llama-bench -r).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("embed_scale", 1.0, "Our arms' random embedding multiplied by this (Engine.from_random; 50 "
                   "spreads the routing as offload_bench --embed_scale does; the peer's -ncmoe does not depend on it).",
                   flag_values=FLAGS)
flags.DEFINE_integer("read_mib", 2048, "Array size of the host read-bandwidth probe (all threads reading one array: "
                     "the yardstick of both engines' CPU expert rates; 0 = none).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_bool("warmup_arm", True, "Run the first of our arms once, untimed, before the timed arms: the first "
                  "engine of a process ran 20-30% slow on the GPU machine (h200-2026-12-06d-offload); once a process.",
                  flag_values=FLAGS)
flags.DEFINE_string("quant", "", "llama-quantize types, comma-separated (e.g. Q4_K_M,Q2_K): each made from the F16 "
                    "GGUF with --llama_quantize (<stem>-<type>.gguf beside it; kept when there), then the peer's arms "
                    "and ours all read that file (ours with its experts kept packed; --embed_scale does not apply: "
                    "the spread is the file's routers); '' = our arms on random weights.", flag_values=FLAGS)
flags.DEFINE_string("llama_quantize", "", "llama.cpp's llama-quantize ('' = beside --llama_bench).", flag_values=FLAGS)
flags.DEFINE_bool("drop_gguf", False, "Delete the F16 GGUF once the peer's arms have run, before ours: the 30B shape's "
                  "48 layers are 61 GB in /dev/shm and our engine's host experts 58 GB, more than a 128 GB host holds "
                  "together. Not with --quant (its types are made from the F16 file as they run).",
                  flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)


def parse_ours(text: str) -> list[tuple[str, dict]]:
    arms = []
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        opts = {}
        if part != "default":
            for item in part.split(","):
                if "=" not in item:
                    raise ValueError(f"--ours: {item!r} is not option=value")
                name, value = item.split("=", 1)
                opts[name.strip()] = value.strip()
        arms.append((part, opts))
    return arms


def ensure_gguf(model: str, layers: int, gguf: Path, gguf_py: str) -> Path:
    """The peer's F16 GGUF of the preset cut to `layers`, written with benchmarks/peer/write_gguf.py when missing."""
    if not gguf.is_file():
        common.progress(f"peer: writing {gguf} (F16, {layers} layers)")
        subprocess.run([sys.executable, str(Path(__file__).parent / "peer" / "write_gguf.py"), f"--out={gguf}",
                        f"--model={model}", f"--layers={layers}", f"--gguf_py={gguf_py}"], check=True)
    return gguf


# llama-quantize's types that need no importance matrix
QUANT_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_0", "Q5_1", "Q5_K_S",
               "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS")


def parse_quant(text: str) -> list[str]:
    """--quant's comma-separated llama-quantize types, upper-cased; an unknown one is a ValueError naming it."""
    types = list(dict.fromkeys(t.strip().upper() for t in text.split(",") if t.strip()))
    for t in types:
        if t not in QUANT_TYPES:
            raise ValueError(f"--quant: {t!r} is not a llama-quantize type this bench runs ({', '.join(QUANT_TYPES)})")
    return types


def quant_path(f16: Path, qtype: str) -> Path:
    """The quantized file beside the F16 one: /tmp/m-24.gguf -> /tmp/m-24-Q4_K_M.gguf."""
    return f16.with_name(f"{f16.stem}-{qtype}.gguf")


def ensure_quantized(quantize: str, f16: Path, qtype: str) -> Path:
    """`llama-quantize F16 OUT TYPE` unless OUT exists; a failure is a ValueError with its last stderr line."""
    out = quant_path(f16, qtype)
    if out.is_file():
        return out
    common.progress(f"peer: {quantize} {f16} {out} {qtype}")
    proc = subprocess.run([quantize, str(f16), str(out), qtype], capture_output=True, text=True, errors="replace")
    if proc.returncode != 0 or not out.is_file():
        out.unlink(missing_ok=True)  # a cut file would be taken as made next time
        raise ValueError(f"llama-quantize {qtype} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


def layer_expert_bytes(gguf: Path) -> tuple[list[float], int]:
    """Bytes of one routed expert (gate + up + down as stored) per layer of a GGUF, from its tensor table; and its
    experts a token (top-K)."""
    from strata_jax.io.gguf_file import GGUFFiles
    files = GGUFFiles(gguf)
    experts, per_layer = files.arch_value("expert_count"), []
    for i in range(files.arch_value("block_count")):
        names = [f"blk.{i}.ffn_{m}_exps.weight" for m in ("gate", "up", "down")]
        per_layer.append(sum(int(files.tensors[n][0].n_bytes) for n in names if n in files.tensors) / experts)
    return per_layer, int(files.arch_value("expert_used_count"))


def llama_bench(cmd: list[str]) -> tuple[list[dict] | None, str | None]:
    """Run llama-bench with `-o json` in cmd: (its records, None), or (None, the last line of its stderr)."""
    common.progress("peer: " + " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(proc.stdout), None


def run_peer(s, gguf: Path) -> list[dict]:
    import os
    rows = []
    threads = s.threads or len(os.sched_getaffinity(0))
    for ncmoe in [None] + common.int_list(s.ncmoe, "ncmoe") if s.ncmoe else [None]:
        cmd = [s.llama_bench, "-m", str(gguf), "-ngl", "99", "-fa", "1", "-p", "0", "-n", str(s.n_gen),
               "-r", str(s.reps), "-o", "json"]
        if ncmoe:
            cmd += ["-ncmoe", str(ncmoe), "-t", str(threads)]
        records, error = llama_bench(cmd)
        if error is not None:
            rows.append(dict(arm=" ".join(cmd[5:]), error=error))
            continue
        rec = records[0]
        rows.append(dict(arm="-ngl 99 -fa 1" + (f" -ncmoe {ncmoe}" if ncmoe else ""), tok_s=rec["avg_ts"],
                         tok_s_stdev=rec.get("stddev_ts"), build=rec.get("build_commit"), gpu=rec.get("gpu_info"),
                         ncmoe=ncmoe or 0))
        common.progress(f"peer: {rows[-1]['arm']}: {rec['avg_ts']:.1f} tok/s")
    return rows


_PEER_SAMPLING = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "seed": "-s"}


def peer_sampling_args(text: str) -> list[str]:
    """--peer_sampling's option=value list -> llama-completion's flags (min-p off: ours has none)."""
    args = ["--min-p", "0"]
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in _PEER_SAMPLING:
            raise ValueError(f"--peer_sampling: {item!r} is not one of {', '.join(_PEER_SAMPLING)}=value")
        float(value)  # a number, or the ValueError names it
        args += [_PEER_SAMPLING[name.strip()], value.strip()]
    return args


def completion_tok_s(stderr: str) -> tuple[float, float, int] | None:
    """llama-completion's perf lines -> (tok/s of its decode including its sampling time, tok/s of the eval
    alone, tokens evaluated), or None when they are missing."""
    import re
    ev = re.search(r"\s eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr)
    sm = re.search(r"sampling time =\s*([\d.]+) ms", stderr)
    if not ev or not sm:
        return None
    eval_ms, runs, sample_ms = float(ev.group(1)), int(ev.group(2)), float(sm.group(1))
    return runs * 1e3 / (eval_ms + sample_ms), runs * 1e3 / eval_ms, runs


def run_peer_sampled(s, gguf: Path) -> list[dict]:
    """llama-completion with --peer_sampling: --n_gen tokens after a short prompt, eos ignored, --reps runs (the
    median); decode tok/s = evaluated tokens / (eval time + sampling time), both from its own perf lines."""
    import os
    binary = Path(s.llama_bench).with_name("llama-completion")
    if not binary.is_file():
        common.say(f"peer: {binary} not found: no sampled peer arms (benchmarks/peer/build_llama.sh builds it)")
        return []
    threads = s.threads or len(os.sched_getaffinity(0))
    rows = []
    for ncmoe in [0] + (common.int_list(s.ncmoe, "ncmoe") if s.ncmoe else []):
        cmd = [str(binary), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-c", str(s.n_gen + 64), "-n", str(s.n_gen),
               "-p", "Once upon a time", "--ignore-eos", "-no-cnv", "--no-display-prompt", "--no-warmup",
               *peer_sampling_args(s.peer_sampling)]
        if ncmoe:
            cmd += ["-ncmoe", str(ncmoe), "-t", str(threads)]
        arm = f"llama-completion {s.peer_sampling}" + (f" -ncmoe {ncmoe}" if ncmoe else "")
        common.progress("peer: " + " ".join(cmd))
        samples, evals, error = [], [], None
        for _ in range(s.reps + 1):  # the first run warms up (its numbers are dropped)
            # errors="replace": random weights print any bytes, not UTF-8 (the rate lines are ASCII)
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                                  timeout=600)
            got = completion_tok_s(proc.stderr) if proc.returncode == 0 else None
            if got is None:
                error = (proc.stderr.strip().splitlines() or ["?"])[-1]
                break
            samples.append(got[0])
            evals.append(got[1])
        if error is not None:
            rows.append(dict(arm=arm, error=error, sampled=True, ncmoe=ncmoe))
            continue
        rows.append(dict(arm=arm, tok_s=statistics.median(samples[1:]), eval_tok_s=statistics.median(evals[1:]),
                         samples=samples[1:], sampled=True, ncmoe=ncmoe))
        common.progress(f"peer: {arm}: {rows[-1]['tok_s']:.1f} tok/s with sampling ({rows[-1]['eval_tok_s']:.1f} "
                        f"eval alone)")
    return rows


def run_ours(s, cfg, model_path: Path | None = None, warmup: bool = True) -> list[dict]:
    """Our arms: engines of random weights of `cfg`, or (model_path) each loaded from that GGUF; warmup: the
    --warmup_arm run first (once a process: --quant's later types go without)."""
    import numpy as np
    from strata_jax.engine.api import Engine
    from strata_jax.options import RequestOptions, from_text, split_options
    import dataclasses
    request_names = {f.name for f in dataclasses.fields(RequestOptions)}
    rows = []
    rng = np.random.default_rng(0)
    arms = parse_ours(s.ours)
    if s.warmup_arm and warmup and arms:  # the first arm again, first, its row dropped (--warmup_arm)
        arms = [(None, arms[0][1])] + arms
    for name, opts in arms:
        engine_opts, request_opts = split_options(from_text(opts))  # "temperature=1": a number, as the flags
        request_opts = {k: v for k, v in request_opts.items() if k in request_names}
        warmup, name = name is None, arms[1][0] if name is None else name
        common.progress(f"ours [{name}]{' (warm-up, not reported)' if warmup else ''}: building the engine ("
                        + (f"{model_path})" if model_path else f"random weights, {cfg.num_layers} layers)"))
        t0 = time.perf_counter()
        if model_path:
            engine = Engine.from_pretrained(str(model_path), verbose=True, **engine_opts)
        else:
            engine = Engine.from_random(cfg, seed=0, verbose=True, embed_scale=s.embed_scale, **engine_opts)
        start_s = time.perf_counter() - t0
        cfg = engine.cfg
        samples, windows, drafted, accepted, host, hits, pool, pcie = [], [], [], [], [], [], [], []
        for rep in range(1 if warmup else s.reps + 1):
            prompt = rng.integers(0, cfg.vocab_size, size=s.prompt_tokens).tolist()
            engine.generate(prompt, max_new_tokens=s.n_gen, stop_token_ids=[], **request_opts)
            st = engine.stats.last
            if rep == 0:
                continue  # warm-up (the graphs compiled, the slots filled)
            samples.append(st.decode_tok_s)
            windows.append(st.windows)
            drafted.append(st.drafts_proposed)
            accepted.append(st.drafts_accepted)
            host.append(st.host_gap_s / st.host_gaps * 1e3 if st.host_gaps else 0.0)
            hits.append(st.decode_experts.hit_rate if engine.placement else 1.0)
            pcie.append(st.decode_experts.pcie_bytes / max(st.generated_tokens - 1, 1) / 1e6)  # decode tokens
            if engine.placement:
                from strata_jax.offload.placement import expert_itemsize
                pool.append(ours_pool_gbs(cfg, st.decode_experts, expert_itemsize(engine.options)))
        if warmup:
            common.free_engine(engine)
            del engine
            common.free_device_memory()
            continue
        tok_s = statistics.median(samples)
        offload = {}
        if engine.placement:  # the expert cache: slots, the split, the hit rate of the decode windows
            rates = [g for g in pool if g is not None]
            offload = dict(slots=engine.placement.slots, pcie_frac=engine.placement.pcie_frac,
                           hit_rate=statistics.median(hits), native=engine.placement.native,
                           pool_gbs=statistics.median(rates) if rates else None)
        rows.append(dict(arm=name, options=opts, tok_s=tok_s, samples=samples, windows=statistics.median(windows),
                         drafts_proposed=statistics.median(drafted), drafts_accepted=statistics.median(accepted),
                         host_gap_ms=statistics.median(host), start_s=start_s, compile_s=engine.stats.compile_s,
                         scanned=engine.scanned, pcie_mb_per_token=statistics.median(pcie),
                         expert_dtype=engine.options.expert_dtype, experts=cfg.num_experts, **offload))
        # the row's offload figures now, not only in the final table (a call cut by its time limit keeps them)
        cache = (f"; hit rate {rows[-1]['hit_rate']:.1%}, PCIe {rows[-1]['pcie_mb_per_token']:.2f} MB a token, "
                 f"pcie_frac {rows[-1]['pcie_frac']:g}" if offload else "")
        common.progress(f"ours [{name}]: {tok_s:.1f} tok/s (median of {s.reps}; {rows[-1]['windows']} windows, "
                        f"{rows[-1]['drafts_accepted']}/{rows[-1]['drafts_proposed']} drafts accepted{cache}; "
                        f"start-up {start_s:.1f} s, compile {engine.stats.compile_s:.1f} s)")
        common.free_engine(engine)
        del engine
        common.free_device_memory()  # before the next arm's engine: two of 24 layers do not fit an 80 GB H100
    return rows


def peer_cpu_gbs(cfg, ncmoe: int, tok_s: float, layer_bytes: list[float] | None = None,
                 top_k: int | None = None) -> float:
    """A lower bound of llama.cpp's CPU expert rate at -ncmoe N: the experts its CPU reads per token (N layers'
    top-K experts, each read once; F16 of cfg, or a file's bytes of an expert per layer and its top_k) over the
    whole token's time (its GPU part and the hand-offs included)."""
    cpu_bytes = sum(layer_bytes[:ncmoe]) if layer_bytes else ncmoe * cfg.expert_bytes(2)
    return cpu_bytes * (top_k or cfg.num_experts_per_tok) * tok_s / 1e9


def peer_vram_share(ncmoe: int, layer_bytes: list[float]) -> float:
    """The share of the expert bytes llama.cpp keeps on the GPU at -ncmoe N (the first N layers' on the CPU)."""
    return sum(layer_bytes[ncmoe:]) / sum(layer_bytes)


def ours_pool_gbs(cfg, experts, itemsize: int) -> float | None:
    """Our host pool's rate over a request's decode: the cpu experts' bytes over the pool jobs' wall time."""
    if not experts.distinct_cpu or not experts.pool_s:
        return None
    return experts.distinct_cpu * cfg.expert_bytes(itemsize) / experts.pool_s / 1e9


def host_read_gbs(mib: int) -> tuple[float | None, int]:
    """GB/s of every usable core reading one array (strata_jax.host_pool.measure.read_gbps), and the threads."""
    from strata_jax.host_pool.measure import read_gbps
    from strata_jax.host_pool.pool import usable_cores
    threads = usable_cores()
    return (read_gbps(mib << 20, threads) if mib else None), threads


def run_quant(s, cfg, qtypes: list[str], peer_ok: bool, result: dict) -> dict:
    """--quant: each type's file made (llama-quantize), the peer's arms on every file first (JAX then takes the
    GPU's memory), then ours loading each; one table with a type column."""
    f16 = Path(s.gguf or f"/tmp/{s.model}-{cfg.num_layers}.gguf")
    quantize = s.llama_quantize or (str(Path(s.llama_bench).with_name("llama-quantize")) if s.llama_bench else "")
    by_type = result["types"] = {}
    for qtype in qtypes:
        path = quant_path(f16, qtype)
        if not path.is_file():
            if not (quantize and Path(quantize).is_file()):
                common.say(f"{qtype}: {path} not found and no llama-quantize ({quantize or 'none'}): skipped")
                continue
            ensure_gguf(s.model, cfg.num_layers, f16, s.gguf_py)
            path = ensure_quantized(quantize, f16, qtype)
        layer_bytes, top_k = layer_expert_bytes(path)
        entry = by_type[qtype] = dict(path=str(path), layer_expert_bytes=layer_bytes, top_k=top_k, peer=[], ours=[])
        if peer_ok:
            entry["peer"] = run_peer(s, path) + (run_peer_sampled(s, path) if s.peer_sampling else [])
    for i, (qtype, entry) in enumerate(by_type.items()):
        entry["ours"] = run_ours(s, cfg, model_path=Path(entry["path"]), warmup=i == 0)
    read = result["host_read_gbs"]
    rows = []
    for qtype, entry in by_type.items():
        layer_bytes = entry["layer_expert_bytes"]
        base = next((r["tok_s"] for r in entry["peer"] if r.get("ncmoe") == 0 and "tok_s" in r
                     and not r.get("sampled")), None)
        peer_at = {}  # VRAM share -> the peer's greedy tok/s there
        for r in entry["peer"]:
            share = peer_vram_share(r.get("ncmoe") or 0, layer_bytes)
            note = f"eval alone {r['eval_tok_s']:.1f} tok/s" if "eval_tok_s" in r else ""
            if "tok_s" in r and not r.get("sampled"):
                peer_at[share] = r["tok_s"]
            if r.get("ncmoe") and "tok_s" in r:
                r["cpu_gbs_at_least"] = peer_cpu_gbs(cfg, r["ncmoe"], r["tok_s"], layer_bytes, entry["top_k"])
                note += ("; " if note else "") + f"CPU experts >= {r['cpu_gbs_at_least']:.1f} GB/s" + (
                    f" ({r['cpu_gbs_at_least'] / read:.0%} of the host's read)" if read else "")
            ok = "tok_s" in r
            rows.append([qtype, "llama.cpp", r["arm"], 100 * share, r["tok_s"] if ok else r.get("error"),
                         1000 / r["tok_s"] if ok else "-", r["tok_s"] / base if base and ok else "-", "-", "-", "-",
                         note or "-"])
        for r in entry["ours"]:
            share = r["slots"] / r["experts"] if "slots" in r else 1.0
            same = next((tok for sh, tok in peer_at.items() if abs(sh - share) < 0.02), None)
            note = f"{r['expert_dtype']}; {r['windows']:.0f} windows" + (
                f", {r['drafts_accepted']:.0f}/{r['drafts_proposed']:.0f} drafts accepted" if r["drafts_proposed"]
                else "")
            if "slots" in r:
                note += f"; {r['slots']} slots, pcie_frac {r['pcie_frac']:g}"
                if r.get("pool_gbs"):
                    note += f"; pool {r['pool_gbs']:.1f} GB/s"
            rows.append([qtype, "strata_jax", r["arm"], 100 * share, r["tok_s"], 1000 / r["tok_s"],
                         r["tok_s"] / base if base else "-", r["tok_s"] / same if same else "-",
                         100 * r.get("hit_rate", 1.0), r["pcie_mb_per_token"], note])
    headers = ["type", "engine", "arm", "% expert bytes in VRAM", "tok/s", "ms/token", "x llama.cpp all-GPU",
               "x llama.cpp same VRAM", "hit rate (%)", "PCIe MB/token", "notes"]
    table = common.format_table(headers, rows)
    result["table"] = table
    layers = sorted({len(e["layer_expert_bytes"]) for e in by_type.values()})
    common.say(f"peer_bench --quant: llama-quantize {', '.join(by_type) or 'none'} of {f16} "
               f"({'/'.join(map(str, layers))} layers), on {result['device']['device_kind']}; {s.n_gen} new tokens per request")
    runner.emit(runner.rows_from_table(
        "peer_bench", headers, rows, params=["type", "engine", "arm"],
        fixed=dict(model=s.model, gguf=str(f16), n_gen=s.n_gen),
        timing="llama.cpp: llama-bench tg, mean of -r; strata_jax: Engine.generate's decode tok/s, median of --reps "
               "requests after a warm-up; both read the same quantized file", units={"PCIe MB/token": "MB"}),
        getattr(s, "output", "md"), table=table, result=result)
    common.say("both engines read each type's file (ours: Engine.from_pretrained, experts kept packed); the routing "
               "spread is the file's random routers (--embed_scale does not apply); x llama.cpp same VRAM: over the "
               "peer's -ncmoe arm keeping the same share of the expert bytes on the GPU (within 2 points); PCIe "
               "MB/token: our decode's expert fetches over the decode tokens (the peer's CPU experts cross no PCIe)")
    if s.json:
        common.write_json(s.json, result)
    return result


def run(s) -> dict:
    from strata_jax.model.config import preset
    cfg = preset(s.model, layers=s.layers or None)
    qtypes = parse_quant(s.quant)
    if qtypes and s.drop_gguf:
        raise ValueError("--drop_gguf: not with --quant (each type is made from the F16 GGUF as its arms run)")
    result = dict(benchmark="peer_bench", settings={n: getattr(s, n) for n in FLAGS}, peer=[], ours=[])
    read, threads = host_read_gbs(s.read_mib)
    result["host_read_gbs"], result["host_threads"] = read, threads
    peer_ok = bool(s.llama_bench) and Path(s.llama_bench).is_file()
    if s.llama_bench and not peer_ok:
        common.say(f"peer: {s.llama_bench} not found: our arms only (build it with benchmarks/peer/build_llama.sh)")
    if qtypes:
        result["device"] = common.device_info()
        return run_quant(s, cfg, qtypes, peer_ok, result)
    if peer_ok:
        gguf = ensure_gguf(s.model, cfg.num_layers, Path(s.gguf or f"/tmp/{s.model}-{cfg.num_layers}.gguf"),
                           s.gguf_py)
        result["peer"] = run_peer(s, gguf)
        if s.peer_sampling:
            result["peer"] += run_peer_sampled(s, gguf)
        if s.drop_gguf:  # the host's RAM for our arms (a file in /dev/shm is memory)
            gguf.unlink(missing_ok=True)
            common.say(f"peer: {gguf} deleted (--drop_gguf), before our arms")
    dev = common.device_info()
    result["device"] = dev
    result["ours"] = run_ours(s, cfg)
    base = next((r["tok_s"] for r in result["peer"] if r.get("ncmoe") == 0 and "tok_s" in r
                 and not r.get("sampled")), None)
    rows = []
    of_read = lambda gbs: f" ({gbs / read:.0%} of the host's read)" if read else ""
    for r in result["peer"]:
        note = f"eval alone {r['eval_tok_s']:.1f} tok/s" if "eval_tok_s" in r else "-"
        if r.get("ncmoe") and "tok_s" in r:
            r["cpu_gbs_at_least"] = peer_cpu_gbs(cfg, r["ncmoe"], r["tok_s"])
            note = (("" if note == "-" else note + "; ") + f"CPU experts >= {r['cpu_gbs_at_least']:.1f} GB/s"
                    + of_read(r["cpu_gbs_at_least"]))
        rows.append(["llama.cpp", r["arm"], r.get("tok_s", r.get("error")), 1000 / r["tok_s"] if "tok_s" in r else "-",
                     "1.00" if r.get("ncmoe") == 0 and "tok_s" in r and not r.get("sampled") else
                     (r["tok_s"] / base if base and "tok_s" in r else "-"), note])
    for r in result["ours"]:
        extra = (f"{r['windows']:.0f} windows, {r['drafts_accepted']:.0f}/{r['drafts_proposed']:.0f} drafts "
                 f"accepted" if r["drafts_proposed"] else f"{r['windows']:.0f} windows")
        if "slots" in r:
            extra += (f"; {r['slots']} slots, pcie_frac {r['pcie_frac']:g}, hit rate {r['hit_rate']:.1%}"
                      + ("" if r["native"] else ", graph offload path"))
            if r.get("pool_gbs"):
                extra += f"; pool {r['pool_gbs']:.1f} GB/s" + of_read(r["pool_gbs"])
        rows.append(["strata_jax", r["arm"], r["tok_s"], 1000 / r["tok_s"], r["tok_s"] / base if base else "-", extra])
    headers = ["engine", "arm", "tok/s", "ms/token", "x llama.cpp all-GPU", "notes"]
    table = common.format_table(headers, rows)
    result["table"] = table
    common.say(f"peer_bench: {s.model} cut to {cfg.num_layers} layers, bf16/F16, on {dev['device_kind']}; "
               f"{s.n_gen} new tokens per request")
    runner.emit(runner.rows_from_table(
        "peer_bench", headers, rows, params=["engine", "arm"],
        fixed=dict(model=s.model, layers=cfg.num_layers, n_gen=s.n_gen),
        timing="llama.cpp: llama-bench tg, mean of -r (sampled: llama-completion's eval + sampling time, median of "
               "--reps); strata_jax: Engine.generate's decode tok/s, median of --reps "
               "requests after a warm-up", units={"x llama.cpp all-GPU": "x"}),
        getattr(s, "output", "md"), table=table, result=result)
    common.say("llama.cpp: llama-bench tg (mean of -r; sampled rows: llama-completion, its eval + sampling time, "
               "median of --reps after a warm-up run); strata_jax: Engine.generate's decode tok/s (median of "
               "--reps requests after a warm-up; random weights, random prompt, stop tokens off)")
    if read:
        common.say(f"yardstick: the host reads {read:.1f} GB/s ({threads} threads reading one {s.read_mib} MiB array, "
                   f"this run); llama.cpp's CPU experts: at least N layers x top-{cfg.num_experts_per_tok} F16 experts "
                   f"a token at its tok/s; our pool: its cpu experts' bytes over its jobs' wall time")
    if s.json:
        common.write_json(s.json, result)
    return result


def main(argv: list[str]) -> dict:
    return common.run_main(FLAGS, argv, "benchmarks.peer_bench", run)


if __name__ == "__main__":
    main(sys.argv)
