"""Timeline of an offloaded decode at S=E (12 layers of the 30B shape): jax.profiler's perfetto trace of a few
generate() calls, written to $OUT (analysed off the machine)."""
import glob, os, shutil, sys
sys.path.insert(0, ".")
import numpy as np
import jax
from strata_jax.config import preset
from strata_jax.engine import Engine
slots, layers = sys.argv[1], int(sys.argv[2])
out = os.environ.get("OUT", "/tmp")
cfg = preset("qwen3-30b-a3b", layers=layers)
e = Engine.from_random(cfg, seed=0, verbose=False, embed_scale=50.0, expert_cache_slots=slots, pcie_frac="1",
                       window=1, context=512, compile_graphs="ahead")
rng = np.random.default_rng(0)
for i in range(2):
    e.generate(rng.integers(0, cfg.vocab_size, 32).tolist(), 32, temperature=1.0, seed=i, stop_token_ids=[],
               draft="none")
print("warm:", e.stats.last.decode_tok_s, "tok/s", flush=True)
prompt = rng.integers(0, cfg.vocab_size, 32).tolist()
with jax.profiler.trace("/tmp/jtrace", create_perfetto_trace=True):
    e.generate(prompt, 12, temperature=1.0, seed=9, stop_token_ids=[], draft="none")
print("traced:", e.stats.last.decode_tok_s, "tok/s", flush=True)
for f in glob.glob("/tmp/jtrace/**/*perfetto_trace.json.gz", recursive=True):
    shutil.copy(f, os.path.join(out, f"trace_{slots}.json.gz"))
    print("trace", f, os.path.getsize(f))
