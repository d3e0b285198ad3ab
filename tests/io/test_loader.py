"""Loading checkpoints: broken folders are refused with one line naming the culprit; bfloat16; orbax save/restore."""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import HF_FIXTURES, copy_fixture
from helpers import one_line_refusal, rel_fro
from strata_jax import Engine, StrataError

W = 4
RESIDENT = dict(expert_cache_slots="all")  # every expert on the device: the exact engine (offload has its own tests)


def refused(path, cache_dir, **options) -> str:
    options.setdefault("dtype", "float32")
    return one_line_refusal(Engine.from_pretrained, path, verbose=False, cache_dir=str(cache_dir), **options)


def shape_in(msg: str, shape) -> bool:
    """`shape` written as [a, b] or (a, b) in msg."""
    dims = r"\s*,\s*".join(str(d) for d in shape)
    return re.search(r"[\[(]\s*" + dims + r"\s*,?\s*[\])]", msg) is not None


@pytest.fixture
def base_copy(tmp_path):
    return copy_fixture(tmp_path, "base")


def test_missing_tensor(base_copy, cache_dir):
    tensors = load_file(base_copy / "model.safetensors")
    rng = np.random.default_rng(11)
    # an expert matrix, a norm and the lm_head are all required; plus two keys drawn at random
    names = sorted(tensors)
    picks = ["lm_head.weight", "model.layers.1.self_attn.k_norm.weight", "model.layers.0.mlp.experts.7.up_proj.weight"]
    picks += [names[i] for i in rng.choice(len(names), 2, replace=False)]
    for name in picks:
        save_file({k: v for k, v in tensors.items() if k != name}, base_copy / "model.safetensors")
        msg = refused(base_copy, cache_dir)
        assert name in msg and "missing" in msg, msg


def test_wrong_shape(base_copy, cache_dir):
    tensors = load_file(base_copy / "model.safetensors")
    rng = np.random.default_rng(12)
    names = sorted(tensors)
    for name in [names[i] for i in rng.choice(len(names), 3, replace=False)] + ["model.embed_tokens.weight"]:
        good = tensors[name].shape
        bad = (good[0] + 1,) + good[1:]
        broken = dict(tensors, **{name: rng.standard_normal(bad).astype(np.float32)})
        save_file(broken, base_copy / "model.safetensors")
        msg = refused(base_copy, cache_dir)
        assert name in msg and shape_in(msg, bad) and shape_in(msg, good), msg


def test_truncated_file(base_copy, cache_dir):
    path = base_copy / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)
    assert str(path) in refused(base_copy, cache_dir)


def test_garbage_header(base_copy, cache_dir):
    path = base_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(13)
    data[8:72] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()  # the JSON header, after its 8-byte length
    path.write_bytes(bytes(data))
    assert str(path) in refused(base_copy, cache_dir)


def test_missing_config(base_copy, cache_dir):
    (base_copy / "config.json").unlink()
    msg = refused(base_copy, cache_dir)
    assert "config.json" in msg and str(base_copy) in msg


def test_malformed_config(base_copy, cache_dir):
    (base_copy / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], ')
    assert "config.json" in refused(base_copy, cache_dir)


@pytest.mark.parametrize("layers", [1_000_000, 1, 3])
def test_a_layer_count_the_tensors_do_not_hold_is_one_line_at_once(base_copy, cache_dir, layers):
    import time
    raw = json.loads((base_copy / "config.json").read_text())
    (base_copy / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=layers)))
    t0 = time.perf_counter()
    msg = refused(base_copy, cache_dir)
    assert f"num_hidden_layers is {layers}" in msg and "holds 2 layers" in msg and time.perf_counter() - t0 < 10


def test_an_empty_model_name_is_refused_not_the_working_folder(tmp_path, cache_dir, monkeypatch):
    shutil.copytree(HF_FIXTURES / "base", tmp_path / "here")
    monkeypatch.chdir(tmp_path / "here")  # a model in the working folder must not be read for model=""
    for empty in ("", "  "):
        assert "model is empty" in refused(empty, cache_dir)


def test_missing_folder(tmp_path, cache_dir):
    missing = tmp_path / "no-such-model"
    assert str(missing) in refused(missing, cache_dir)


def test_no_safetensors(base_copy, cache_dir):
    (base_copy / "model.safetensors").unlink()
    assert "safetensors" in refused(base_copy, cache_dir)


