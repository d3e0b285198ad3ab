"""Where one decode window's device time goes, by the model's named scopes (`layer3/attention`, `moe_route`,
`moe_experts`, `moe_fetch`, ...): the engine's own decode_window graph run under the JAX profiler, each executed
XLA op's time attributed to the scope its HLO instruction came from.

    python -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=8 --windows=1,4 --json=out/profile.json

Method: compile the window graph, read every HLO instruction's `op_name` metadata from the compiled module (the
jax.named_scope path), run --iters windows inside `jax.profiler.trace`, then sum the events that carry `hlo_op` /
`hlo_module` stats (the XLA thunks on a CPU; the GPU kernels on a GPU's device planes, when it has them) per phase:
the scope path without the `layerN` part and the op itself (e.g. `attention`, `moe_experts`). Op time only: the
gaps between ops (launch latency, host waits) are the difference to the window's wall time, printed beside.
Options as the engine's: --expert_kernel / --attention_kernel pick the Pallas kernels.
"""
from __future__ import annotations

import collections
import glob
import re
import sys
import tempfile
import time

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "tiny", "Model preset from configs/.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Cut the model to its first N layers (0 = all).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("windows", "1,4", "Window sizes T.", flag_values=FLAGS)
flags.DEFINE_integer("context", 2048, "KV cache length.", lower_bound=16, flag_values=FLAGS)
flags.DEFINE_integer("pos", 512, "Window position.", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer("iters", 10, "Windows run inside the trace.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights and activations.", flag_values=FLAGS)
flags.DEFINE_enum("expert_kernel", "auto", ["auto", "xla", "pallas"], "Expert FFN (pallas: bf16).", flag_values=FLAGS)
flags.DEFINE_enum("route_kernel", "xla", ["xla", "pallas"], "The Pallas expert path's route: XLA's softmax and "
                  "sort, or softmax and top-K in one Pallas kernel (pallas_kernels/route_topk.py; engine option "
                  "route_kernel).", flag_values=FLAGS)
flags.DEFINE_enum("attention_kernel", "auto", ["auto", "xla", "pallas"], "Attention.", flag_values=FLAGS)
flags.DEFINE_enum("dense_kernel", "auto", ["auto", "xla", "pallas"], "Attention products (q/k/v, o): "
                  "pallas_kernels/stacked_linear.py (scanned: the stacks read in place) or XLA's.", flag_values=FLAGS)
flags.DEFINE_enum("layer_loop", "scan", ["scan", "unrolled"], "Layers scanned over stacked weights (the engine's "
                  "default) or unrolled.", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write the numbers to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)
HEADERS = ["phase (named scope)", "us per window", "us per layer", "share of op time"]

_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r'(?:calls|to_apply)=%?([\w.\-]+)')  # fusions, and calls (command buffers wrap thunks in calls)
_TRITON_NAME = re.compile(r'\\?"name\\?"\s*:\s*\\?"([\w.\-]+)\\?"')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_LAYER = re.compile(r"^layer\d*$")  # layerN (unrolled) or layer (the scanned body)


def scope_of(op_name: str) -> str:
    """'jit(decode_window)/layer3/moe_experts/dot_general' -> 'moe_experts' (the scope path without the jit,
    the layer and the op itself; '(outside the layers)' when no scope is left)."""
    parts = [p for p in op_name.split("/")[1:-1] if not _LAYER.match(p) and "->" not in p]  # no einsum specs
    parts = [p for p in parts if not p.startswith(("jit(", "pjit(", "eval_jaxpr", "while", "cond", "body", "branch", "closed_call",
                                                  "remat", "checkpoint", "jvp(", "transpose("))]
    return "/".join(parts) or "(outside the layers)"


