"""benchmarks/serve_bench.py on the tiny preset (CPU, seconds): the server on loopback under 1 and 2 openai clients,
every stream completed, the server's threads and port gone after each arm."""
from __future__ import annotations

import json
import socket
import threading

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")


def test_serve_bench_tiny(tmp_path, capsys, cache_dir):
    from benchmarks import serve_bench
    out = tmp_path / "serve.json"
    before = {t.name for t in threading.enumerate()}
    result = serve_bench.main(["serve_bench", "--model=tiny", "--clients=1,2", "--requests=2", "--prompt=5",
                               "--new_tokens=4", "--dtype=float32", "--expert_cache_slots=all", "--warmup=false",
                               f"--cache_dir={cache_dir}", f"--json={out}"])
    saved = json.loads(out.read_text())
    assert [r["clients"] for r in saved["rows"]] == [1, 2] == [r["clients"] for r in result["rows"]]
    for r in saved["rows"]:
        assert r["completed"] == r["requests"] == 2 * r["clients"] and not r["errors"]
        assert r["tokens"] == 4 * r["requests"] and r["short"] == 0  # ignore_eos: each ran to max_tokens
        assert r["aggregate_tok_s"] > 0 and r["ttft_p50_ms"] > 0 and r["ttft_p95_ms"] >= r["ttft_p50_ms"]
    assert saved["rows"][0]["vs_one_client"] == pytest.approx(1.0)
    assert "up to 2 sequences" in saved["arms"][0]["batching"]  # max_batch = the largest client count
    table_lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    assert len(table_lines) == 2 + 2 and "aggregate tok/s" in table_lines[0] and "2/2" in table_lines[2]
    # shut down cleanly: no server or batch worker thread left, the port closed
    left = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not left & {"serve-bench", "strata-batch", "strata-serve"}, left
    port = int(result["arms"][0]["url"].rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s, pytest.raises(OSError):
        s.connect(("127.0.0.1", port))


def test_serve_bench_bad_flags(capsys):
    from benchmarks import serve_bench
    for bad in ("--clients=1,x", "--expert_cache_slots=all,lots"):
        with pytest.raises(SystemExit) as e:
            serve_bench.main(["serve_bench", "--model=tiny", bad])
        assert e.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
