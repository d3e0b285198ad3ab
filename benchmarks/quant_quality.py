"""How far each low-bit expert format (strata_jax/model/quant.py) moves the output: every routed expert's gate, up and
down matrices quantized and dequantized, then teacher-forced logits of one known text against the checkpoint's own
weights: KL(base || format), top-1 agreement, perplexity, beside the stored bits per weight and what the experts of
the Qwen3-30B-A3B shape would take in host RAM.

    python -m benchmarks.quant_quality --models=reference,reference-next --json=out/quant_quality.json
    python -m benchmarks.quant_quality --formats= --kv_dtype=int8    # the int8 KV cache alone (kv_dtype=int8)
    python -m benchmarks.quant_quality --formats= --gguf_types=Q4_K_M,Q2_K,IQ2_XS \
        --llama_quantize=/tmp/llama.cpp/build/bin/llama-quantize       # llama.cpp's types, as users' GGUFs hold them

A quality study ahead of the engine's `expert_dtype` (issue 16): the weights here are dequantized to float32 before
the forward, so it measures what the formats lose, not their speed or memory. The forward is the engine's prefill
path in float32 with every expert resident; the text (--text_file, default this repository's
strata_jax/offload/slots.py) is not in the reference models' training data. A format whose group does not divide a
matrix's input dimension (the reference's experts are 96 wide) is shown as n/a.

--gguf_types (issue 36): the GGUF types users download, made by llama.cpp itself and read by the engine as a user's
file is. Each model is written as an F32 GGUF laid out as convert_hf_to_gguf does (strata_jax/io/gguf_write.py; the
bf16 checkpoint's values exactly); llama-imatrix (beside --llama_quantize) makes an importance matrix from
--imatrix_text (not the scored text); llama-quantize makes each type; each file is loaded with
`Engine.from_pretrained(path, dtype="float32", expert_cache_slots="all")` (expert_dtype auto: experts kept packed
where a format holds their types) and scored on the same ids against the F32 GGUF's engine. The table gives the
types the file holds per expert family (llama-quantize falls back to other types for rows its type cannot take:
the reference's down matrices are 96 wide, not a multiple of the K types' 256), their bits per weight as stored,
and what the engine holds (its start-up `gguf:` line). A step llama.cpp fails (an architecture it cannot load) is
a row saying so.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from absl import flags

from benchmarks import common, runner

REPO = Path(__file__).resolve().parent.parent

FLAGS = flags.FlagValues()
flags.DEFINE_string("models", "reference,reference-next", "Models, comma-separated: reference, reference-next or "
                    "folders.", flag_values=FLAGS)
flags.DEFINE_string("formats", "int8,int4-g32,int4,int4-g128,int4-asym,int3,int2", "Formats, comma-separated "
                    "(strata_jax.model.quant.FORMATS).", flag_values=FLAGS)
flags.DEFINE_string("kv_dtype", "", "Also a row for the engine's KV cache stored this way (int8: kv_dtype=int8, "
                    "the experts unquantized), against the unquantized cache; '' = none.", flag_values=FLAGS)
flags.DEFINE_string("text_file", str(REPO / "strata_jax" / "offload" / "slots.py"), "The known text.",
                    flag_values=FLAGS)
flags.DEFINE_integer("positions", 1200, "Positions scored.", lower_bound=2, flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)
flags.DEFINE_string("cache_dir", "", "Engine cache_dir ('' = ~/.cache/strata_jax).", flag_values=FLAGS)
flags.DEFINE_string("gguf_types", "", "llama-quantize types, comma-separated (e.g. Q4_K_M,Q2_K,IQ2_XS): each model "
                    "as an F32 GGUF, quantized by --llama_quantize, loaded by the engine, scored against the F32 "
                    "GGUF; '' = none.", flag_values=FLAGS)
flags.DEFINE_string("llama_quantize", "", "llama.cpp's llama-quantize (needed by --gguf_types).", flag_values=FLAGS)
flags.DEFINE_string("llama_imatrix", "", "llama.cpp's llama-imatrix ('' = beside --llama_quantize; 'none' = no "
                    "importance matrix: IQ2 types then fail).", flag_values=FLAGS)
flags.DEFINE_string("imatrix_text", "", "The importance matrix's text ('' = this repository's strata_jax/*.py, "
                    "the scored --text_file left out).", flag_values=FLAGS)
flags.DEFINE_integer("imatrix_chunks", 32, "llama-imatrix --chunks (of 256 tokens).", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_string("gguf_dir", "", "Where the GGUFs are written ('' = a temporary folder, removed after).",
                    flag_values=FLAGS)

# Qwen3-30B-A3B's routed experts: 48 layers x 128 experts x (gate, up: 768 x 2048; down: 2048 x 768)
SHAPE_30B = dict(layers=48, experts=128, hidden=2048, inter=768)


def expert_leaves(weights):
    """[(layer position, MoEWeights)] of the sparse layers (list or stacked form)."""
    from strata_jax.model import moe
    layers = [weights.layers] if weights.stacked else weights.layers
    return [(i, layer.ffn) for i, layer in enumerate(layers) if isinstance(layer.ffn, moe.MoEWeights)]


def with_experts(weights, new_ffn: dict):
    """weights with the MoEWeights at the given layer positions replaced."""
    if weights.stacked:
        return weights.replace(layers=weights.layers.replace(ffn=new_ffn[0]))
    return weights.replace(layers=[layer.replace(ffn=new_ffn[i]) if i in new_ffn else layer
                                   for i, layer in enumerate(weights.layers)])


def host_gb_30b(fmt) -> float:
    """GB of Qwen3-30B-A3B's routed experts in fmt (gate and up read 2048 inputs, down 768)."""
    h, i = SHAPE_30B["hidden"], SHAPE_30B["inter"]
    bits = 2 * h * i * fmt.bits_per_weight(h) + h * i * fmt.bits_per_weight(i)
    return SHAPE_30B["layers"] * SHAPE_30B["experts"] * bits / 8 / 1e9


