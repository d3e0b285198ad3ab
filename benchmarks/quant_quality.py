"""How far each low-bit expert format (strata_jax/model/quant.py) moves the output: every routed expert's gate, up and
down matrices quantized and dequantized, then teacher-forced logits of one known text against the checkpoint's own
weights: KL(base || format), top-1 agreement, perplexity, beside the stored bits per weight and what the experts of
the Qwen3-30B-A3B shape would take in host RAM.

    python -m benchmarks.quant_quality --models=reference,reference-next --json=out/quant_quality.json
    python -m benchmarks.quant_quality --formats= --kv_dtype=int8    # the int8 KV cache alone (kv_dtype=int8)

A quality study ahead of the engine's `expert_dtype` (issue 16): the weights here are dequantized to float32 before
the forward, so it measures what the formats lose, not their speed or memory. The forward is the engine's prefill
path in float32 with every expert resident; the text (--text_file, default this repository's
strata_jax/offload/slots.py) is not in the reference models' training data. A format whose group does not divide a
matrix's input dimension (the reference's experts are 96 wide) is shown as n/a.
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


def run(s) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.model import quant
    from strata_jax.engine.api import Engine
    from strata_jax.errors import StrataError

    from benchmarks.runner import parse_list
    formats = [quant.get_format(n) for n in parse_list(s.formats, str, "formats")]
    models = parse_list(s.models, str, "models")
    try:
        text = Path(s.text_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"cannot read --text_file {s.text_file}: {e}") from None
    result = dict(benchmark="quant_quality", settings={n: getattr(s, n) for n in FLAGS},
                  device=common.device_info(), rows=[])
    rows = []
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
    if s.json:
        common.write_json(s.json, result)
        common.say(f"json: {s.json}")
    return result


def main(argv: list[str]) -> dict:
    return common.run_main(FLAGS, argv, "benchmarks.quant_quality", run)


if __name__ == "__main__":
    main(sys.argv)
