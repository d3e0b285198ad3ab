"""devices > 1 (strata_jax/engine/parallel.py) on the CPU with fake devices: parallel=layers and parallel=experts give the
single-device logits (float32, 1e-5 relative) through the prefill and decode windows of T=1 and T=4, and the same
greedy tokens (and draft=device's, greedy and sampled), every expert resident and offloaded with
each device's own slot caches (parallel=layers: PCIe and host pool, lru and static; parallel=experts: PCIe, lru); a
split engine's save_state restores on one device; two processes through jax.distributed; the refusals are one line.

The fake devices need XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts, so the equality checks
run in a subprocess (tests/engine/parallel_check.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import fake_devices_env
from helpers import one_line_refusal
from strata_jax.model.config import preset
from strata_jax.engine.api import Engine
from strata_jax.options import EngineOptions, build

CHECK = Path(__file__).resolve().parent / "parallel_check.py"


def test_layers_and_experts_match_one_device(cache_dir):
    env = fake_devices_env(4)
    splits = ["layers:2", "experts:2", "layers:2:4:0.5:lru", "layers:3:3:1:static", "experts:2:4:1:lru"]
    proc = subprocess.run([sys.executable, str(CHECK), f"--cache_dir={cache_dir}", *splits],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    splits = {r["split"]: r for r in rows if "split" in r}
    assert set(splits) == {"layers:2", "experts:2", "layers:2:4:0.5:lru", "layers:3:3:1:static",
                           "experts:2:4:1:lru"}, proc.stdout
    for split, r in splits.items():
        for k in ("prefill", "w1", "w4"):  # prefill logits; decode windows of T=1 and T=4
            assert r[k] <= 1e-5, (split, k, r[k])
        assert r["gen1"] and r["gen4"], (split, r)  # greedy generate: T=1 windows, verify windows with drafts
        assert r["gend"], (split, r)  # draft=device (drafts and acceptance on the device), greedy and sampled
    assert splits["layers:2"]["prefill"] == 0.0  # the same per-layer graph code, the same sums
    # each device holds its block of layers (and the experts split: half of each layer's experts)
    for split in ("layers:2", "experts:2"):
        held = splits[split]["held"]
        assert set(held) == {"cpu:0:device", "cpu:1:device"}, (split, held)
        assert 0.25 < held["cpu:1:device"] / sum(held.values()) < 0.6, (split, held)
    # offloaded: each device's layers keep their slot caches there, and the windows really missed (PCIe and pool)
    pool, static = splits["layers:2:4:0.5:lru"], splits["layers:3:3:1:static"]
    assert pool["slot_devices"] == ["cpu:0", "cpu:1"] and static["slot_devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert pool["experts"]["fetched"] > 0 and pool["experts"]["cpu"] > 0, pool
    assert static["experts"]["fetched"] > 0 and static["experts"]["cpu"] == 0, static
    # parallel=experts with offload: each device's slot cache (of its half of the experts) on that device
    split_offload = splits["experts:2:4:1:lru"]
    assert split_offload["slot_devices"] == ["cpu:0", "cpu:1"], split_offload
    assert split_offload["experts"]["fetched"] > 0 and split_offload["experts"]["resident"] > 0, split_offload
    # the deferral: the last layer of device 0's block (layer 1 of 3) is never deferred, nor the model's last
    defer = next(r for r in rows if "defer" in r)
    assert defer["no_defer"] == [1, 2] and defer["defer_active"] and defer["tokens"] == 10 and defer["cpu"] > 0
    auto = next(r for r in rows if "auto_fracs" in r)
    assert auto == {"auto_fracs": [1.0, 1.0], "auto_same_graphs": True}
    saved = {r["saved"]: r["prefill"] for r in rows if "saved" in r}
    assert set(saved) == {"layers:2", "experts:2", "layers:2:4:0.5:lru", "experts:2:4:1:lru"}, proc.stdout
    assert all(v <= 1e-5 for v in saved.values()), saved
    errors = {json.dumps(r["options"], sort_keys=True): r["error"] for r in rows if "options" in r}
    pool = errors[json.dumps({"devices": 2, "parallel": "experts", "expert_cache_slots": "4", "pcie_frac": "0.5"},
                             sort_keys=True)]
    assert pool and "fetches every miss over PCIe (pcie_frac=1)" in pool and "\n" not in pool
    lru_only = errors[json.dumps({"devices": 2, "parallel": "experts", "expert_cache_slots": "4",
                                  "cache_policy": "static"}, sort_keys=True)]
    assert lru_only and "runs cache_policy=lru" in lru_only and "\n" not in lru_only
    blocks = errors[json.dumps({"devices": 4, "parallel": "layers"}, sort_keys=True)]
    assert blocks and "needs at least as many layers (this model: 3)" in blocks and "\n" not in blocks
    many = errors[json.dumps({"devices": 99}, sort_keys=True)]
    assert many and "devices=99: JAX sees 4 cpu device(s)" == many


def test_devices_option_checks():
    assert build(EngineOptions, {}).devices == "1" and build(EngineOptions, {}).parallel == "layers"
    assert build(EngineOptions, {"devices": 2}).devices == "2"
    assert build(EngineOptions, {"devices": "all"}).devices == "all"
    one_line_refusal(build, EngineOptions, {"devices": 0}, match="devices")
    one_line_refusal(build, EngineOptions, {"devices": "two"}, match="devices")
    one_line_refusal(build, EngineOptions, {"parallel": "tensor"}, match="parallel")


def test_more_devices_than_seen_is_one_line():
    # this process sees one CPU device
    msg = one_line_refusal(Engine.from_random, preset("tiny"), verbose=False, dtype="float32", devices=2,
                           match="JAX sees 1")
    assert msg.startswith("devices=2:")


def test_two_processes_through_jax_distributed_match_one_device():
    """parallel=experts over 2 processes (jax.distributed, gloo collectives on the CPU, one device each): each
    process's prefill logits, decode windows and greedy tokens equal its own single-device engine's."""
    import socket
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = fake_devices_env(1)
    script = Path(__file__).resolve().parent / "distributed_check.py"
    procs = [subprocess.Popen([sys.executable, str(script), str(i), "2", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:  # a process left waiting on the other (a hang, or the other's failure)
            if p.poll() is None:
                p.kill()
    rows = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(r["process"] for r in rows) == [0, 1], rows
    for r in rows:
        assert r["devices"] == 2 and r["local"] == 1, r  # the experts split over the two processes
        for k in ("prefill", "w1", "w4"):
            assert r[k] <= 1e-5, (r["process"], k, r[k])
        assert r["gen1"] and r["gen4"], r
    assert rows[0]["tokens"] == rows[1]["tokens"]  # every process samples the same tokens
