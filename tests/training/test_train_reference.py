"""training.train_reference on a tiny model (CPU, seconds): the engine loads what it saves and gives the
training forward's logits, the loss goes down, the load-balancing loss is transformers', the report is sane."""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_fro
from strata_jax.model.weights import random_weights
from training import train_reference as train
from strata_jax.model.config import config_from_dict

# 16 experts (not 8) so that the top-8 routing skew is not 1 by construction.
TINY = ["--hidden=64", "--layers=2", "--experts=16", "--top_k=2", "--moe_intermediate=32", "--heads=2", "--kv_heads=1",
        "--head_dim=32", "--seq_len=32", "--batch=4", "--steps=5", "--max_files=20", "--log_every=5"]


def train_tiny(folder, *extra) -> dict:
    # The run appends the GPU determinism flag to XLA_FLAGS: keep that change inside the call.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        return train.main(["train_reference", *TINY, f"--out={folder}", *extra])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_reference")
    result = train_tiny(root / "ckpt", "--save_dtype=float32", f"--json={root / 'report.json'}")
    return root, result


def test_engine_logits_equal_training_forward(tiny_run, cache_dir):
    from strata_jax import Engine
    from strata_jax.io import checkpoint
    root, result = tiny_run
    ckpt = root / "ckpt"
    cfg = config_from_dict(json.loads((ckpt / "config.json").read_text()))
    trained = result["weights"]
    # The saved tensors are the trained ones, exactly (float32), in the loader's layout.
    loaded = checkpoint.load_weights(ckpt, cfg, jnp.float32)
    assert jax.tree.structure(loaded) == jax.tree.structure(trained)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    engine = Engine.from_pretrained(ckpt, dtype="float32", expert_cache_slots="all", verbose=False,
                                    cache_dir=str(cache_dir), window=2, context=64)
    corpus = result["corpus"]
    text = (Path(corpus["root"]) / corpus["heldout_files"][0]).read_bytes()[:48]
    ids = list(text)
    assert engine.encode("def f(x):\n") == list(b"def f(x):\n")  # the byte tokenizer: id = byte
    with jax.default_matmul_precision("highest"):  # one jitted graph (op by op it was ~170 compiles)
        want = np.asarray(jax.jit(train.forward, static_argnums=2)(trained, jnp.asarray([ids], jnp.int32), cfg)[0][0])
    assert want.shape == (len(ids), 257)
    assert rel_fro(engine.prefill_logits(ids), want) <= 1e-4
    assert rel_fro(engine.score(ids), want) <= 1e-4


def test_loss_goes_down_on_a_repeated_batch():
    train.parse_flags(["train_reference", *TINY])
    cfg = config_from_dict(train.hf_config(train.FLAGS))
    _, files = train.stdlib_files(max_files=2)
    data = np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8).astype(np.int32)
    assert data.size >= 4 * 33
    batch = jnp.asarray(data[:4 * 33].reshape(4, 33))
    optimizer, _ = train.make_optimizer(lr=3e-3, steps=30)
    update = jax.jit(train.make_update(cfg, optimizer, aux_loss_coef=0.001, compute_dtype=jnp.float32))
    weights = random_weights(cfg, 0, jnp.float32)
    state = optimizer.init(weights)
    losses = []
    for _ in range(30):
        weights, state, metrics = update(weights, state, batch)
        losses.append(float(metrics["ce"]))
    assert losses[0] == pytest.approx(np.log(257), abs=0.1)  # small initial weights: near-uniform over 257
    assert losses[-1] < losses[0] - 1.0, losses


def test_load_balancing_loss_is_transformers():
    e, k, t = 8, 2, 6
    # Uniform routing: f_e sums to K over the experts, P_e = 1/E, so E * sum f_e P_e = K exactly.
    zeros = [jnp.zeros((t, e)), jnp.zeros((t, e))]
    assert float(train.load_balancing_loss(zeros, k)) == pytest.approx(2.0, abs=1e-6)
    # Each layer collapsed onto its own two experts: one layer alone gives E * (1 * 1/2 + 1 * 1/2) = E = 8; the two
    # layers' rows pooled (transformers concatenates them): f = 1/2 and P = 1/4 on four experts, 8 * 4 / 8 = 4.
    a = np.zeros((t, e), np.float32)
    a[:, [0, 1]] = 30.0
    b = np.zeros((t, e), np.float32)
    b[:, [2, 3]] = 30.0
    assert float(train.load_balancing_loss([jnp.asarray(a)], k)) == pytest.approx(8.0, abs=1e-5)
    assert float(train.load_balancing_loss([jnp.asarray(a), jnp.asarray(b)], k)) == pytest.approx(4.0, abs=1e-5)
    # Random logits against the formula in numpy.
    rng = np.random.default_rng(0)
    layers = [rng.normal(size=(t, e)).astype(np.float32) * s for s in (1.0, 3.0)]
    x = np.concatenate(layers)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    picked = np.argsort(-p, axis=-1)[:, :k]
    f = np.stack([(picked == j).any(-1) for j in range(e)], -1).mean(0)
    want = e * np.sum(f * p.mean(0))
    assert float(train.load_balancing_loss([jnp.asarray(v) for v in layers], k)) == pytest.approx(want, rel=1e-5)


