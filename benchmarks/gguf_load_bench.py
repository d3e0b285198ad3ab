"""The load time of a quantized GGUF (`--model=file.gguf`): a synthetic qwen3moe GGUF of a preset's shape, cut to a
few layers, written once (not a real model: random blocks whose half-precision scales stay finite), then its
weights read as the engine reads them (`checkpoint.load_weights`, bf16 on the CPU device) with 1..N dequantizing
threads; each setting's load is timed best of --repeats, after one read of the file (so the page cache holds it)
and --warmup untimed loads.

    python -m benchmarks.gguf_load_bench --out=/tmp/gguf-bench/q4km.gguf --types=q4_k_m --layers=2 --threads=1,2

--place=drop drops each array once converted instead of placing it on the CPU device: the host's side of a load
alone (on a GPU the placing is a copy to the device; on this CPU device it is a copy into fresh memory).

--types: q4_k_m (llama.cpp's Q4_K_M mix: experts gate/up, attention q/k/o and the embeddings Q4_K; experts down,
attention v and the output Q6_K) or q8_0 (every matrix Q8_0). Norms and the router F32, as llama.cpp keeps them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.peer.write_gguf import qwen3moe_writer

REPO = Path(__file__).resolve().parents[1]


def gguf_type(kind: str, name: str):
    from gguf import GGMLQuantizationType as Q
    if kind == "q8_0":
        return Q.Q8_0
    six = ("ffn_down_exps", "attn_v.", "output.")
    return Q.Q6_K if any(s in name for s in six) else Q.Q4_K


def write(path: Path, model: str, layers: int, kind: str, seed: int = 0) -> None:
    """The synthetic GGUF: a random 16 MiB block of bytes below 0x40 (finite f16 scales), tiled over every quantized
    tensor (the loader dequantizes every byte either way; tiling only saves the writing time)."""
    import gguf
    c = json.loads((REPO / "configs" / f"{model}.json").read_text())
    h, nh, nkv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    e, inter, vocab = c["num_experts"], c["moe_intermediate_size"], c["vocab_size"]
    w = qwen3moe_writer(gguf, path, c, layers)
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 0x40, 16 << 20, dtype=np.uint8)

    def quantized(name: str, *shape: int):
        qtype = gguf_type(kind, name)
        byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
        w.add_tensor(name, np.resize(block, byte_shape), raw_dtype=qtype)

    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    names, T = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    quantized(names[T.TOKEN_EMBD] + ".weight", vocab, h)
    w.add_tensor(names[T.OUTPUT_NORM] + ".weight", ones(h))
    quantized(names[T.OUTPUT] + ".weight", vocab, h)
    for i in range(layers):
        name = lambda t: names[t].format(bid=i) + ".weight"  # noqa: E731
        w.add_tensor(name(T.ATTN_NORM), ones(h))
        w.add_tensor(name(T.FFN_NORM), ones(h))
        quantized(name(T.ATTN_Q), nh * d, h)
        quantized(name(T.ATTN_K), nkv * d, h)
        quantized(name(T.ATTN_V), nkv * d, h)
        quantized(name(T.ATTN_OUT), h, nh * d)
        w.add_tensor(name(T.ATTN_Q_NORM), ones(d))
        w.add_tensor(name(T.ATTN_K_NORM), ones(d))
        w.add_tensor(name(T.FFN_GATE_INP), (rng.standard_normal((e, h)) * 0.02).astype(np.float32))
        quantized(name(T.FFN_GATE_EXP), e, inter, h)
        quantized(name(T.FFN_UP_EXP), e, inter, h)
        quantized(name(T.FFN_DOWN_EXP), e, h, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the synthetic GGUF (written when missing)")
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a preset in configs/")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--types", default="q4_k_m", choices=("q4_k_m", "q8_0"))
    ap.add_argument("--threads", default="1,2", help="dequantizing threads to time, a comma list")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed loads first")
    ap.add_argument("--place", default="device", choices=("device", "drop"),
                    help="device: each array jax.device_put (the CPU device here); drop: dropped once converted (the "
                         "host's side of a load alone: no device buffers, whose first touch of fresh memory costs "
                         "this VM seconds a GiB)")
    ap.add_argument("--cache_dir", default="", help="where the model folder goes (default: beside --out)")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from strata_jax.io import checkpoint, gguf_file
    from strata_jax.model.config import load_config

    path = Path(a.out)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write(path, a.model, a.layers, a.types)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f} s",
              file=sys.stderr, flush=True)
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    folder = gguf_file.gguf_model_folder(path, Path(a.cache_dir or path.parent / "cache"))
    cfg = load_config(folder)
    source = json.loads((folder / gguf_file.SOURCE_FILE).read_text())
    weights = sum(n for family in source["types"].values() for n, _ in family.values())
    print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, {weights / 1e9:.2f} G weights, types "
          f"{sorted({t for family in source['types'].values() for t in family})}, {os.cpu_count()} CPUs")
    # The loader's own thread in GGUFTensors.get: dequantizing there, or waiting for an expert read ahead.
    in_reader = [0.0]
    get = gguf_file.GGUFTensors.get

    def timed_get(self, name, shape):
        t = time.perf_counter()
        try:
            return get(self, name, shape)
        finally:
            in_reader[0] += time.perf_counter() - t
    gguf_file.GGUFTensors.get = timed_get
    place = checkpoint.default_place if a.place == "device" else (lambda name, x: None)
    print(f"place={a.place}")
    for _ in range(a.warmup):  # untimed: a fresh VM's first touch of memory costs seconds a GiB
        jax.block_until_ready(checkpoint.load_weights(folder, cfg, jnp.bfloat16, place=place))
    print(f"| threads | load s (best of {a.repeats}; each) | M weights/s | of it in the reader, s | CPU s (user + sys; "
          "each) | load average after |")
    print("|---|---|---|---|---|---|")
    for threads in (int(t) for t in a.threads.split(",")):
        times, cpu, reader = [], [], []
        for _ in range(a.repeats):
            if hasattr(gguf_file, "LOAD_THREADS"):  # else: the code before threads
                gguf_file.LOAD_THREADS = threads
            t, c, in_reader[0] = time.perf_counter(), os.times(), 0.0
            got = checkpoint.load_weights(folder, cfg, jnp.bfloat16, place=place)
            jax.block_until_ready(got)
            times.append(time.perf_counter() - t)
            c1 = os.times()
            cpu.append(f"{c1.user - c.user:.1f} + {c1.system - c.system:.1f}")
            reader.append(in_reader[0])
            del got
        best = min(range(len(times)), key=times.__getitem__)
        print(f"| {threads} | {times[best]:.2f} ({', '.join(f'{x:.2f}' for x in times)}) | "
              f"{weights / times[best] / 1e6:.0f} | {reader[best]:.2f} | {'; '.join(cpu)} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
