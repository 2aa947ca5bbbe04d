"""The bodies of `kestrel generate`, `init-random`, `serve` and `chat` (the parser is in `kestrel.serve.cli`).
Heavy modules (torch, the engine, uvicorn) are imported inside each command, so building the parser stays
light."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import socket
import sys
import threading
import time

from kestrel.serve import arg_types
from kestrel.utils.errors import ConfigError, KestrelError


def engine_config(args):
    """The EngineConfig of the engine flags (`_add_engine_args` in kestrel.serve.cli)."""
    from kestrel.config import EngineConfig

    if args.kv_cache_gb is not None and args.kv_cache_gb * 2**30 < 1:
        raise KestrelError("--kv-cache-gb must be > 0")
    try:
        return EngineConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            max_running_requests=args.max_running_requests,
            page_size=args.page_size,
            index_key_dtype=args.index_key_dtype,
            mem_fraction=args.mem_fraction,
            kv_cache_bytes=None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30),
            max_model_len=args.max_model_len,
            chunked_prefill_size=args.chunked_prefill_size,
            disable_cuda_graph=args.disable_cuda_graph,
            cuda_graph_short_len=args.cuda_graph_short_len,
            disable_overlap_schedule=args.disable_overlap_schedule,
            max_queued_requests=getattr(args, "max_queued_requests", 4096),
            enable_prefix_cache=not args.disable_prefix_cache,
            checkpoint_interval=args.checkpoint_interval,
            num_checkpoints=args.num_checkpoints,
            hicache_host_bytes=int(args.hicache_host_gb * 2**30),
            hicache_disk_dir=args.hicache_disk_dir,
            hicache_disk_bytes=int(args.hicache_disk_gb * 2**30),
        )
    except ConfigError as e:  # its message names its fields (for LLM(...)); here the user gave flags
        raise ConfigError(_as_flags(str(e), args)) from None


def build_engine(config, args):
    """The Engine of `config` (`engine_config(args)`); its config errors (a --max-model-len past the model's
    limit) name the flags too."""
    from kestrel.engine.engine import Engine

    try:
        return Engine(config)
    except ConfigError as e:
        raise ConfigError(_as_flags(str(e), args)) from None


def _as_flags(message: str, args) -> str:
    """An EngineConfig message in the flags that set the fields it names: `hicache_host_bytes` is
    `--hicache-host-gb`, `enable_prefix_cache` is `--disable-prefix-cache` left out."""
    from kestrel.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    message = message.replace("enable_prefix_cache must be on", "leave out --disable-prefix-cache")
    return arg_types.as_flags(
        message, args, lambda name: name.replace("_bytes", "_gb") if name in fields else None
    )


def utf8_text(text: str, what: str) -> str:
    """`text` as given, or a KestrelError where it holds bytes that are not UTF-8 (an argument or a line read in
    another encoding reaches Python as lone surrogates, which the tokenizer refused with a traceback)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) & 0xFF  # surrogateescape: U+DC80..U+DCFF stand for the bytes 0x80..0xFF
        raise KestrelError(f"{what} is not valid UTF-8 (byte 0x{byte:02x} at character {e.start})") from None
    return text


def cmd_generate(args) -> int:
    from kestrel.models.generate import generate
    from kestrel.models.loader import build_model
    from kestrel.tokenizer import tokenizer_for
    from kestrel.utils.device import resolve_device, resolve_dtype

    utf8_text(args.prompt, "--prompt")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tokenizer = tokenizer_for(args.model)
    model = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        text = args.prompt
    prompt_ids = tokenizer.encode(text)
    if not prompt_ids:
        raise KestrelError("--prompt: the prompt encodes to no tokens")
    if len(prompt_ids) + args.max_new_tokens > model.config.max_position_embeddings:
        raise KestrelError(
            f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens exceeds the model's context "
            f"of {model.config.max_position_embeddings} tokens"
        )
    if max(prompt_ids) >= model.config.vocab_size:
        raise KestrelError("the tokenizer produced ids outside the model's vocabulary; wrong tokenizer?")
    start = time.perf_counter()
    out = generate(
        model,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_ids=tuple(model.config.eos_token_ids),
    )
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(out))
    print(
        f"[kestrel] model={args.model} layers={model.config.layer_pattern} device={device} dtype={dtype} "
        f"prompt={len(prompt_ids)} tokens, generated={len(out)} tokens in {elapsed:.2f}s "
        f"({len(out) / max(elapsed, 1e-9):.1f} tokens/s, reference path{' on CUDA' if device.type == 'cuda' else ''})",
        file=sys.stderr,
    )
    return 0