def compare(base, logits, targets) -> dict:
    """KL(base || q) per position (nats), top-1 agreement, perplexity of the targets under q."""
    import numpy as np

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = log_softmax(base.astype(np.float64)), log_softmax(logits.astype(np.float64))
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    nll = -lq[np.arange(targets.size), targets]
    return dict(kl_mean=float(kl.mean()), kl_p99=float(np.quantile(kl, 0.99)),
                top1=float(np.mean(base.argmax(-1) == logits.argmax(-1))), ppl=float(np.exp(nll.mean())))


# ---- --gguf_types: llama.cpp's types -----------------------------------------------------------------------------

EXPERT_TENSOR = r"\.ffn_(gate|up|down|gate_up)_exps\.weight$"  # routed experts (not the shared expert's _shexp)
GGUF_HEADERS = ["model", "GGUF type", "experts in the file (gate, up, down)", "experts bits/weight",
                "engine holds (experts)", "KL mean", "KL p99", "top-1", "perplexity", "F32 GGUF perplexity"]


def _tool_error(proc, tool: str) -> str:
    """The last stderr lines of a failed llama.cpp tool that say why (its errors end its log)."""
    lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
    why = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower() or "unknown" in ln.lower()]
    why = [ln for ln in why if "failed to quantize:" in ln] or why  # llama-quantize's reason, before its last line
    return f"{tool} failed ({proc.returncode}): {(why[:1] or lines[-1:] or ['?'])[0][:300]}"


def _run_tool(cmd: list, tool: str) -> None:
    import subprocess
    common.progress(f"{tool}: {' '.join(map(str, cmd))}")
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace",
                          stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise RuntimeError(_tool_error(proc, tool))