def instruction_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its scope, from the compiled module's metadata. A fusion (or call) without metadata
    of its own takes the most common scope of the computation it calls."""
    own: dict[str, str] = {}
    calls: dict[str, str] = {}
    computation_scopes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    custom_lines: list[tuple[str, str]] = []  # (a custom call's line, its scope): a kernel name may sit anywhere in it
    current = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("{")[0]:
            current = head.group(1)
            continue
        inst = _INSTRUCTION.match(line)
        if not inst:
            continue
        name = inst.group(1)
        op = _OP_NAME.search(line)
        if op:
            own[name] = scope_of(op.group(1))
            if current:
                computation_scopes[current][own[name]] += 1
        called = _CALLS.search(line)
        if called:
            calls[name] = called.group(1)
        kernel = _TRITON_NAME.search(line) if "custom_call_target" in line else None
        if kernel and name in own:  # a Pallas kernel: its launches are named after the kernel, not the instruction
            own.setdefault(kernel.group(1), own[name])
        if "custom_call_target" in line and name in own:
            custom_lines.append((line, own[name]))
    for name, callee in calls.items():
        if name not in own and computation_scopes.get(callee):
            own[name] = computation_scopes[callee].most_common(1)[0][0]
    # A GPU kernel is named after its fusion with '.' and '-' made '_': the fallback key when an event's hlo_op is a
    # command buffer (one thunk running many kernels) rather than the kernel's own instruction.
    for name in list(own):
        own.setdefault(_kernel_key(name), own[name])
    # Last, every identifier of a custom call's line (its backend config names the Pallas kernel in a form that
    # varies by version): only looked up by a launched kernel's exact name, and never over a real instruction's.
    stems = {re.split(r"[.]", n)[0] for n in own}  # 'loop_multiply_fusion' of 'loop_multiply_fusion.3': operands
    for line, scope in custom_lines:
        for word in set(re.findall(r"[A-Za-z_][\w]{5,}", line)) - stems:
            own.setdefault(word, scope)
    return own


def _kernel_key(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def scope_for(hlo_op: str, kernel: str, scopes: dict[str, str]) -> str | None:
    """The scope of one executed op: by its kernel's name first (exact inside command buffers), else its hlo_op."""
    for key in (kernel, _kernel_key(kernel), hlo_op, _kernel_key(hlo_op)):
        if key and key in scopes:
            return scopes[key]
    return None


