"""Building an engine: the model folder, a saved state or random weights read into place (experts into host memory
with offload), the placement built, then the Engine constructed over them (which compiles its graphs). The
Engine's `from_pretrained` / `from_random` call these; the persistent compilation cache is set up here too.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from strata_jax.engine import parallel as parallel_mod
from strata_jax.engine import plan as plan_mod
from strata_jax.errors import StrataError, make_writable_folder, unreadable_folder
from strata_jax.io import checkpoint
from strata_jax.io.chat import load_chat_template, load_generation_config
from strata_jax.io.embedded import resolve_model
from strata_jax.io.tokenizer import load_tokenizer
from strata_jax.model.config import ModelConfig, check_eos_ids, config_from_dict
from strata_jax.model.weights import abstract_weights, param_bytes, random_weights, stack_layers
from strata_jax.offload import placement as placement_mod
from strata_jax.offload import slots as slots_mod
from strata_jax.options import EngineOptions, build, split_options


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_CACHE_TROUBLE = {"said": False, "quiet": False}


def _cache_warnings(show=warnings.showwarning):
    """JAX warns once per entry of the persistent compilation cache that it cannot read or write (a corrupt or
    truncated file), with the whole key: nine warnings for one damaged cache, even under --quiet. The graph is
    compiled instead, so it is not an error: one line per process (none when quiet)."""
    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith(("Error reading persistent compilation cache", "Error writing persistent compilation "
                                                                         "cache")):
            if not _CACHE_TROUBLE["said"] and not _CACHE_TROUBLE["quiet"]:
                log(f"note: the compilation cache ({jax.config.jax_compilation_cache_dir}) has entries it cannot "
                    f"{'read' if 'reading' in text else 'write'} ({text.split(': ', 1)[-1][:120]}); those graphs "
                    "are compiled instead")
            _CACHE_TROUBLE["said"] = True
            return
        show(message, category, filename, lineno, file, line)
    return showwarning


warnings.showwarning = _cache_warnings()


def enable_compilation_cache(cache_dir: Path, quiet: bool = False) -> Path:
    _CACHE_TROUBLE["quiet"] = quiet
    path = cache_dir / "jax"
    make_writable_folder(path, f"cache_dir {cache_dir}: not a writable folder for the compilation cache")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def load(engine_cls, path: str | Path | None = None, verbose: bool = True, **options):
    """Engine.from_pretrained: the model folder (or a saved state, or the embedded model) read, converted, placed."""
    engine_opts, request_opts = split_options(options)
    if request_opts:
        raise StrataError(f"{sorted(request_opts)} are generate() options, not engine options")
    opts = build(EngineOptions, engine_opts)
    cache_dir = opts.resolved_cache_dir()
    enable_compilation_cache(cache_dir, quiet=not verbose)
    path = resolve_model(path, cache_dir)
    try:  # a folder that cannot be searched: Path.is_file() and exists() raise PermissionError
        path.is_file() or (path / "config.json").exists()
    except OSError as e:
        raise unreadable_folder(path, e) from None
    if path.is_file():
        raise StrataError(f"model {path} is a file, not a folder (a model folder holds config.json, "
                          "*.safetensors and tokenizer.json)")
    if not path.is_dir():
        raise StrataError(f"model folder {path} does not exist")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise StrataError(f"no config.json in {path}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise StrataError(f"{cfg_path}: malformed config.json: {e}") from None
    cfg = config_from_dict(raw, where=str(cfg_path))
    if opts.expert_dtype == "auto" and checkpoint.is_state_dir(path):  # auto: the form the state was saved in (a
        # GGUF's experts kept as read, per family)
        opts = dataclasses.replace(opts, expert_dtype=checkpoint.read_state_meta(path).get("expert_dtype", "auto"))
    if opts.expert_dtype == "auto" and any(cfg.sparse_layers):
        from strata_jax.io.gguf_file import kept_expert_format
        kept = kept_expert_format(path)  # a GGUF whose experts one format holds as read (int4-q4k, int8-g32, ...)
        if kept:
            opts = dataclasses.replace(opts, expert_dtype=kept)
    if not checkpoint.is_state_dir(path):
        checkpoint.check_layer_count(path, cfg)
    say = log if verbose else (lambda _: None)
    dtype = jnp.dtype(opts.dtype)
    slots, why, host = plan_mod.plan_slots(cfg, opts)
    t0 = time.perf_counter()
    fmt = placement_mod.expert_format(opts, cfg)
    place = parallel_mod.weight_placer(cfg, opts) or checkpoint.default_place  # parallel=layers: per block
    if checkpoint.is_state_dir(path):
        saved = checkpoint.read_state_meta(path)
        if saved["dtype"] != opts.dtype:
            raise StrataError(f"the saved state at {path} holds {saved['dtype']} weights, but dtype={opts.dtype}")
        if saved.get("expert_dtype", "auto") != opts.expert_dtype:  # states are saved in their experts' form
            raise StrataError(f"the saved state at {path} holds expert_dtype={saved.get('expert_dtype', 'auto')} "
                              f"experts, but expert_dtype={opts.expert_dtype} (load it with that, or the checkpoint)")
        weights = checkpoint.restore_state(path, restore_target(cfg, dtype, host, fmt))
        if host is not None:
            host.keep_restored(cfg, weights, quantized=bool(fmt))
        if fmt:
            say(placement_mod.quantized_line(cfg, weights, opts, host is not None).replace("quantized at load",
                                                                                           "saved state"))
    else:
        from strata_jax.io.gguf_file import say_formats  # a GGUF's folder (resolve_model): types read, formats held
        say_formats(path, opts.dtype, fmt, say)
        weights = checkpoint.load_weights(path, cfg, dtype, place=place,
                                          place_experts=host.place if host else None,
                                          progress=_progress(say, cfg), expert_format=fmt,
                                          place_scales=host.place_scale if host else None)
        if fmt:
            say(placement_mod.quantized_line(cfg, weights, opts, host is not None))
    try:
        tok = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
        template, generation = load_chat_template(path), load_generation_config(path)
    except OSError as e:  # an unreadable file (permissions)
        raise unreadable_folder(path, e) from None
    check_eos_ids(generation.eos_token_ids, cfg.vocab_size, str(path / "generation_config.json"))
    say(f"model: {path} ({cfg.num_layers} layers, {cfg.num_sparse_layers} MoE, {cfg.num_experts} experts "
        f"top-{cfg.num_experts_per_tok}, {param_bytes(weights) / 2**20:.1f} MiB of {opts.dtype} weights) "
        f"loaded in {time.perf_counter() - t0:.1f} s")
    engine = assemble(engine_cls, cfg, weights, opts, host, slots, why, say, tokenizer=tok, model_dir=path,
                           raw_config=raw, verbose=verbose, generation=generation)
    if not checkpoint.is_state_dir(path) and checkpoint.has_mtp(path, cfg):
        engine.attach_mtp(checkpoint.load_mtp(path, cfg, dtype))
        say(f"MTP module: {param_bytes(engine.mtp) / 2**20:.1f} MiB on the device (draft=mtp drafts with it)")
    engine.chat_template = template
    return engine

def random_engine(engine_cls, cfg: ModelConfig, seed: int = 0, verbose: bool = True, embed_scale: float = 1.0,
                  **options):
    """Engine.from_random: random weights of a model shape, made on the device (experts to host memory with offload)."""
    opts = build(EngineOptions, options)
    enable_compilation_cache(opts.resolved_cache_dir(), quiet=not verbose)
    say = log if verbose else (lambda _: None)
    dtype = jnp.dtype(opts.dtype)
    slots, why, host = plan_mod.plan_slots(cfg, opts)
    t0 = time.perf_counter()
    # made stacked directly (quantized experts are made per layer, then stacked by _assemble)
    stacked = slots is None and plan_mod.scans(cfg, opts) and not placement_mod.expert_format(opts)
    weights = random_weights(cfg, seed, dtype, place_experts=host.place if host else None,
                                   progress=say if stacked else _progress(say, cfg), stacked=stacked,
                                   expert_format=placement_mod.expert_format(opts, cfg),
                                   place_scales=host.place_scale if host else None,
                                   layer_device=parallel_mod.layer_device(cfg, opts))
    if embed_scale != 1.0:
        weights = weights.replace(embed=(weights.embed * embed_scale).astype(weights.embed.dtype))
    say(f"model: random {cfg.num_layers} layers, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
        f"{param_bytes(weights) / 2**30:.2f} GiB of {opts.dtype} weights, made in "
        f"{time.perf_counter() - t0:.1f} s")
    return assemble(engine_cls, cfg, weights, opts, host, slots, why, say, verbose=verbose)

def assemble(engine_cls, cfg, weights, opts, host, slots, why, say, **kwargs):
    if slots is None:
        if any(cfg.sparse_layers):
            say(f"expert cache: every expert on the device, offload off ({why})")
        placement = None
        if plan_mod.scans(cfg, opts) and parallel_mod.layer_device(cfg, opts) is None:  # parallel=layers: per device
            # Stacked here, where nothing else holds the loaded arrays: one leaf at a time, the old freed.
            weights = stack_layers(weights, consume=True)
            say(f"layers: {cfg.num_layers} stacked, one scanned body per window graph (layer_loop=scan)")
    else:
        if parallel_mod.devices_for(opts) is not None and opts.parallel == "experts":
            opts = dataclasses.replace(opts, pcie_frac="1")  # the experts split fetches every miss over PCIe
        placement = placement_mod.build(cfg, opts, weights, host, slots, why)
    return engine_cls(cfg, weights, opts, placement=placement, **kwargs)


def restore_target(cfg: ModelConfig, dtype, host: "placement_mod.HostExperts | None", expert_format=None):
    """Shapes and placements a saved state restores into (orbax): the declared abstract weights, experts into host
    memory with offload, their scales (quantized experts) on the device."""
    return abstract_weights(cfg, dtype, expert_format, sharding=slots_mod.device_sharding(),
                                  expert_sharding=host.sharding if host is not None else None)


PROGRESS_EVERY_S = 20.0  # a slow load (a quantized GGUF, a slow disk) says its layer at least this often


def _progress(say, cfg: ModelConfig):
    """The loader's per-layer lines, every eighth of the layers (or PROGRESS_EVERY_S since the last), with the
    time spent and an estimate of the time left."""
    step = max(1, cfg.num_layers // 8)
    start = last = time.perf_counter()

    def progress(line: str) -> None:
        nonlocal last
        layer = int(line.split()[-1].split("/")[0])
        now = time.perf_counter()
        if layer % step == 0 or layer == cfg.num_layers or now - last >= PROGRESS_EVERY_S:
            last, spent = now, now - start
            left = spent / layer * (cfg.num_layers - layer)
            say(f"{line} ({spent:.1f} s" + (f", about {left:.0f} s to go)" if layer < cfg.num_layers else ")"))
    return progress