def cmd_init_random(args) -> int:
    import torch

    from kestrel.config import ModelConfig
    from kestrel.models.kimi import KimiForCausalLM
    from kestrel.models.loader import init_random_weights
    from kestrel.models.weights import save_checkpoint
    from kestrel.presets import preset_hf_config
    from kestrel.tokenizer import save_byte_tokenizer

    hf = preset_hf_config(args.preset, args.format)
    if args.preset not in ("tiny", "mini"):  # a byte tokenizer is written beside the weights
        raise KestrelError(
            f"--preset {args.preset}: init-random writes tiny or mini (with a byte tokenizer); the demo presets "
            "need their BPE tokenizer: `kestrel train --model " + args.preset + "` builds one"
        )
    config = ModelConfig.from_dict(hf)
    if args.mxfp4:
        if args.format != "kimi_k3":
            raise KestrelError("--mxfp4 needs --format kimi_k3")
        config = config.replace(experts_mxfp4=True)
    if args.out.exists() and not args.out.is_dir():
        raise KestrelError(f"--out {args.out}: exists and is not a folder")
    # what init-random writes: the weights, their config and the tokenizer's files (a tokenizer of the user's
    # own alone in the folder had been replaced without a word)
    ours = {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    held = [p.name for p in args.out.glob("*") if p.name in ours or p.suffix == ".safetensors"]
    if held and not args.overwrite:
        raise KestrelError(
            f"--out {args.out} already holds a checkpoint or its files ({', '.join(sorted(held)[:3])}); give "
            "--overwrite to replace them, or another folder"
        )
    model = init_random_weights(
        KimiForCausalLM(config, getattr(torch, args.dtype)), args.seed, scheme=args.init
    )
    max_bytes = args.max_shard_mb * 2**20 if args.max_shard_mb else None
    save_checkpoint(model, args.out, max_shard_bytes=max_bytes)
    save_byte_tokenizer(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"[kestrel] wrote {args.preset} ({args.format}, {n / 1e6:.1f}M parameters, "
        f"layers {config.layer_pattern}) to {args.out}",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args) -> int:
    import logging

    import uvicorn

    from kestrel.engine.async_engine import AsyncEngine
    from kestrel.env import env_field
    from kestrel.serve.api import build_app
    from kestrel.utils.collector import freeze_startup_objects

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")
    config = engine_config(args)
    sock = listen(args.host, args.port)  # before the model loads: a port in use is one line, at once
    try:
        engine = build_engine(config, args)
    except BaseException:
        sock.close()
        raise
    log_level = args.log_level or env_field("log_level")
    # Configured after the engine is built, whose memory plan is printed below rather than logged twice.
    logging.basicConfig(level=log_level.upper(), format="[kestrel] %(levelname)s %(name)s: %(message)s")
    names = args.served_model_name or [args.model]
    if args.warmup == "on" or (args.warmup == "auto" and engine.device.type == "cuda"):
        print("[kestrel] warming up (kernels compile on first use) ...", file=sys.stderr, flush=True)
        try:
            seconds = engine.warm_up()
        except Exception:
            print("[kestrel] the warm-up failed (--warmup off skips it); its error follows", file=sys.stderr)
            raise
        print(f"[kestrel] warmed up in {seconds:.1f} s", file=sys.stderr)
    frozen = freeze_startup_objects()  # full collections no longer walk the model and graphs mid-request
    logging.getLogger("kestrel.serve").debug("%d startup objects frozen out of the garbage collector", frozen)
    async_engine = AsyncEngine(engine)
    app = build_app(
        async_engine,
        names,
        api_key=args.api_key,
        max_request_mb=args.max_request_mb,
        allowed_origins=args.allowed_origins,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"[kestrel] {engine.plan.describe()}", file=sys.stderr)
    print(
        f"[kestrel] serving {' / '.join(map(repr, names))} (layers {engine.model.config.layer_pattern}, "
        f"device {engine.device}) "
        f"at http://{host}:{args.port}/v1{' (API key required)' if args.api_key else ''}",
        file=sys.stderr,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """Ctrl-C or SIGTERM: uvicorn stops taking connections and waits for the open ones, so the engine
            stops now, and every open stream ends with an error event and [DONE] (not cut after the graceful
            timeout with a traceback in the log)."""
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                async_engine.shutdown()

    server = Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # the Ctrl-C uvicorn re-raises once it has shut down: the way to stop a server
        pass
    finally:
        async_engine.shutdown()
        sock.close()
    if not server.started:  # uvicorn logged why
        return 1
    # Out without the interpreter's teardown, whose garbage collection of Triton's compiled objects prints dozens
    # of nanobind "leaked" lines after a clean Ctrl-C (the engine is shut down and the logs flushed here).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to serve on (SO_REUSEADDR, as uvicorn binds its own); KestrelError
    naming the address where it cannot be had (in use, a host this machine is not)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise KestrelError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = "the port is in use (another server?)" if e.errno == errno.EADDRINUSE else e.strerror
        raise KestrelError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def _turn_seed(seed: int, turn: int) -> int:
    """The seed of a chat turn: `seed + turn`, wrapped into int64 (a --seed near 2**63 - 1 overflowed it, a
    ValueError from SamplingParams at the first line)."""
    return (seed + turn + 2**63) % 2**64 - 2**63


def cmd_chat(args) -> int:
    """A terminal chat through the engine: one turn at a time, streamed. /reset clears the history; Ctrl-C
    stops the reply being written; an empty line, EOF or Ctrl-C at the prompt ends the chat."""
    from kestrel.detokenize import IncrementalDetokenizer
    from kestrel.engine.sampling_params import SamplingParams

    if args.system is not None:
        utf8_text(args.system, "--system")
    engine = build_engine(engine_config(args), args)
    tokenizer = engine.tokenizer
    history = [{"role": "system", "content": args.system}] if args.system else []
    start = list(history)
    # a tokenizer without a chat template (or one refusing a system turn): said now, not after the first line
    tokenizer.apply_chat_template([*start, {"role": "user", "content": "hi"}], add_generation_prompt=True)
    print(
        f"[kestrel] chatting with {args.model} (Ctrl-C stops a reply; an empty line quits; /reset starts over)",
        file=sys.stderr,
    )
    # a line that is not UTF-8 reaches utf8_text below (in a UTF-8 locale input() raised UnicodeDecodeError: a
    # traceback)
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C: the shell's prompt on a line of its own
            print()
            break
        if not line:
            break
        if line == "/reset":
            history = list(start)
            continue
        try:
            utf8_text(line, "that line")
        except KestrelError as e:  # a line in another encoding: said, and the chat goes on
            print(f"[kestrel] {e}; type it again", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        prompt = tokenizer.encode(tokenizer.apply_chat_template(history, add_generation_prompt=True))
        room = engine.plan.max_model_len - len(prompt)
        if room < 1:
            print("[kestrel] the conversation no longer fits the context; /reset", file=sys.stderr)
            history.pop()
            continue
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=min(args.max_new_tokens, room),
            seed=_turn_seed(args.seed, len(history)),
        )
        rid = engine.add_request(prompt, params)
        detok, reply = IncrementalDetokenizer(tokenizer, prompt), []
        with _StopOnCtrlC() as ctrl_c:
            while engine.has_unfinished():
                if ctrl_c.pressed and engine.abort(rid):
                    print(" [stopped]", end="", flush=True)
                for out in engine.step():
                    if out.request_id == rid:
                        piece = detok.add(out.new_token_ids) + (detok.flush() if out.finished else "")
                        reply.append(piece)
                        print(piece, end="", flush=True)
        print()
        # a stopped reply stays in the history as far as it went, as the model said it
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


class _StopOnCtrlC:
    """Ctrl-C while a reply streams stops that reply, between engine steps (an interrupt inside a step could
    leave the engine half-updated), and the chat goes on; a second Ctrl-C in the same reply interrupts as
    usual. Outside the main thread (no signal handlers there) it does nothing."""

    def __enter__(self):
        self.pressed, self._previous = False, None
        current = signal.getsignal(signal.SIGINT)
        # (not where Ctrl-C is ignored, nor where a handler outside Python's would not come back)
        if threading.current_thread() is threading.main_thread() and current not in (signal.SIG_IGN, None):
            self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False