def op_events(xplane_path: str, module_prefix: str) -> list[tuple[str, str, float]]:
    """(hlo_op, kernel name, duration ns) of the executed ops of the modules whose name starts with module_prefix;
    the GPU's device planes when they carry such events, else every plane (the CPU's thunks)."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(xplane_path)
    by_plane = collections.defaultdict(list)
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                stats = {k: v for k, v in ev.stats}
                if "hlo_op" in stats and str(stats.get("hlo_module", "")).startswith(module_prefix):
                    by_plane[plane.name].append((str(stats["hlo_op"]), str(ev.name), float(ev.duration_ns)))
    device = [p for p in by_plane if p.startswith("/device:GPU")]
    return [e for p in (device or list(by_plane)) for e in by_plane[p]]


def run(s) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.engine import graphs
    from strata_jax.model.kv_cache import init_cache
    from strata_jax.model.weights import can_stack, random_weights
    from strata_jax.model import moe
    from strata_jax.model.config import preset
    from strata_jax.errors import StrataError

    from strata_jax.engine.api import kernel_tuning_lines
    windows = common.int_list(s.windows, "windows")
    for line in kernel_tuning_lines():  # STRATA_KERNEL_TUNING applies here as at an Engine's start
        common.progress(line)
    cfg = preset(s.model, layers=s.layers or None)
    if s.pos + max(windows) > s.context:
        raise StrataError(f"--pos={s.pos} + the largest window exceed --context={s.context}")
    dtype = jnp.dtype(s.dtype)
    dev = common.device_info()
    interpret = dev["platform"] != "gpu"
    common.progress(f"profile_window: {s.model} x {cfg.num_layers} layers, {s.dtype}, on {dev['device_kind']}; "
                    f"kernels (expert, attention, dense) {common.kernels(s, cfg)}, route {s.route_kernel}")
    scanned = s.layer_loop == "scan" and can_stack(cfg)
    weights = random_weights(cfg, 0, dtype, stacked=scanned)
    expert_kernel, attention_kernel, dense_kernel = common.kernels(s, cfg)
    experts = (moe.ResidentExperts(cfg, interpret=interpret, route_kernel=s.route_kernel == "pallas")
               if expert_kernel == "pallas" else None)
    step = graphs.jit_decode_window(cfg, experts, attention_kernel=attention_kernel == "pallas",
                                    dense_kernel=dense_kernel == "pallas")
    rng = np.random.default_rng(0)
    result = dict(benchmark="profile_window", settings={n: getattr(s, n) for n in FLAGS}, device=dev, windows=[])
    bench_rows: list = []
    for t in windows:
        cache = init_cache(cfg, s.context, dtype, stacked=scanned)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=t), jnp.int32)
        pos = jnp.int32(s.pos)
        compiled = step.lower(weights, cache, tokens, pos).compile()
        scopes = instruction_scopes(compiled.as_text())
        for _ in range(2):  # warm up
            _, logits, cache = compiled(weights, cache, tokens, pos)
        jax.block_until_ready(logits)
        folder = tempfile.mkdtemp(prefix="profile_window_")
        t0 = time.perf_counter()
        with jax.profiler.trace(folder):
            for _ in range(s.iters):
                _, logits, cache = compiled(weights, cache, tokens, pos)
                jax.block_until_ready(logits)
        wall_ms = (time.perf_counter() - t0) / s.iters * 1e3
        files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        if not files:
            raise StrataError("the profiler wrote no trace")
        events = op_events(files[0], "jit_decode_window")
        per_scope: dict[str, float] = collections.defaultdict(float)
        unmatched: dict[str, float] = collections.defaultdict(float)
        by_kernel: dict[str, float] = collections.defaultdict(float)
        launches: dict[str, int] = collections.defaultdict(int)  # a kernel's launches a window
        for op, kernel, ns in events:
            scope = scope_for(op, kernel, scopes)
            by_kernel[f"{scope or '?'}: {kernel or op}"] += ns / s.iters / 1e3
            launches[f"{scope or '?'}: {kernel or op}"] += 1
            if scope is None:
                unmatched[f"{kernel} ({op})"] += ns / s.iters / 1e3
            per_scope[scope or "(no scope: compiler-inserted)"] += ns / s.iters / 1e3
        op_us = sum(per_scope.values())
        top_unmatched = sorted(unmatched.items(), key=lambda kv: -kv[1])[:8]
        top_kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]
        rows = sorted(per_scope.items(), key=lambda kv: -kv[1])
        cells = [[name, us, us / cfg.num_layers, us / op_us if op_us else 0.0] for name, us in rows]
        table = common.format_table(HEADERS, cells)
        bench_rows += runner.rows_from_table(
            "profile_window", HEADERS, cells, params=HEADERS[:1], fixed=dict(T=t, model=s.model, layers=cfg.num_layers),
            timing=f"the executed ops' own durations under the JAX profiler, mean over {s.iters} windows",
            units={"share of op time": ""})
        kernels = sum(1 for line in compiled.as_text().splitlines() if " fusion(" in line or "custom-call(" in line)
        common.say(f"T={t}: {kernels} fusions and custom calls in the compiled module ({s.layer_loop})")
        common.say(f"T={t}: window wall time {wall_ms * 1e3:,.0f} us under the profiler (synchronised, median of "
                   f"{s.iters} not taken: mean); op time {op_us:,.0f} us ({len(events) // s.iters} ops a window)")
        common.say(table)
        common.say("largest kernels (scope: kernel, us per window): "
                   + "; ".join(f"{k} {v:,.0f}" for k, v in top_kernels))
        if top_unmatched:
            common.say("ops without a scope, largest first: " + "; ".join(f"{k} {v:,.0f} us" for k, v in top_unmatched))
        common.say()
        result["windows"].append(dict(T=t, wall_us=wall_ms * 1e3, op_us=op_us, phases=dict(per_scope),
                                      ops_per_window=len(events) / s.iters, table=table,
                                      unmatched_us=dict(top_unmatched), top_kernels_us=dict(top_kernels),
                                      # every kernel: us a window and launches a window (a layer's small ops)
                                      kernels={k: dict(us=v, launches=launches[k] / s.iters)
                                               for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])}))
    result["bench_rows"] = [r.to_dict() for r in bench_rows]
    if getattr(s, "output", "md") != "md":  # md: the table of each T above
        runner.emit(bench_rows, s.output)
    common.say("op time: the executed XLA ops' own durations, by the named scope of their HLO instruction; the "
               "rest of the wall time is launch latency, host work and waits between ops")
    if s.json:
        common.write_json(s.json, result)
    return result


def main(argv: list[str]) -> dict:
    return common.run_main(FLAGS, argv, "benchmarks.profile_window", run)


if __name__ == "__main__":
    main(sys.argv)