def write_f32_gguf(folder: Path, out: Path, merge: bool = False) -> None:
    """The model folder's checkpoint as an F32 GGUF laid out as convert_hf_to_gguf does (qwen3moe or qwen3next),
    its tokenizer.json as _set_vocab_gpt2 writes it. merge: with one merge of two bytes no text holds (llama.cpp
    refuses a BPE vocabulary without merges; the engine refuses a merge whose result is not a token): the file
    for llama-imatrix alone; llama-quantize reads no vocabulary."""
    import json
    import logging
    import re

    import numpy as np
    from safetensors.numpy import load_file

    from strata_jax.io import gguf_write
    from strata_jax.io.tokenizer import bytes_to_unicode
    raw = json.loads((folder / "config.json").read_text())
    hub = {}
    for f in sorted(folder.glob("*.safetensors")):
        hub.update({k: v.astype(np.float32) for k, v in load_file(f).items()})  # bf16 -> f32: exact
    tok = gguf_write.hf_tokenizer_metadata(folder, raw["vocab_size"])
    logging.getLogger("gguf.vocab").setLevel(logging.ERROR)  # "no merges found": a byte-level vocabulary has none

    def metadata(w):
        tok(w)
        if merge:
            b2u = bytes_to_unicode()
            w.add_token_merges([f"{b2u[0xFE]} {b2u[0xFF]}"])
    if raw.get("model_type") == "qwen3_next":
        gguf_write.qwen3next_gguf(out, raw, hub, metadata=metadata)
        return
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if any(re.search(r"\.mlp\.experts\.\d+\.", k) for k in hub):
        hub = gguf_write.stacked(hub, raw["num_hidden_layers"], experts)
    gguf_write.write_gguf(out, raw, hub, metadata=metadata)


def expert_types(path: Path) -> dict:
    """The routed experts' tensor types as the file holds them, per family (gate, up, down; gate_up when fused),
    and their bits per weight as stored (block scales included)."""
    import re

    import gguf
    fams, nbytes, nweights = {}, 0, 0
    for t in gguf.GGUFReader(path).tensors:
        m = re.search(EXPERT_TENSOR, t.name)
        if m:
            fams.setdefault(m.group(1), set()).add(t.tensor_type.name)
            nbytes += int(t.n_bytes)
            nweights += int(t.n_elements)
    order = ["gate", "up", "gate_up", "down"]
    return dict(families={k: sorted(fams[k]) for k in sorted(fams, key=order.index)},
                bits_per_weight=8 * nbytes / max(nweights, 1))


def held_experts(line: str) -> str:
    """What the start-up `gguf:` line says the engine holds of the experts: 'int4-q4k' or
    'gate/up int2-q2k, down int8-g16m' (the format after '->' per expert part)."""
    import re
    parts = re.findall(r"experts(?: (gate/up|down))? \S+ \([\d.]+ bpw\) -> (\S+)", line)
    return ", ".join(f"{fam} {fmt.rstrip(',;')}" if fam else fmt.rstrip(",;") for fam, fmt in parts) or "?"


def gguf_engine(path: Path, s):
    """A GGUF loaded as a user loads it, and its start-up `gguf:` line (the types read, the formats held)."""
    from strata_jax.offload import placement as placement_mod
    from strata_jax.engine.api import Engine
    from strata_jax.io import gguf_file
    eng = Engine.from_pretrained(str(path), verbose=False, expert_cache_slots="all", dtype="float32",
                                 cache_dir=s.cache_dir)
    lines = []
    gguf_file.say_formats(eng.model_dir, "float32", placement_mod.expert_format(eng.options, eng.cfg), lines.append)
    return eng, (lines[0] if lines else "")


def imatrix_text(s, work: Path) -> Path:
    if s.imatrix_text:
        return Path(s.imatrix_text)
    scored = Path(s.text_file).resolve()
    files = [f for f in sorted((REPO / "strata_jax").glob("*.py")) if f.resolve() != scored]
    out = work / "imatrix.txt"
    out.write_text("\n".join(f.read_text() for f in files))
    return out


