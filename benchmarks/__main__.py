"""One entry point for every benchmark: `python -m benchmarks SUITE [its flags]`; `python -m benchmarks` lists the
suites. Each suite is one program over the one runner (benchmarks/runner.py: list flags, one row schema,
--output=md|json|csv); `python -m benchmarks SUITE --help` gives its flags. The programs also run by their own
module names (`python -m benchmarks.decode_bench`), as the GPU scripts in benchmarks/ and benchmarks/results/ do."""
from __future__ import annotations

import runpy
import sys

# suite -> (module, what it answers); grouped as the README's benchmark table
SUITES = {
    # speed, beside the roofline and the peer
    "decode": ("decode_bench", "decode tok/s, every expert resident, beside the HBM roofline"),
    "offload": ("offload_bench", "decode tok/s by expert cache size x PCIe share, the bytes bound, the hit rate"),
    "peer": ("peer_bench", "our generate loop beside llama.cpp's llama-bench on the same shape and VRAM share"),
    "long-context": ("long_context_bench", "time to first token and decode deep in the context, beside llama-bench"),
    "parallel": ("parallel_bench", "decode split over several devices against one"),
    "batch": ("batch_bench", "aggregate decode tok/s of B sequences at once (generate_batch) beside one alone"),
    "serve": ("serve_bench", "the server under 1..N concurrent openai clients: aggregate tok/s, TTFT, streams done"),
    "agent-turns": ("agent_turns_bench", "A/B of whole engine runs over simulated coding-agent sessions"),
    "hf": ("hf_decode", "the Hugging Face transformers baseline on the same shape"),
    # where the time goes
    "phases": ("phase_bench", "a decode window's phases, each timed as its own graph"),
    "profile": ("profile_window", "a window's device time by named scope, from the JAX profiler"),
    "dense": ("dense_bench", "the attention projections at T rows by formulation, beside the roofline"),
    "expert-ffn": ("expert_ffn_bench", "the expert FFN kernel beside XLA and the roofline (bf16, int8, int4)"),
    "kernel-sweep": ("kernel_sweep", "the decode kernels' knobs searched, compiled in parallel: STRATA_KERNEL_TUNING's file"),
    "delta": ("delta_bench", "Qwen3-Next's delta rule step: XLA beside Pallas and the roofline"),
    "route-prior": ("route_prior_bench", "the route prior kernel's cost per MoE layer"),
    "gguf-load": ("gguf_load_bench", "a synthetic quantized GGUF's load time by dequantizing threads (CPU)"),
    # what the approximations and formats cost in output
    "quant-quality": ("quant_quality", "KL / top-1 / perplexity of each low-bit expert format"),
    "kl-arms": ("kl_arms", "the KL table of every approximation"),
    "kl-report": ("kl_report", "KL / top-1 / perplexity from logpos files"),
    "trade-table": ("trade_table", "each approximation's KL beside its decode ratio"),
    # checks
    "offload-smoke": ("offload_smoke", "a quick end-to-end offload run on a real shape"),
    "faults": ("fault_sweep", "bad inputs and faults through the CLI and the API, each classed"),
    "rounding": ("rounding_check", "how far the logits move with graph, kernels and placement"),
    "soak": ("soak", "many mixed requests on one engine: reproducible, memory flat"),
    "plot-offload": ("plot_offload", "plot offload results (matplotlib)"),
}


def usage() -> str:
    width = max(map(len, SUITES))
    return "\n".join(["usage: python -m benchmarks SUITE [flags]   (SUITE --help: its flags)", "", "suites:"]
                     + [f"  {name.ljust(width)}  {what}" for name, (_, what) in SUITES.items()])


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help", "list"):
        print(usage())
        return 0
    name = argv[1]
    if name not in SUITES:
        print(f"error: no benchmark suite {name!r} (python -m benchmarks lists them)", file=sys.stderr)
        return 2
    module = f"benchmarks.{SUITES[name][0]}"
    sys.argv = [module] + argv[2:]  # absl reads the suite's flags from sys.argv
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