@pytest.fixture
def sharded_copy(tmp_path):
    return copy_fixture(tmp_path, "gqa4_sharded")


def test_index_points_to_missing_shard(sharded_copy, cache_dir):
    index_path = sharded_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[np.random.default_rng(14).integers(len(index["weight_map"]))]
    index["weight_map"][name] = "model-00009-of-00004.safetensors"
    index_path.write_text(json.dumps(index))
    assert "model-00009-of-00004.safetensors" in refused(sharded_copy, cache_dir)


@pytest.mark.parametrize("weight_map", [["model-00001-of-00004.safetensors"], "int", "null"])
def test_malformed_weight_map_is_one_line(sharded_copy, cache_dir, weight_map):
    index_path = sharded_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if isinstance(weight_map, list):
        index["weight_map"] = weight_map
    else:
        name = sorted(index["weight_map"])[0]
        index["weight_map"][name] = 3 if weight_map == "int" else None
    index_path.write_text(json.dumps(index))
    assert "malformed index" in refused(sharded_copy, cache_dir)


def test_a_tensor_in_two_files_is_an_error_naming_both(tmp_path, cache_dir):
    """Without an index, a stray extra file holding a real tensor's name must not replace it (the last file in
    sorted order used to win)."""
    folder = copy_fixture(tmp_path, "base")
    tensors = load_file(str(folder / "model.safetensors"))
    name = sorted(tensors)[np.random.default_rng(4).integers(len(tensors))]
    save_file({name: np.random.default_rng(5).normal(size=tensors[name].shape).astype(tensors[name].dtype)},
              str(folder / "zz-stray.safetensors"))
    msg = refused(folder, cache_dir)
    assert name in msg and "model.safetensors" in msg and "zz-stray.safetensors" in msg


def test_deleted_shard(sharded_copy, cache_dir):
    shard = sharded_copy / "model-00003-of-00004.safetensors"
    shard.unlink()
    assert str(shard) in refused(sharded_copy, cache_dir)


# ---- dtypes and saved state ------------------------------------------------------------------------------------

def test_bfloat16_close_to_reference(engine_factory):
    with np.load(HF_FIXTURES / "base" / "reference.npz") as z:
        ids, ref = z["input_ids"], z["logits"]
    bf16 = engine_factory(HF_FIXTURES / "base", dtype="bfloat16", window=W, **RESIDENT)
    f32 = engine_factory(HF_FIXTURES / "base", dtype="float32", window=W, **RESIDENT)
    for got in (bf16.score(ids), bf16.prefill_logits(ids)):
        assert got.dtype == np.float32
        # bfloat16 weights and activations (8-bit mantissa) through 2 layers: measured ~1e-2 relative Frobenius
        # (||got - ref||_F / ||ref||_F over [24, 256]); 5e-2 is loose but catches a wrong layout or dtype mix-up.
        rel = rel_fro(got, ref)
        assert rel <= 5e-2, rel
        # ... and the engine really computed in bfloat16: far from its float32 twin (which is ~5e-7 from ref)
        assert np.linalg.norm(got - f32.score(ids)) / np.linalg.norm(ref) > 1e-4


@pytest.mark.parametrize("name,dtype", [
    ("base", "float32"),
    ("tied_nonorm", "float32"),  # no lm_head in the state
    ("base", "bfloat16"),
    ("gqa4_sharded", "float32"),  # attention biases: the restore target must hold them too
])
def test_orbax_round_trip(name, dtype, engine_factory, cache_dir, tmp_path):
    engine = engine_factory(HF_FIXTURES / name, dtype=dtype, window=W, **RESIDENT)
    state = tmp_path / "state"
    engine.save_state(state)
    # The restored engine compiles only T=1 and the prefill chunk (window=1): the same graphs as the original's
    # T=1 / prefill, so identical weights must give bit-identical logits.
    restored = Engine.from_pretrained(state, verbose=False, dtype=dtype, window=1, cache_dir=str(cache_dir),
                                      **RESIDENT)
    rng = np.random.default_rng(15)
    ids = rng.integers(0, engine.cfg.vocab_size, 19).tolist()
    assert np.array_equal(restored.score(ids, window=1), engine.score(ids, window=1))
    assert np.array_equal(restored.prefill_logits(ids), engine.prefill_logits(ids))
    assert restored.generate(ids[:6], 8, stop_token_ids=[]) == engine.generate(ids[:6], 8, stop_token_ids=[])

    other = "bfloat16" if dtype == "float32" else "float32"
    msg = refused(state, cache_dir, dtype=other)
    assert dtype in msg and other in msg