def gguf_rows(s, name: str, folder: Path, ids, base, targets, qtypes: list[str], work: Path, rows: list,
              result: dict) -> None:
    """--gguf_types for one model: the F32 GGUF (its row: against the checkpoint's engine, `base`), the
    importance matrix, each type quantized, loaded and scored against the F32 GGUF's engine."""
    import gc
    stem = work / Path(name).name
    f32 = stem.with_name(stem.name + "-F32.gguf")

    def add(qtype, why=None, info=None, held="-", m=None, ref_ppl=None):
        info = info or {}
        fams = "; ".join(f"{k} {'+'.join(v)}" for k, v in info.get("families", {}).items()) or "-"
        row = dict(model=name, gguf_type=qtype, applicable=why is None, why=why, families=info.get("families"),
                   bits_per_weight=info.get("bits_per_weight"), engine_holds=held, ref_ppl=ref_ppl, **(m or {}))
        result["gguf_rows"].append(row)
        if why is not None:
            bpw = info.get("bits_per_weight", "-")
            rows.append([name, qtype, fams, bpw, why, "-", "-", "-", "-", "-"])
            common.progress(f"{name} {qtype}: {why}")
            return
        rows.append([name, qtype, fams, info["bits_per_weight"], held, m["kl_mean"], m["kl_p99"], m["top1"],
                     m["ppl"], ref_ppl])
        common.progress(f"{name} {qtype}: experts {fams} ({info['bits_per_weight']:.2f} bpw) -> {held}: "
                        f"KL {m['kl_mean']:.4f}, top-1 {m['top1']:.3f}")

    t0 = time.perf_counter()
    write_f32_gguf(folder, f32)
    eng, line = gguf_engine(f32, s)
    if eng.encode(Path(s.text_file).read_text())[:ids.size] != ids.tolist():
        common.say(f"{name}: the F32 GGUF's tokenizer gives other ids than the checkpoint's; scored on the "
                   "checkpoint's ids")
    ref = eng.prefill_logits(ids[:-1])
    del eng
    gc.collect()
    m = compare(base, ref, targets)
    ref_ppl = m["ppl"]
    add("F32 (vs the checkpoint)", info=expert_types(f32), held=held_experts(line), m=m, ref_ppl=ref_ppl)
    common.progress(f"{name}: F32 GGUF written and scored ({time.perf_counter() - t0:.0f} s)")

    imatrix_bin = s.llama_imatrix or str(Path(s.llama_quantize).with_name("llama-imatrix"))
    imatrix = None
    if imatrix_bin != "none":
        if not Path(imatrix_bin).is_file():
            common.say(f"no llama-imatrix at {imatrix_bin}: quantizing without an importance matrix")
        else:
            merged = stem.with_name(stem.name + "-F32-merge.gguf")
            write_f32_gguf(folder, merged, merge=True)
            imatrix = stem.with_name(stem.name + "-imatrix.gguf")
            try:
                _run_tool([imatrix_bin, "-m", merged, "-f", imatrix_text(s, work), "-o", imatrix, "-c", 256,
                           "--chunks", s.imatrix_chunks, "-t", 2, "--no-ppl"], "llama-imatrix")
            except RuntimeError as e:
                common.say(f"{name}: {e}; quantizing without an importance matrix")
                imatrix = None
            merged.unlink(missing_ok=True)
    for qtype in qtypes:
        t0 = time.perf_counter()
        out = stem.with_name(f"{stem.name}-{qtype}.gguf")
        info = None
        try:
            _run_tool([s.llama_quantize] + (["--imatrix", imatrix] if imatrix else []) + [f32, out, qtype, 2],
                      "llama-quantize")
            info = expert_types(out)
            eng, line = gguf_engine(out, s)
            m = compare(ref, eng.prefill_logits(ids[:-1]), targets)
            del eng
            gc.collect()
        except Exception as e:  # noqa: BLE001 - a row that says why, the other types still run
            add(qtype, why=str(e).splitlines()[0][:300] if str(e) else type(e).__name__, info=info)
            continue
        add(qtype, info=info, held=held_experts(line), m=m, ref_ppl=ref_ppl)
        result["gguf_rows"][-1]["gguf_line"] = line
        common.progress(f"{name} {qtype}: {time.perf_counter() - t0:.0f} s")


