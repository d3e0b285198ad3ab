"""Command line: `python -m strata_jax.decode --prompt "..."` writes the prompt and its continuation to stdout as
the tokens are accepted; start-up lines and the statistics go to stderr (`--quiet`: neither).

Every flag is an engine or request option of the same name (strata_jax.options). Bad input gives one line on
stderr and a non-zero exit status, never a traceback.
"""
from __future__ import annotations

import os
import signal
import sys


def _exit_now(code: int) -> None:
    """Leave at once after a failed or interrupted request: a window may still be in flight on the runtime's
    threads, its host callback waiting for the interpreter lock or for the pool, and the interpreter's shutdown
    (joining threads, tearing the backend down) must not wait on it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


_DECODING = False  # set once the engine is built: from then on Ctrl-C ends the text cleanly (KeyboardInterrupt)


def _interrupt(signum, frame) -> None:
    """Ctrl-C exits 130 wherever it lands. Until the engine is built (imports, loading, compiling) it leaves at
    once: a KeyboardInterrupt there lands inside C extensions' initialisation (an ImportError, or an abort) or in
    XLA's gc callback, where Python prints and drops it (and the run went on to decode every token). While decoding
    it raises KeyboardInterrupt, so the text so far ends with its line; and the process leaves on its own a second
    later if nothing caught it."""
    if not _DECODING:
        _exit_now(130)
    import threading  # here: the handler is set before any import that Ctrl-C could interrupt
    timer = threading.Timer(1.0, _exit_now, (130,))
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _install_interrupt() -> None:
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a background job keeps ignoring it (Unix)
        signal.signal(signal.SIGINT, _interrupt)
    sys.unraisablehook = _quiet_unraisable()


def _quiet_unraisable(hook=sys.unraisablehook):
    """A KeyboardInterrupt dropped inside a runtime callback prints "Exception ignored in ..." and a traceback:
    the exit is on its way (_interrupt), so say nothing."""
    def unraisable(info):
        if not isinstance(info.exc_value, KeyboardInterrupt):
            hook(info)
    return unraisable


if __name__ == "__main__":  # python -m strata_jax.decode: before the imports below (absl; JAX comes with the engine)
    _install_interrupt()

import faulthandler  # noqa: E402
import functools  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from strata_jax import options  # noqa: E402
from strata_jax.errors import StrataError, unreadable_folder  # noqa: E402
from strata_jax.io.tokenizer import TextStream  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "reference", "Model folder (config.json, *.safetensors, tokenizer.json), a .gguf file "
                    "(qwen3moe; the first part of a split one), a folder "
                    "written by --save_state, 'reference' (the committed MoE trained on Python code: 64 experts "
                    "top-8), 'reference-next' (its Qwen3-Next-shaped sibling, with an MTP module for --draft=mtp) or 'embedded' (a "
                    "tiny random MoE, for tests).", flag_values=FLAGS)
flags.DEFINE_string("prompt", "class Stack:\n    def __init__(self):\n", "Prompt text.", flag_values=FLAGS)
flags.DEFINE_string("prompt_file", "", "Read the prompt from this file (overrides --prompt).", flag_values=FLAGS)
flags.DEFINE_string("save_state", "", "After loading, save the converted weights here with orbax (a new or empty "
                    "folder; see --overwrite).", flag_values=FLAGS)
flags.DEFINE_bool("overwrite", False, "Let --save_state replace a folder that is not empty (a model, another state).",
                  flag_values=FLAGS)
flags.DEFINE_bool("chat", False, "Talk through the model's chat template: --prompt is the user's turn; without a "
                  "prompt, a REPL on stdin.", flag_values=FLAGS)
flags.DEFINE_bool("quiet", False, "Only the text (stdout) and errors: no start-up lines, no statistics (stderr).",
                  flag_values=FLAGS)
options.define_flags(FLAGS)


def parse_flags(argv: list[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    from strata_jax.engine.api import Engine  # imported here so `--help` and flag errors stay fast

    engine_opts = options.from_flags(options.EngineOptions, FLAGS)
    request = options.from_flags(options.RequestOptions, FLAGS)
    prompt = FLAGS.prompt
    if FLAGS.prompt_file:
        prompt = read_prompt_file(FLAGS.prompt_file)
    if FLAGS.save_state:  # refused before a minute of loading, not after
        from strata_jax.io.checkpoint import check_state_target
        check_state_target(FLAGS.save_state, FLAGS.overwrite)
    repl = FLAGS.chat and not (FLAGS["prompt"].present or FLAGS.prompt_file)
    if not repl:
        check_prompt_fits(FLAGS.model, engine_opts, prompt)
    engine = Engine.from_pretrained(FLAGS.model, verbose=not FLAGS.quiet,
                                    **{k: getattr(engine_opts, k) for k in engine_opts.__dataclass_fields__})
    if FLAGS.save_state:
        engine.save_state(FLAGS.save_state, overwrite=FLAGS.overwrite)
        print(f"saved state: {FLAGS.save_state}", file=sys.stderr)
    global _DECODING
    _DECODING = True
    # Sampling flags not given on the command line take the model's generation_config.json.
    kwargs = {k: getattr(request, k) for k in request.__dataclass_fields__ if k not in ("logpos", "logpos_read")
              and not (k in ("temperature", "top_p", "top_k") and not FLAGS[k].present)}
    if FLAGS.chat:
        chat(engine, [] if repl else [prompt], kwargs)
        return
    ids = engine.encode(prompt)
    logpos = options.logpos_path(request)
    if logpos:
        n = engine.write_logpos(ids, logpos, read=request.logpos_read)
        print(f"logpos: {n} positions of the prompt, read through the {request.logpos_read}, written to {logpos}",
              file=sys.stderr, flush=True)
    respond(engine, ids, prompt, kwargs)


PROMPT_FILE_MAX_BYTES = 256 * 2**20  # far beyond any context in tokens; /dev/zero or a stray disk image is refused


def read_prompt_file(name: str) -> str:
    """--prompt_file's text, read with a bound (a device or a pipe may never end)."""
    try:
        with open(name, "rb") as f:
            data = f.read(PROMPT_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise StrataError(f"cannot read --prompt_file {name}: {e.strerror or e}") from None
    if len(data) > PROMPT_FILE_MAX_BYTES:
        raise StrataError(f"--prompt_file {name} holds more than {PROMPT_FILE_MAX_BYTES >> 20} MiB: not a prompt")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StrataError(f"cannot read --prompt_file {name}: not UTF-8 text ({e})") from None


def respond(engine, ids: list[int], shown_prompt: str, kwargs: dict, drop_stop: bool = False) -> list[int]:
    """One request, its text on stdout as it is accepted (after `shown_prompt`, sent with the first token: a
    request refused before it leaves stdout empty); the statistics on stderr (--quiet: none). drop_stop: leave a
    final end-of-turn token out of the text (chat)."""
    text, shown = TextStream(engine.decode), []

    def show(piece: str) -> None:
        if not shown:
            sys.stdout.write(shown_prompt)
            shown.append(True)
        sys.stdout.write(piece)
        sys.stdout.flush()

    held: list[int] = []  # chat: an end-of-turn token is held back until the request ends

    def on_token(token: int) -> None:
        if drop_stop and token in stops:
            held.append(token)
            return
        for t in held:
            show(text.push(t))
        held.clear()
        show(text.push(token))
    stops = engine.end_of_turn_ids
    try:
        out = engine.generate(ids, on_token=on_token, **kwargs)
    except BaseException:
        if shown:  # the text so far ends with its line, before the error line
            show(text.flush() + "\n")
        raise
    show(text.flush() + "\n")
    wanted = kwargs.get("max_new_tokens", 0)
    ended = out and out[-1] in stops and not kwargs.get("ignore_eos")
    if len(out) < wanted and not ended and len(ids) + len(out) >= engine.context:
        # the budget was cut to the context: said, even under --quiet (the text is shorter than asked)
        print(f"warning: stopped at the end of the context ({engine.context} tokens): {len(out)} of "
              f"max_new_tokens={wanted} generated", file=sys.stderr, flush=True)
    if not FLAGS.quiet:
        say = functools.partial(print, file=sys.stderr, flush=True)
        say(engine.stats.last.summary())
        say(engine.stats.last.draft_summary())
        if engine.placement:
            say(f"experts, prefill: {engine.stats.last.prefill_experts.summary()}")
            say(f"experts, decode: {engine.stats.last.decode_experts.summary()}")
            for line in engine.stats.total.decode_experts.approx_lines(engine.approx):
                say(line)
    return out


def chat(engine, prompts: list[str], kwargs: dict) -> None:
    """--chat: each prompt is a user turn through the model's chat template and the reply streams out; with no
    prompt, a REPL (an empty line or end of input ends it). Later turns reuse the earlier ones' KV rows."""
    messages: list[dict] = []
    if engine.chat_template is None:
        raise StrataError(f"--chat: {engine.model_dir} has no chat template (chat_template in "
                          "tokenizer_config.json, or chat_template.jinja)")
    interactive = not prompts
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return
            if not line.strip():
                return
        elif prompts:
            line = prompts.pop(0)
        else:
            return
        messages.append({"role": "user", "content": line})
        ids = engine.chat_ids(messages)
        out = respond(engine, ids, "", kwargs, drop_stop=True)
        messages.append({"role": "assistant",
                         "content": engine.decode([t for t in out if t not in engine.end_of_turn_ids])})


def check_prompt_fits(model: str, engine_opts, prompt: str) -> None:
    """Refuse a prompt longer than the context before loading or compiling anything."""
    from strata_jax.io.embedded import resolve_model
    if not prompt:
        raise StrataError("the prompt is empty: pass --prompt=... or --prompt_file=...")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # invalid bytes on the command line arrive as surrogates
        raise StrataError("the prompt is not valid UTF-8") from None
    folder = resolve_model(model, engine_opts.resolved_cache_dir())
    try:
        _check_prompt_fits(folder, model, engine_opts, prompt)
    except OSError as e:
        raise unreadable_folder(folder, e) from None


def _check_prompt_fits(folder, model: str, engine_opts, prompt: str) -> None:
    from strata_jax.model.config import load_config
    from strata_jax.engine.plan import context_and_chunk
    from strata_jax.io.tokenizer import load_tokenizer
    if folder.is_file():
        raise StrataError(f"--model={model} is a file, not a folder (a model folder holds config.json, "
                          "*.safetensors and tokenizer.json)")
    if not (folder / "config.json").is_file():
        return  # from_pretrained gives the precise error
    if not (folder / "tokenizer.json").is_file():
        raise StrataError(f"no tokenizer.json in {folder}: the command line takes text, which needs the model's "
                          "tokenizer")
    context, _ = context_and_chunk(load_config(folder), engine_opts)
    n = len(load_tokenizer(folder).encode(prompt).ids)
    if n >= context:
        raise StrataError(f"the prompt has {n} tokens but the context holds {context} "
                          f"(at least one must be left to generate; see --context)")


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)  # absl's INFO lines (backend probing) are noise here
    # `kill -USR1 <pid>` writes every thread's Python stack to stderr: what a stuck run is waiting for.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]} (flags look like --name=value)", file=sys.stderr)
        sys.exit(2)
    try:
        run()
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        _exit_now(1)
    except KeyboardInterrupt:
        _exit_now(130)


def print_help() -> None:
    """This command's flags, by the module that defines them (absl's own logging flags left out): absl's --help
    lists only the main module's, and a console script's main module defines none."""
    modules = [m for m in FLAGS.flags_by_module_dict() if not m.startswith("absl")]
    print((__doc__ or "").strip() + "\n\n" + "\n\n".join(FLAGS.module_help(m) for m in modules))


def cli() -> None:
    """The `strata-decode` console script (pyproject.toml)."""
    _install_interrupt()
    if any(a in options.HELP_FLAGS for a in sys.argv[1:]):
        try:
            print_help()
            sys.stdout.flush()
        except BrokenPipeError:  # `strata-decode --help | head`
            _exit_now(0)
        sys.exit(0)
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