def test_orbax_broken_state(engine_factory, cache_dir, tmp_path):
    engine = engine_factory(HF_FIXTURES / "base", dtype="float32", window=W, **RESIDENT)
    state = tmp_path / "state"
    engine.save_state(state)
    shutil.rmtree(state / "weights")
    assert str(state) in refused(state, cache_dir)


@pytest.mark.parametrize("meta", ["{not json", "[]", '{"format": 1}'])
def test_malformed_state_meta_is_one_line(engine_factory, cache_dir, tmp_path, meta):
    engine = engine_factory(HF_FIXTURES / "base", dtype="float32", window=W, **RESIDENT)
    state = tmp_path / "state"
    engine.save_state(state)
    (state / "strata_state.json").write_text(meta)
    assert "strata_state.json" in refused(state, cache_dir)


def test_corrupt_orbax_data_is_one_quiet_line(engine_factory, cache_dir, tmp_path, capfd):
    engine = engine_factory(HF_FIXTURES / "base", dtype="float32", window=W, **RESIDENT)
    state = tmp_path / "state"
    engine.save_state(state)
    for f in (state / "weights").rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            f.write_bytes(b"\0garbage" * 8)
    capfd.readouterr()
    assert str(state) in refused(state, cache_dir)
    err = capfd.readouterr().err
    assert err.count("Traceback") == 0 and len(err.splitlines()) < 20, err[-2000:]


def test_save_state_under_a_file_and_logpos_to_a_folder_are_one_line(engine_factory, tmp_path):
    engine = engine_factory(HF_FIXTURES / "base", dtype="float32", window=W, **RESIDENT)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(StrataError, match="cannot save the state"):
        engine.save_state(a_file / "state")
    with pytest.raises(StrataError, match="cannot write the logpos file"):
        engine.write_logpos([1, 2, 3, 4], tmp_path)


@pytest.mark.parametrize("name,value", [("model.norm.weight", np.nan),
                                        ("model.layers.0.mlp.gate.weight", np.inf),
                                        ("model.layers.1.mlp.experts.3.down_proj.weight", np.nan)])
def test_non_finite_weights_refused(base_copy, cache_dir, name, value):
    """A NaN final norm, a +inf router row, a NaN expert: one line naming the tensor, not NUL bytes and exit 0."""
    tensors = load_file(base_copy / "model.safetensors")
    bad = tensors[name].copy()
    bad.reshape(-1)[np.random.default_rng(5).integers(bad.size)] = value
    save_file(dict(tensors, **{name: bad}), base_copy / "model.safetensors")
    msg = refused(base_copy, cache_dir)
    assert name in msg and "non-finite" in msg, msg


def test_non_finite_bfloat16_weights_refused(base_copy, cache_dir):
    import ml_dtypes
    tensors = load_file(base_copy / "model.safetensors")
    name = "lm_head.weight"
    bad = tensors[name].astype(ml_dtypes.bfloat16)
    bad.reshape(-1)[3] = np.inf
    save_file(dict(tensors, **{name: bad}), base_copy / "model.safetensors")
    msg = refused(base_copy, cache_dir)
    assert name in msg and "non-finite" in msg, msg


def test_integer_weights_refused(base_copy, cache_dir):
    tensors = load_file(base_copy / "model.safetensors")
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    save_file(dict(tensors, **{name: np.ones(tensors[name].shape, np.int32)}), base_copy / "model.safetensors")
    msg = refused(base_copy, cache_dir)
    assert name in msg and "int32" in msg and "floating-point" in msg, msg