def run(s) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.model import quant
    from strata_jax.engine.api import Engine
    from strata_jax.errors import StrataError

    from benchmarks.runner import parse_list
    formats = [quant.get_format(n) for n in parse_list(s.formats, str, "formats")] if s.formats.strip() else []
    models = parse_list(s.models, str, "models")
    qtypes = [t.upper() for t in parse_list(s.gguf_types, str, "gguf_types")] if s.gguf_types else []
    if qtypes and not (s.llama_quantize and Path(s.llama_quantize).is_file()):
        raise StrataError(f"--gguf_types needs --llama_quantize=PATH, llama.cpp's llama-quantize (not found: "
                          f"{s.llama_quantize or 'none given'})")
    try:
        text = Path(s.text_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"cannot read --text_file {s.text_file}: {e}") from None
    result = dict(benchmark="quant_quality", settings={n: getattr(s, n) for n in FLAGS},
                  device=common.device_info(), rows=[], gguf_rows=[])
    rows, grows = [], []
    work_tmp = None
    if qtypes:
        import tempfile
        from strata_jax.io.embedded import resolve_model
        work_tmp = None if s.gguf_dir else tempfile.TemporaryDirectory(prefix="quant_quality_gguf_")
        work = Path(s.gguf_dir or work_tmp.name)
        work.mkdir(parents=True, exist_ok=True)
    for name in models:
        t0 = time.perf_counter()
        eng = Engine.from_pretrained(name, verbose=False, expert_cache_slots="all", dtype="float32",
                                     cache_dir=s.cache_dir)
        ids = np.asarray(eng.encode(text)[:s.positions + 1], np.int32)
        targets = ids[1:]
        base = eng.prefill_logits(ids[:-1])
        base_weights = eng.weights
        original = {i: ffn for i, ffn in expert_leaves(base_weights)}
        base_ppl = compare(base, base, targets)["ppl"]
        common.progress(f"{name}: {len(original)} expert stacks, {targets.size} positions, base perplexity "
                        f"{base_ppl:.3f} ({time.perf_counter() - t0:.0f} s)")
        for fmt in formats:
            t0 = time.perf_counter()
            new, err_num, err_den, nbits, nweights = {}, 0.0, 0.0, 0.0, 0
            try:
                for i, ffn in original.items():
                    parts = {}
                    for which in ("gate", "up", "down"):
                        w = np.asarray(getattr(ffn, which), np.float32)  # [..., E, O, I]
                        qa = quant.quantize(w, fmt)
                        back = quant.dequantize(qa)
                        err_num += float(np.sum((back - w) ** 2))
                        err_den += float(np.sum(w ** 2))
                        nbits += fmt.bits_per_weight(w.shape[-1]) * w.size  # packed, as the format stores
                        nweights += w.size
                        parts[which] = jnp.asarray(back)
                    new[i] = ffn.replace(**parts)
            except ValueError as e:  # a group that does not divide an input dimension
                row = dict(model=name, format=fmt.name, applicable=False, why=str(e))
                rows.append([name, fmt.name, "n/a", "n/a", "-", "-", "-", "-", "-", host_gb_30b(fmt)])
                result["rows"].append(row)
                common.progress(f"{name} {fmt.name}: n/a ({e})")
                continue
            eng.weights = with_experts(base_weights, new)
            m = compare(base, eng.prefill_logits(ids[:-1]), targets)
            eng.weights = base_weights
            bpw = nbits / nweights
            host_gb = host_gb_30b(fmt)
            row = dict(model=name, format=fmt.name, applicable=True, bits_per_weight=bpw,
                       weight_rel_err=(err_num / err_den) ** 0.5, host_gb_30b=host_gb, base_ppl=base_ppl, **m)
            result["rows"].append(row)
            rows.append([name, fmt.name, bpw, row["weight_rel_err"], m["kl_mean"], m["kl_p99"], m["top1"],
                         m["ppl"], base_ppl, host_gb])
            common.progress(f"{name} {fmt.name}: KL {m['kl_mean']:.4f}, top-1 {m['top1']:.3f} "
                            f"({time.perf_counter() - t0:.0f} s)")
        if s.kv_dtype:  # the same prefill path with the KV cache quantized as written (experts as the checkpoint)
            t0 = time.perf_counter()
            kv_eng = Engine.from_pretrained(name, verbose=False, expert_cache_slots="all", dtype="float32",
                                            cache_dir=s.cache_dir, kv_dtype=s.kv_dtype)
            m = compare(base, kv_eng.prefill_logits(ids[:-1]), targets)
            del kv_eng
            row = dict(model=name, format=f"kv {s.kv_dtype}", applicable=True, base_ppl=base_ppl, **m)
            result["rows"].append(row)
            rows.append([name, f"kv {s.kv_dtype}", "-", "-", m["kl_mean"], m["kl_p99"], m["top1"], m["ppl"],
                         base_ppl, "-"])
            common.progress(f"{name} kv {s.kv_dtype}: KL {m['kl_mean']:.6f}, top-1 {m['top1']:.3f} "
                            f"({time.perf_counter() - t0:.0f} s)")
        if qtypes:
            folder = resolve_model(name, eng.options.resolved_cache_dir())
            del eng
            gguf_rows(s, name, folder, ids, base, targets, qtypes, work, grows, result)
    headers = ["model", "format", "bits/weight", "weight rel err", "KL mean", "KL p99", "top-1", "perplexity",
               "bf16 perplexity", "30B experts GB"]
    result["table"] = common.format_table(headers, rows)
    result["bench_rows"] = [r.to_dict() for r in runner.rows_from_table(
        "quant_quality", headers, rows, params=["model", "format"], units={"30B experts GB": "GB"})]
    common.say(f"KL(checkpoint || format) in nats per position, teacher-forced, float32 prefill path, every expert "
               f"resident; {s.positions} positions of {s.text_file}")
    runner.emit([runner.Row(**r) for r in result["bench_rows"]], getattr(s, "output", "md"), table=result["table"])
    common.say("bits/weight: bits per expert weight as the format stores them packed, scales and minima included "
               "(2 and 3 bits are not packed by the engine yet); 30B experts GB: Qwen3-30B-A3B's routed experts (48 x "
               "128 x 3 matrices of 768 x 2048) in that format (bf16: 57.98 GB)")
    if qtypes:
        result["gguf_table"] = common.format_table(GGUF_HEADERS, grows)
        common.say(f"llama.cpp's GGUF types ({s.llama_quantize}): KL(F32 GGUF || type) in nats per position, the "
                   "same ids; experts bits/weight: the routed experts as the file stores them; engine holds: the "
                   "expert format of the start-up gguf: line (expert_dtype auto)")
        runner.emit([runner.Row(**r) for r in [r.to_dict() for r in runner.rows_from_table(
            "quant_quality_gguf", GGUF_HEADERS, grows, params=["model", "GGUF type"])]],
            getattr(s, "output", "md"), table=result["gguf_table"])
        if work_tmp is not None:
            work_tmp.cleanup()
    if s.json:
        common.write_json(s.json, result)
        common.say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    return common.run_main(FLAGS, argv, "benchmarks.quant_quality", run)


if __name__ == "__main__":
    main(sys.argv)
