"""The OpenAI-compatible server under concurrent clients (issue 38): aggregate and per-stream tok/s and time to first
token with 1, 2, 4, ... clients at once, every expert resident and offloaded, through HTTP on loopback.

    python -m benchmarks.serve_bench --model=tiny --clients=1,2 --new_tokens=8 --requests=2    # CPU, seconds
    python -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 --clients=1,2,4,8,16 \\
        --expert_cache_slots=all,25% --json=$OUT/serve.json                                        # a GPU

For each --expert_cache_slots arm: one engine over random weights (max_batch = the largest client count, or
--max_batch), served by strata_jax.serve's app (continuous batching) on a free loopback port in a thread, shut down
after the arm. Its tokenizer is a stand-in (token i reads ' w<i>'), so every token is one streamed piece. A warm-up
(each client count once, one request a client: the buckets it uses compile) is untimed. Then for each client
count C: C clients, each the official `openai` client in its own thread of one load-generator process (apart from
the server's, so that parsing the streams does not share its interpreter lock), each sending --requests streamed
completions one after another: --prompt random token ids (a fresh prompt each, no prefix reuse), max_tokens
--new_tokens, temperature 0, ignore_eos (every request runs to max_tokens).

Per request: time to first token (the request sent -> its first text chunk), the tokens (usage.completion_tokens),
its stream rate ((tokens - 1) / (last chunk - first chunk)); completed = a finish_reason and no error. Per C:
aggregate tok/s = every request's tokens / the wall time from the first request sent to the last stream's end;
x one client = that over the arm's C=1 aggregate; per-stream tok/s and TTFT: medians (and TTFT's p95) over the
requests. Target (issue 38): aggregate at 8 clients >= 4x one client all resident, >= 2x with offload.
"""
from __future__ import annotations

import statistics
import sys
import time

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "tiny", "Model preset from configs/ (a Qwen3-MoE shape: tiny, qwen3-30b-a3b).",
                    flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Cut the model to its first N layers (0 = all).", lower_bound=0, flag_values=FLAGS)
flags.DEFINE_string("clients", "1,2,4,8,16", "Concurrent client counts, comma-separated, each its own round.",
                    flag_values=FLAGS)