def test_save_state_keeps_the_model_files_refuses_a_full_folder_and_never_leaves_half_a_state(
        engine_factory, cache_dir, tmp_path, monkeypatch):
    """A state behaves as its model (sampling defaults, extra eos ids, chat template); a folder that holds a model
    or a state is refused in one line unless overwrite=True, which replaces it; a save that fails (a full disk)
    leaves the target as it was and no temporary folder beside it."""
    import json
    from strata_jax.io import checkpoint
    src = copy_fixture(tmp_path, "base")
    (src / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "eos_token_id": [3, 7]}))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
         "eos_token": "<e>"}))
    engine = engine_factory(src, dtype="float32", window=W, **RESIDENT)
    state = tmp_path / "state"
    engine.save_state(state)
    restored = Engine.from_pretrained(state, verbose=False, dtype="float32", window=1, cache_dir=str(cache_dir),
                                      **RESIDENT)
    assert restored.generation_defaults == engine.generation_defaults
    assert restored.generation_defaults.temperature == 0.7 and restored.end_of_turn_ids == engine.end_of_turn_ids
    assert restored.chat_template is not None and restored.chat_template.source == engine.chat_template.source

    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for target in (src, state):  # a model folder, a saved state
        msg = one_line_refusal(engine.save_state, target)
        assert "holds a model or a saved state" in msg and "--overwrite" in msg
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # untouched
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    assert "not empty" in one_line_refusal(engine.save_state, tmp_path / "notes")

    real_write = checkpoint.Path.write_bytes

    def write_bytes(self, data):
        if self.name == "generation_config.json" and ".saving-" in str(self.parent):
            raise OSError(28, "No space left on device")
        return real_write(self, data)
    monkeypatch.setattr(checkpoint.Path, "write_bytes", write_bytes)
    for target, overwrite in ((tmp_path / "new_state", False), (state, True)):
        held = sorted(p.name for p in target.iterdir()) if target.exists() else None
        msg = one_line_refusal(engine.save_state, target, overwrite=overwrite)
        assert "No space left on device" in msg and "nothing was written" in msg
        assert (sorted(p.name for p in target.iterdir()) if target.exists() else None) == held
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    engine.save_state(state, overwrite=True)  # replaces the state
    again = Engine.from_pretrained(state, verbose=False, dtype="float32", window=1, cache_dir=str(cache_dir),
                                   **RESIDENT)
    ids = np.random.default_rng(3).integers(0, engine.cfg.vocab_size, 9).tolist()
    assert np.array_equal(again.prefill_logits(ids), restored.prefill_logits(ids))


def test_logpos_on_a_full_disk_is_one_line_and_leaves_no_partial_file(engine_factory, tmp_path, monkeypatch):
    from strata_jax.io import logpos
    engine = engine_factory(HF_FIXTURES / "base", dtype="float32", window=W, **RESIDENT)

    def full_disk(self, start_pos, logits, targets=None):
        self._file.write('{"pos":0,"tar')  # a line cut short, as a full disk leaves it
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(logpos.LogposWriter, "write_many", full_disk)
    path = tmp_path / "out.logpos"
    msg = one_line_refusal(engine.write_logpos, [1, 2, 3, 4], path)
    assert "No space left on device" in msg and not path.exists()


def test_an_unreadable_model_folder_is_one_line(tmp_path, cache_dir, monkeypatch):
    """A folder the user may not search: Path.is_file() raises PermissionError there (running as root, the test
    makes it so): one line from the CLI's early check and from from_pretrained."""
    import pathlib
    from strata_jax import decode, options
    folder = copy_fixture(tmp_path, "base")
    real = pathlib.Path.is_file

    def is_file(self):
        if str(self).startswith(str(folder)):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)
    monkeypatch.setattr(pathlib.Path, "is_file", is_file)
    opts = options.build(options.EngineOptions, {"cache_dir": str(cache_dir)})
    msg = one_line_refusal(decode.check_prompt_fits, str(folder), opts, "hi")
    assert "cannot read the model folder" in msg and "Permission denied" in msg
    assert "Permission denied" in refused(folder, cache_dir)


def test_transposed_copies_are_exact():
    """Leaf.from_hf's transposed copy (made in blocks) is x.T, contiguous, for shapes on and off the block size."""
    import ml_dtypes
    from strata_jax.model.weights import TRANSPOSE_BLOCK, transposed
    rng = np.random.default_rng()
    b = TRANSPOSE_BLOCK
    for shape in ((3, 5), (b, b), (2 * b + 7, b + 1), (int(rng.integers(1, 3 * b)), int(rng.integers(b, 3 * b)))):
        for dtype in (np.float32, ml_dtypes.bfloat16):
            x = rng.standard_normal(shape).astype(dtype)
            got = transposed(x)
            assert got.flags.c_contiguous and got.dtype == x.dtype and np.array_equal(got, x.T), (shape, dtype)