def test_report(tiny_run):
    root, result = tiny_run
    ckpt = root / "ckpt"
    saved = json.loads((root / "report.json").read_text())
    assert saved == json.loads((ckpt / "training_report.json").read_text())
    assert saved["complete"] and "weights" not in saved
    assert {p.name for p in ckpt.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "training_report.json"}
    held = saved["heldout"]
    assert 0 < held["bits_per_byte"] < 9 and held["bytes"] > 0
    e = saved["config"]["num_experts"]
    assert len(held["layers"]) == 2
    for layer in held["layers"]:
        assert min(8, e) / e - 1e-9 <= layer["top_share"] <= 1.0
        # Every held-out position but the last routes K=2 entries; the targets are its bytes and one EOT a file.
        assert layer["routed_entries"] == 2 * (held["bytes"] + len(saved["corpus"]["heldout_files"]))
    assert len(saved["curve"]) == 1 and saved["curve"][0]["step"] == 5
    assert saved["params"]["total"] == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(result["weights"]))


def test_sharded_checkpoint_loads(tiny_run, tmp_path):
    from strata_jax.io import checkpoint
    root, result = tiny_run
    cfg = config_from_dict(json.loads((root / "ckpt" / "config.json").read_text()))
    raw = json.loads((root / "ckpt" / "config.json").read_text())
    saved = train.save_checkpoint(tmp_path, result["weights"], cfg, raw, "float32", max_shard_bytes=200_000)
    assert len(saved["files"]) > 1 and not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = checkpoint.load_weights(tmp_path, cfg, jnp.float32)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(result["weights"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Saving again unsharded into the same folder leaves no stale index behind.
    train.save_checkpoint(tmp_path, result["weights"], cfg, raw, "float32")
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_same_flags_same_checkpoint(tiny_run, tmp_path):
    _, first = tiny_run
    again = train_tiny(tmp_path / "again", "--save_dtype=float32")
    assert again["checkpoint"]["sha256"] == first["checkpoint"]["sha256"]


def test_default_shape_size():
    """The default model stays under ~40 MB as bf16 safetensors."""
    train.parse_flags(["train_reference"])
    cfg = config_from_dict(train.hf_config(train.FLAGS))
    shapes = jax.eval_shape(lambda: random_weights(cfg, 0, jnp.float32))
    assert 2 * sum(x.size for x in jax.tree.leaves(shapes)) <= 40e6
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_layers, cfg.hidden_size) == (64, 8, 4, 256)


def test_missing_out_exits(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["train_reference", *TINY])
    assert e.value.code == 1
    assert "--out" in capsys.readouterr().err


# ---- --arch=qwen3_next: hybrid layers, a shared expert, the MTP module ------------------------------------------

TINY_NEXT = ["--arch=qwen3_next", "--hidden=64", "--layers=4", "--experts=16", "--top_k=2", "--moe_intermediate=32",
             "--heads=2", "--kv_heads=1", "--head_dim=32", "--linear_key_heads=1", "--linear_value_heads=2",
             "--linear_head_dim=16", "--shared_intermediate=32", "--seq_len=32", "--batch=4", "--steps=4",
             "--max_files=20", "--log_every=4", "--eval_tokens=300"]


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_next")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        result = train.main(["train_reference", *TINY_NEXT, f"--out={root}", "--save_dtype=float32"])
    return root, result


def test_next_engine_and_mtp_equal_training_forward(tiny_next, cache_dir):
    """The engine loads the saved Qwen3-Next model and its MTP module exactly, and gives the training forward's
    logits (prefill and score) and the module's logits on the token after next."""
    from strata_jax import Engine
    from strata_jax.io import checkpoint
    from strata_jax.speculative import mtp as mtp_mod
    root, result = tiny_next
    raw = json.loads((root / "config.json").read_text())
    cfg = config_from_dict(raw)
    assert cfg.next and cfg.has_linear and cfg.num_full_layers == 1 and cfg.mtp_layers == 1
    assert cfg.rotary_dim == 8 and cfg.shared_expert_intermediate_size == 32
    loaded = checkpoint.load_weights(root, cfg, jnp.float32)
    loaded_mtp = checkpoint.load_mtp(root, cfg, jnp.float32)
    for got, want in ((loaded, result["weights"]), (loaded_mtp, result["mtp"])):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    engine = Engine.from_pretrained(root, dtype="float32", expert_cache_slots="all", verbose=False,
                                    cache_dir=str(cache_dir), window=2, context=128)
    assert engine.mtp is not None
    ids = list((Path(result["corpus"]["root"]) / result["corpus"]["heldout_files"][0]).read_bytes()[:70])
    tokens = jnp.asarray([ids], jnp.int32)
    # Each reference pass as one jitted graph (op by op they were ~480 compiles, most of this test's time).
    with jax.default_matmul_precision("highest"):
        want, _, hidden = jax.jit(train.forward, static_argnums=(2, 3))(result["weights"], tokens, cfg, True)
        want_mtp, _ = jax.jit(train.mtp_forward, static_argnums=4)(result["weights"], result["mtp"], hidden[:, :-1],
                                                                   tokens[:, 1:], cfg)
        n = len(ids) - 1
        got_mtp, _, _ = jax.jit(mtp_mod.mtp_layer, static_argnums=7)(
            loaded, loaded_mtp, mtp_mod.init_cache(cfg, 128, jnp.float32), hidden[0, :n], tokens[0, 1:], jnp.int32(0),
            jnp.ones((n,), bool), cfg)
    assert rel_fro(engine.prefill_logits(ids), np.asarray(want[0])) <= 1e-4
    assert rel_fro(engine.score(ids), np.asarray(want[0])) <= 1e-4
    assert rel_fro(np.asarray(got_mtp), np.asarray(want_mtp[0])) <= 1e-4


def test_next_report_and_loss(tiny_next):
    root, result = tiny_next
    saved = json.loads((root / "training_report.json").read_text())
    held = saved["heldout"]
    assert len(held["layers"]) == 4  # every layer sparse; the MTP layer's routing is not a model layer's
    mtp = held["mtp"]
    assert 0 < mtp["bits_per_byte"] < 9 and 0 <= mtp["agreement"] <= 1 and mtp["rows"] > 0
    assert all(np.isfinite(row["mtp_loss"]) and row["mtp_loss"] > 0 for row in saved["curve"])
    n_mtp = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(result["mtp"]))
    n_main = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(result["weights"]))
    assert saved["params"]["total"] == n_main + n_mtp


