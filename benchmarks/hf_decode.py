"""The baseline beside strata_jax's decode step: Hugging Face transformers (torch) decoding the same model shape with
random weights, each available experts implementation, the fastest reported.

    python -m benchmarks.hf_decode --model=qwen3-30b-a3b --layers=8 --windows=1,2,4,8 --json=out/hf.json

Needs torch and transformers (not JAX): benchmarks/decode_bench.py runs it in a subprocess before it touches the
device (JAX would hold most of the GPU's memory otherwise) and prints the ratio to it. The KV cache is filled with
--pos random tokens once; each timed step runs a window of T random tokens at positions pos..pos+T-1
(`model(input_ids, past_key_values=cache)`), then crops the cache back to pos, synchronised, median of --iters.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from absl import flags

from benchmarks import common, runner

REPO = Path(__file__).resolve().parent.parent
FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "tiny", "Model preset from configs/ (its config.json).", flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Cut the model to its first N layers (0 = all).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("windows", "1,2,4", "Window sizes T, comma-separated.", flag_values=FLAGS)
flags.DEFINE_integer("pos", 512, "Tokens in the cache before the timed window.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("iters", 20, "Timed steps per (implementation, T).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("warmup", 3, "Untimed steps first.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights and activations.", flag_values=FLAGS)
flags.DEFINE_string("impls", "eager,batched_mm,grouped_mm", "Experts implementations to try (transformers' "
                    "`set_experts_implementation`); one the installed version lacks is reported and skipped.",
                    flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "torch seed of the weights and tokens.", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write the numbers to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)


def build_model(raw: dict, layers: int, dtype, device):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    raw = dict(raw, num_hidden_layers=layers or raw["num_hidden_layers"])
    raw.pop("architectures", None)
    raw.pop("model_type", None)
    config = Qwen3MoeConfig(**raw)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(dtype)
    return model.eval(), config


def time_windows(model, vocab: int, windows, pos: int, iters: int, warmup: int, device) -> dict[int, float]:
    """Median ms per window step for each T."""
    import torch
    from transformers import DynamicCache
    out = {}
    with torch.inference_mode():
        cache = DynamicCache()
        model(torch.randint(0, vocab, (1, pos), device=device), past_key_values=cache, use_cache=True)
        for t in windows:
            times = []
            for i in range(warmup + iters):
                ids = torch.randint(0, vocab, (1, t), device=device)
                sync(device)
                t0 = time.perf_counter()
                model(ids, past_key_values=cache, use_cache=True)
                sync(device)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
                cache.crop(-(cache.get_seq_length() - pos))  # a negative count works across versions
            out[t] = statistics.median(times)
    return out


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(s) -> dict:
    import warnings
    import torch
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    import transformers
    windows = common.int_list(s.windows, "windows")
    raw = json.loads((REPO / "configs" / f"{s.model}.json").read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if s.dtype == "bfloat16" else torch.float32
    torch.manual_seed(s.seed)
    common.progress(f"hf_decode: transformers {transformers.__version__}, torch {torch.__version__}, {device}; "
                    f"{s.model} cut to {s.layers or raw['num_hidden_layers']} layers, {s.dtype}, random weights")
    model, config = build_model(raw, s.layers, dtype, device)
    result = dict(benchmark="hf_decode", transformers=transformers.__version__, torch=torch.__version__,
                  device=str(device), device_name=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  settings={n: getattr(s, n) for n in FLAGS}, impls={}, skipped={})
    from benchmarks.runner import parse_list
    for impl in parse_list(s.impls, str, "impls"):
        try:
            model.set_experts_implementation(impl)
        except (AttributeError, ValueError, KeyError, ImportError) as e:
            result["skipped"][impl] = f"{type(e).__name__}: {e}".splitlines()[0]
            common.progress(f"  {impl}: skipped ({result['skipped'][impl]})")
            continue
        ms = time_windows(model, config.vocab_size, windows, s.pos, s.iters, s.warmup, device)
        result["impls"][impl] = {str(t): v for t, v in ms.items()}
        common.progress(f"  {impl}: " + ", ".join(f"T={t} {v:.2f} ms" for t, v in ms.items()))
    if not result["impls"]:
        raise ValueError("no experts implementation ran: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items()))
    best = {}
    for t in windows:
        impl = min(result["impls"], key=lambda i: result["impls"][i][str(t)])
        best[str(t)] = dict(impl=impl, ms=result["impls"][impl][str(t)])
    result["best"] = best
    rows = [[t, *(result["impls"][i][str(t)] for i in result["impls"]), best[str(t)]["impl"],
             t / best[str(t)]["ms"] * 1e3] for t in windows]
    table = runner.table(s, "hf_decode", ["T", *(f"{i} ms" for i in result["impls"]), "fastest", "tok/s (fastest)"],
                         rows, params=["T"], result=result, fixed=dict(model=s.model, pos=s.pos),
                         timing=f"one window step, synced, median of {s.iters} after {s.warmup} warm-up steps")
    result["table"] = table
    common.say(f"timing: one window step (model forward of T tokens on a cache of {s.pos}), synchronised, median of "
               f"{s.iters} after {s.warmup} warm-up steps")
    if s.json:
        common.write_json(s.json, result)
    return result


def main(argv: list[str]) -> dict:
    common.parse_flags(FLAGS, argv, prog="benchmarks.hf_decode")
    try:
        return run(FLAGS)
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv)