flags.DEFINE_integer("requests", 2, "Streamed requests each client sends, one after another.", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("prompt", 128, "Prompt tokens per request (random ids).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 128, "max_tokens of each request (ignore_eos: each runs to it).", lower_bound=2,
                     flag_values=FLAGS)
flags.DEFINE_integer("max_batch", 0, "The server's max_batch (0 = the largest client count).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_string("expert_cache_slots", "all,25%", "Arms, comma-separated, each its own engine and server: all "
                    "(every expert resident), a number of slots a layer, or a share of the experts (25%).",
                    flag_values=FLAGS)
flags.DEFINE_string("pcie_frac", "1", "With offload: the share of missed experts fetched over PCIe (0..1, or auto).",
                    flag_values=FLAGS)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weight, activation and KV cache dtype.",
                  flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the random weights and prompts.", flag_values=FLAGS)
flags.DEFINE_float("embed_scale", 50.0, "The random embedding scaled by this (50 spreads the routing over most "
                   "experts, as batch_bench).", flag_values=FLAGS)
flags.DEFINE_float("timeout", 600.0, "Seconds a request may take before the client gives up (counted as not "
                   "completed).", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_bool("warmup", True, "Each client count once first, one request a client, untimed (compiles).",
                  flag_values=FLAGS)
flags.DEFINE_string("cache_dir", "", "The engine's cache_dir ('' = its default).", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write every number to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)

HEADERS = ["slots", "clients", "aggregate tok/s", "x one client", "per-stream tok/s", "TTFT p50 ms", "TTFT p95 ms",
           "completed"]
TIMING = ("the openai client's streamed completions against strata_jax.serve on loopback: server + HTTP + SSE + "
          "tokenizer + batching, wall time from the first request sent to the last stream's end (warm graphs)")
MODEL_NAME = "bench"


# ---- the load generator (its own process) ---------------------------------------------------------------------------

def one_request(client, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: its timings (perf_counter seconds), tokens, finish_reason, error."""
    out = dict(start=time.perf_counter(), first=None, last=None, tokens=0, chunks=0, finish_reason=None, error=None)
    try:
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices or ():
                if choice.text:
                    out["chunks"] += 1
                    out["first"] = out["first"] or now
                    out["last"] = now
                if choice.finish_reason:
                    out["finish_reason"] = choice.finish_reason
            if chunk.usage is not None:
                out["tokens"] = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 (a failed stream is a result: not completed)
        out["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    out["end"] = time.perf_counter()
    if out["error"] is not None and not out["tokens"]:  # no usage chunk came: the streamed pieces (one a token)
        out["tokens"] = out["chunks"]
    return out


def load(base_url: str, prompts: list[list[list[int]]], max_tokens: int, timeout: float) -> dict:
    """prompts[c]: client c's requests, sent one after another; every client in its own thread, at once.
    Returns the wall time (the first request sent -> the last stream's end) and every request's numbers."""
    import threading

    import openai
    clients = [openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout) for _ in prompts]
    results: list[list[dict]] = [[] for _ in prompts]

    def work(c: int) -> None:
        for prompt in prompts[c]:
            results[c].append(one_request(clients[c], prompt, max_tokens))

    threads = [threading.Thread(target=work, args=(c,)) for c in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for client in clients:
        client.close()
    return dict(wall_s=wall, requests=[r for rs in results for r in rs])


# ---- the server (this process) --------------------------------------------------------------------------------------

def stand_in_tokenizer(vocab_size: int):
    """Token i <-> ' w<i>': every id of a random-weight model decodes to one non-empty piece."""
    from tokenizers import Tokenizer, decoders, models
    tok = Tokenizer(models.WordLevel(vocab={f" w{i}": i for i in range(vocab_size)}, unk_token=" w0"))
    tok.decoder = decoders.Fuse()
    return tok


class Serving:
    """strata_jax.serve's app over `engine` on a free loopback port, uvicorn in a thread; `close()` stops uvicorn,
    the batch worker and the socket."""

    def __init__(self, engine, log=None):
        import threading

        import uvicorn
        from strata_jax.serve import create_app, listen
        self.lines: list[str] = []
        self.app = create_app(engine, MODEL_NAME, log=log or self.lines.append)
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), name="serve-bench")
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.close()
            raise RuntimeError("the server did not start on loopback")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.app.state.server.close(30)
        self.sock.close()
        if self.thread.is_alive():
            raise RuntimeError("the server's thread did not stop")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear between the closest ranks); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(clients: int, got: dict, max_tokens: int) -> dict:
    """One round's numbers from load()'s."""
    reqs = got["requests"]
    done = [r for r in reqs if r["error"] is None and r["finish_reason"] is not None]
    tokens = sum(r["tokens"] for r in reqs)
    ttft = [(r["first"] - r["start"]) * 1e3 for r in reqs if r["first"] is not None]
    rates = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in reqs
             if r["first"] is not None and r["tokens"] > 1 and r["last"] > r["first"]]
    errors = sorted({r["error"] for r in reqs if r["error"]})
    return dict(clients=clients, requests=len(reqs), completed=len(done), tokens=tokens,
                short=sum(1 for r in done if r["tokens"] != max_tokens), wall_s=got["wall_s"],
                aggregate_tok_s=tokens / got["wall_s"] if got["wall_s"] > 0 else 0.0,
                per_stream_tok_s=statistics.median(rates) if rates else None,
                ttft_p50_ms=percentile(ttft, 50), ttft_p95_ms=percentile(ttft, 95), errors=errors[:3])


def run(s) -> dict:
    import gc
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np
    from strata_jax.engine.api import Engine
    from strata_jax.model.config import preset

    from benchmarks.batch_bench import slots_option

    counts = runner.parse_list(s.clients, int, "clients", lo=1, hi=256)
    for package in ("fastapi", "uvicorn", "sse_starlette", "openai"):  # the server's and the clients' (requirements.txt)
        try:
            __import__(package)
        except ImportError as e:
            raise ValueError(f"serve_bench needs fastapi, uvicorn, sse-starlette and openai: {e}") from None
    arms = runner.parse_list(s.expert_cache_slots, str, "expert_cache_slots")
    max_batch = s.max_batch or max(counts)
    full = preset(s.model)
    cfg = preset(s.model, layers=s.layers if s.layers and s.layers < full.num_layers else None)
    slots = {a: slots_option(a, cfg.num_experts) for a in arms}
    for a, v in slots.items():
        if v != "all" and not v.isdigit():
            raise ValueError(f"--expert_cache_slots: {a!r} is not all, a number of slots or a share N%")
    dev = common.device_info()
    common.say(f"serve_bench: {s.model}, {cfg.num_layers} layers, {cfg.num_experts} experts top-"
               f"{cfg.num_experts_per_tok}, {s.dtype}, random weights (seed {s.seed}); {dev['device_kind']}; "
               f"clients {counts} x {s.requests} streamed requests of {s.prompt} prompt + {s.new_tokens} tokens; "
               f"max_batch={max_batch}; arms: " + ", ".join(f"slots={slots[a]}" for a in arms)
               + (f" (pcie_frac={s.pcie_frac} with offload)" if any(v != "all" for v in slots.values()) else ""))
    rng = np.random.default_rng(s.seed + 1)
    result = dict(benchmark="serve_bench", settings={n: getattr(s, n) for n in FLAGS}, device=dev, rows=[],
                  arms=[], timing_scope=TIMING)
    cells: list = []

    def save():
        if s.json:
            common.write_json(s.json, result)

    # The load generator: one process apart (spawned: this one holds JAX), reused by every round.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool, \
            runner.sigterm_stops(result, common.progress) as stopped:
        pool.submit(time.sleep, 0).result()  # started before any timing
        for arm in arms:
            options = dict(dtype=s.dtype, context=s.prompt + s.new_tokens, expert_cache_slots=slots[arm],
                           window=1, max_batch=max_batch)
            if slots[arm] != "all":
                options["pcie_frac"] = s.pcie_frac
            if s.cache_dir:
                options["cache_dir"] = s.cache_dir
            t0 = time.perf_counter()
            engine = Engine.from_random(cfg, seed=s.seed, verbose=False, embed_scale=s.embed_scale, **options)
            engine.tokenizer = stand_in_tokenizer(cfg.vocab_size)
            serving = Serving(engine)
            try:
                measure_arm(s, arm, slots[arm], counts, serving, pool, rng, cfg.vocab_size, time.perf_counter() - t0,
                            result, cells, save)
            finally:
                serving.close()
                del serving, engine
                gc.collect()
    result["table"] = runner.table(s, "serve_bench", HEADERS, cells, params=["slots", "clients"], timing=TIMING,
                                   fixed=dict(model=s.model, layers=cfg.num_layers, dtype=s.dtype, prompt=s.prompt,
                                              new_tokens=s.new_tokens, requests=s.requests, max_batch=max_batch,
                                              pcie_frac=s.pcie_frac),
                                   units={"x one client": "x", "TTFT p50 ms": "ms", "TTFT p95 ms": "ms",
                                          "completed": ""}, result=result)
    common.say(f"note: {TIMING}; per-stream tok/s: the median request's (tokens - 1) / (last chunk - first chunk); "
               "x one client: over the same arm's 1-client aggregate")
    if result.get("stopped"):
        common.say(f"stopped: {result['stopped']}")
    save()
    if s.json:
        common.say(f"json: {s.json}")
    if stopped:
        sys.exit(143)
    return result


def measure_arm(s, arm: str, slots: str, counts: list[int], serving: Serving, pool, rng, vocab_size: int,
                start_s: float, result: dict, cells: list, save) -> None:
    """One engine's rounds through its server: the warm-up, then each client count; rows into result and cells."""
    batching = serving.app.state.server.batching_line()
    common.progress(f"slots={slots}: engine built and serving in {start_s:.1f} s; "
                    + batching.split(":")[0] + ": " + batching.split(":")[1].split("(")[0].strip())
    info = dict(slots=slots, arm=arm, url=serving.url, batching=batching, rows=[])
    result["arms"].append(info)

    def round_of(c: int, requests: int = s.requests) -> dict:
        prompts = [[rng.integers(0, vocab_size, s.prompt).tolist() for _ in range(requests)] for _ in range(c)]
        return summarize(c, pool.submit(load, serving.url, prompts, s.new_tokens, s.timeout).result(), s.new_tokens)

    if s.warmup:  # each round's shape once, one request a client: its buckets compile
        t0 = time.perf_counter()
        info["warmup"] = warm = [round_of(c, 1) for c in counts]
        common.progress(f"slots={slots}: warm-up in {time.perf_counter() - t0:.1f} s, "
                        f"{sum(w['completed'] for w in warm)}/{sum(w['requests'] for w in warm)} completed")
    one = None
    for c in counts:
        row = dict(slots=slots, **round_of(c))
        one = row["aggregate_tok_s"] if c == 1 else one
        row["vs_one_client"] = row["aggregate_tok_s"] / one if one else None
        result["rows"].append(row)
        info["rows"].append(row)
        cells.append([slots, c, row["aggregate_tok_s"], row["vs_one_client"], row["per_stream_tok_s"],
                      row["ttft_p50_ms"], row["ttft_p95_ms"], f"{row['completed']}/{row['requests']}"])
        common.progress(f"slots={slots} clients={c}: {row['aggregate_tok_s']:,.1f} tok/s aggregate, "
                        f"{row['completed']}/{row['requests']} completed"
                        + (f"; errors: {row['errors']}" if row["errors"] else ""))
        save()


def main(argv: list[str]) -> dict:
    """Parse argv (argv[0] = program name) into FLAGS and run; returns the numbers. Errors: one line, exit 1."""
    return common.run_main(FLAGS, argv, "benchmarks.serve_bench", run)


if __name__ == "__main__":
    main(sys.argv)