def test_next_mtp_loss_goes_down_on_a_repeated_batch():
    """The MTP module learns the token after next: its loss falls as the main loss does."""
    train.parse_flags(["train_reference", *TINY_NEXT])
    cfg = config_from_dict(train.hf_config(train.FLAGS))
    _, files = train.stdlib_files(max_files=2)
    data = np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8).astype(np.int32)
    batch = jnp.asarray(data[:4 * 33].reshape(4, 33))
    optimizer, _ = train.make_optimizer(lr=3e-3, steps=30)
    update = jax.jit(train.make_update(cfg, optimizer, aux_loss_coef=0.001, compute_dtype=jnp.float32,
                                       mtp_loss_coef=1.0))
    master = (random_weights(cfg, 0, jnp.float32), train.random_mtp(cfg, 0, jnp.float32, 0.02))
    state = optimizer.init(master)
    ce, mtp_ce = [], []
    for _ in range(30):
        master, state, metrics = update(master, state, batch)
        ce.append(float(metrics["ce"]))
        mtp_ce.append(float(metrics["mtp_ce"]))
    assert mtp_ce[0] == pytest.approx(np.log(257), abs=0.1)
    assert ce[-1] < ce[0] - 1.0 and mtp_ce[-1] < mtp_ce[0] - 1.0, (ce, mtp_ce)


def test_next_defaults_stay_small():
    """--arch=qwen3_next's default shape (the committed reference-next) is Next-shaped and small enough to travel
    with the repository: 64 experts top-8, hybrid layers, a shared expert, the MTP module, under 10 MB as bf16."""
    train.parse_flags(["train_reference", "--arch=qwen3_next"])
    s = train.arch_defaults(train.FLAGS)
    cfg = config_from_dict(train.hf_config(s))
    shapes = jax.eval_shape(lambda: (random_weights(cfg, 0, jnp.float32),
                                     train.random_mtp(cfg, 0, jnp.float32, 0.02)))
    assert 2 * sum(x.size for x in jax.tree.leaves(shapes)) <= 10e6
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size) == (64, 8, 128)
    assert cfg.has_linear and cfg.num_full_layers >= 1 and cfg.shared_expert_intermediate_size > 0
    train.parse_flags(["train_reference", "--arch=qwen3_next", "--hidden=96"])
    assert train.arch_defaults(train.FLAGS).hidden == 96  # a flag given on the command line wins
