"""The ``tinyloop`` command line.

Each subcommand is one ``_add_<name>(subparsers)`` that declares its parser and sets
``func``, plus one ``cmd_<name>(args) -> int`` that does the work; ``_COMMANDS`` lists the
``_add_*`` functions. TinyLoop errors print ``error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tinyloop.errors import ConfigError, TinyLoopError
from tinyloop.model.artifact import KEY_TOKENIZER, inspect_artifact, save_artifact
from tinyloop.model.config import ModelConfig
from tinyloop.model.presets import PRESETS, init_model, param_count
from tinyloop.tokenizer import Tokenizer, default_tokenizer, export_hf_tokenizer, gpt2_tokenizer
from tinyloop.vocabulary import KV_MODES, KVMode, kv_slots_per_token

__all__ = ["main", "build_parser"]

_TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {"default": default_tokenizer, "gpt2": gpt2_tokenizer}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# -- init ------------------------------------------------------------------------------------


def _add_init(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("init", help="write an artifact with random weights",
                       description="Write a .tinyloop artifact with deterministic random weights.")
    p.add_argument("out", type=Path, help="artifact path to write")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="named config (default: tiny)")
    source.add_argument("--config", type=Path, metavar="FILE.json", help="config JSON file")
    p.add_argument("--seed", type=int, default=0, help="init seed (default: 0)")
    p.add_argument("--tokenizer", choices=sorted(_TOKENIZERS), default="default")
    p.add_argument("--dtype", choices=list(_DTYPES), default="float32", help="stored weight dtype")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a config field; VALUE is JSON (a bare word is a string); "
                        "exit.threshold=0.5 sets a field of exit; repeatable")
    p.set_defaults(func=cmd_init)


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # block_style=peri_ln: a bare word is a string
    return key.split("."), value


def _apply_override(data: dict[str, Any], item: str) -> None:
    keys, value = _parse_override(item)
    target = data
    for key in keys[:-1]:
        if not isinstance(target.get(key), dict):
            raise ConfigError(f"--set {item!r}: {key!r} is not a config object")
        target = target[key]
    target[keys[-1]] = value


def _init_config(args: argparse.Namespace, tokenizer_vocab: int) -> ModelConfig:
    """The preset or file config, then each --set, then vocab_size raised to fit the tokenizer."""
    if args.config is not None:
        try:
            text = args.config.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(args.config)!r}: {exc}") from exc
        data = ModelConfig.from_json(text).to_dict()
    else:
        data = PRESETS[args.preset].to_dict()
    for item in args.overrides:
        _apply_override(data, item)
    config = ModelConfig.from_dict(data)
    if config.vocab_size < tokenizer_vocab:
        config = config.replace(vocab_size=tokenizer_vocab)
    return config


def cmd_init(args: argparse.Namespace) -> int:
    tokenizer = _TOKENIZERS[args.tokenizer]()
    config = _init_config(args, tokenizer.vocab_size)
    model = init_model(config, args.seed).to(_DTYPES[args.dtype])
    save_artifact(args.out, model, tokenizer)
    print(f"wrote {args.out}")
    print(f"parameters: {param_count(config):,}")
    print(f"file size: {_size(args.out.stat().st_size)}")
    return 0


# -- convert ---------------------------------------------------------------------------------


def _add_convert(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face checkpoint directory to an artifact",
                       description="Convert a Hugging Face model directory (config.json, safetensors, "
                                   "tokenizer.json) to a .tinyloop artifact, streaming one tensor at a time.")
    p.add_argument("hf_dir", type=Path, help="the downloaded model directory")
    p.add_argument("out", type=Path, help="artifact path to write")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="weight dtype (default: the checkpoint's)")
    p.add_argument("--family", choices=["auto", "huginn", "ouro", "retrofit", "parcae", "inkling2"], default="auto",
                   help="checkpoint layout (default: auto, from model_type / architectures / Parcae's config; "
                        "inkling2: Inkling-2 loop, plain or NVFP4/MXFP8 experts)")
    p.add_argument("--state-init", choices=["randn", "zeros"],
                   help="initial loop state: seeded truncated normal or zeros (default: randn for Huginn and "
                        "retrofit, the config's state_init for Parcae; Ouro starts from the embeddings)")
    p.add_argument("--max-position", type=int,
                   help="longest sequence (default: the checkpoint's block_size / max_position_embeddings)")
    p.add_argument("--max-tokenizer-mb", type=float, default=64.0,
                   help="the largest tokenizer.json accepted, in MiB (default: 64)")
    p.add_argument("--max-json-mb", type=float, default=16.0,
                   help="the largest of the other JSON files accepted (config.json, tokenizer_config.json, "
                        "generation_config.json, the shard index), in MiB (default: 16)")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from tinyloop.convert import FileLimits, convert

    def progress(done: int, total: int, name: str) -> None:
        if sys.stderr.isatty():
            print(f"\r[{done}/{total}] {name[:60]:<60}", end="" if done < total else "\n",
                  file=sys.stderr, flush=True)

    if not (args.max_tokenizer_mb > 0 and args.max_json_mb > 0):
        raise ConfigError("--max-tokenizer-mb and --max-json-mb must be > 0")
    limits = FileLimits(tokenizer_bytes=int(args.max_tokenizer_mb * 2**20), json_bytes=int(args.max_json_mb * 2**20))
    result = convert(args.hf_dir, args.out, dtype=args.dtype, family=args.family, limits=limits,
                     state_init=args.state_init, max_position=args.max_position, progress=progress)
    print(f"wrote {result.path} ({result.family}, {result.tensors} tensors, {result.dtype})")
    return 0


# -- inspect ---------------------------------------------------------------------------------


def _add_inspect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="describe an artifact (header only)",
                       description="Print an artifact's config, size, tokenizer and KV cache cost.")
    p.add_argument("path", type=Path)
    p.add_argument("--loops", type=int, help="loops for the KV numbers (default: the config's default_loops)")
    p.add_argument("--cache-window", type=int, help="KV cache window (default: loops, the full cache)")
    p.add_argument("--kv-mode", choices=KV_MODES, default="full",
                   help="KV cache mode for the KV numbers (default: full); every mode is tabled too")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_inspect)


def kv_report(config: ModelConfig, dtype: str, loops: int | None = None,
              cache_window: int | None = None, kv_mode: str = "full") -> dict[str, Any]:
    """KV bytes per token in ``kv_mode`` at (loops, cache_window) and for windows 1, 2 and loops,
    in fp16 and ``dtype``; and every mode's bytes at (loops, cache_window)."""
    loops = config.default_loops if loops is None else loops
    if not 1 <= loops <= config.max_loops:
        raise ConfigError(f"loops must be in [1, max_loops={config.max_loops}], got {loops}")
    window = loops if cache_window is None else cache_window
    itemsize = getattr(torch, dtype).itemsize  # dtype is a torch name: "float32", "bfloat16"
    mode = KVMode.parse(kv_mode)

    def row(w: int, m: KVMode = mode) -> dict[str, int]:
        return {"cache_window": w, "slots": kv_slots_per_token(config, loops, w),
                "bytes_fp16": m.bytes_per_token(config, loops, w, 2),
                "bytes_dtype": m.bytes_per_token(config, loops, w, itemsize)}

    def mode_row(name: str) -> dict[str, Any]:
        r = row(window, KVMode.parse(name))
        return {"mode": name, **r, "cut_vs_full_fp16": round(1 - r["bytes_fp16"] / full_fp16, 4)}

    full_fp16 = KVMode().bytes_per_token(config, loops, window, 2)
    modes = [mode_row(name) for name in KV_MODES]
    return {"loops": loops, "dtype": dtype, "kv_mode": mode.name, **row(window),
            "by_cache_window": [row(w) for w in sorted({1, min(2, loops), loops})],
            "by_mode": modes}


def cmd_inspect(args: argparse.Namespace) -> int:
    info = inspect_artifact(args.path)
    config = ModelConfig.from_dict(info["config"])
    info["kv_cache"] = kv_report(config, info["dtype"], args.loops, args.cache_window, args.kv_mode)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_inspect(info)
    return 0


def _print_inspect(info: dict[str, Any]) -> None:
    special = info["special_tokens"]
    pad = "none" if special["pad_id"] is None else special["pad_id"]
    kv = info["kv_cache"]
    print(f"path            {info['path']}")
    print(f"format version  {info['format_version']}")
    print(f"file size       {_size(info['file_size'])}")
    print(f"parameters      {info['parameters']:,}")
    print(f"dtype           {', '.join(info['dtypes'])}")
    print(f"tokenizer       {info['tokenizer_vocab_size']} tokens; bos {special['bos_id']}, "
          f"eos {special['eos_id']}, eos_ids {special['eos_ids']}, pad {pad}")
    print("config")
    width = max(map(len, info["config"]), default=0) + 2  # the longest key, then two spaces
    for key, value in info["config"].items():
        print(f"  {key:<{width}}{value}")
    print(f"KV cache per token (loops {kv['loops']}, cache_window {kv['cache_window']}, "
          f"mode {kv['kv_mode']}): {kv['bytes_fp16']:,} B fp16, {kv['bytes_dtype']:,} B {kv['dtype']}")
    print(f"  {'cache_window':>12} {'slots':>6} {'fp16':>10} {kv['dtype']:>10}")
    for r in kv["by_cache_window"]:
        print(f"  {r['cache_window']:>12} {r['slots']:>6} {r['bytes_fp16']:>10,} {r['bytes_dtype']:>10,}")
    print(f"  {'KV mode':<22} {'fp16':>10} {kv['dtype']:>10} {'cut vs full fp16':>17}")
    for r in kv["by_mode"]:
        print(f"  {r['mode']:<22} {r['bytes_fp16']:>10,} {r['bytes_dtype']:>10,} "
              f"{r['cut_vs_full_fp16']:>16.1%}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n} bytes"


# -- export-tokenizer ------------------------------------------------------------------------


def _add_export_tokenizer(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export-tokenizer", help="write an artifact's tokenizer as a Hugging Face tokenizer folder",
                       description="Write tokenizer.json, tokenizer_config.json and special_tokens_map.json, "
                                   "which transformers.AutoTokenizer.from_pretrained(DIR) loads offline "
                                   "(header only: no weight is read).")
    p.add_argument("artifact", type=Path, help="the .tinyloop artifact")
    p.add_argument("dir", type=Path, help="folder to write (made when missing)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    p.set_defaults(func=cmd_export_tokenizer)


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    info = inspect_artifact(args.artifact)  # checks the whole header; reads no tensor
    if args.dir.exists() and not args.dir.is_dir():
        raise ConfigError(f"{args.dir}: exists and is not a folder")
    if args.dir.is_dir() and any(args.dir.iterdir()) and not args.force:
        raise ConfigError(f"{args.dir}: folder is not empty (--force writes into it)")
    special = info["special_tokens"]
    tokenizer = Tokenizer.from_json(_header_tokenizer(args.artifact), bos_id=special["bos_id"],
                                    eos_id=special["eos_id"], eos_ids=special["eos_ids"])
    paths = export_hf_tokenizer(tokenizer, args.dir, chat_template=info["chat_template"] or tokenizer.chat_template,
                                model_max_length=info["config"]["max_position"], pad_id=special["pad_id"])
    for path in paths:
        print(f"wrote {path}")
    return 0


def _header_tokenizer(path: Path) -> str:
    """The artifact's tokenizer JSON, read from the safetensors header (the header was checked)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        text: str = f.metadata()[KEY_TOKENIZER]
    return text


# -- generate --------------------------------------------------------------------------------


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate from a prompt, streaming to the terminal with --stream.")
    p.add_argument("--model", help="artifact path (default: TINYLOOP_MODEL_PATH or the bundled demo model)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--loops", type=int, help="loops per token (default: the model's default)")
    p.add_argument("--cache-window", type=int, help="KV slots kept per core layer (default: loops)")
    p.add_argument("--warm-start", action="store_true", help="start each token from the previous token's state")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyloop.requests import GenerationRequest, SamplingParams
    from tinyloop.server import load_engine
    from tinyloop.settings import Settings

    settings = Settings.from_env(model_path=args.model)
    engine = load_engine(settings)
    text = args.prompt
    if args.chat:
        text = engine.tokenizer.render_chat([{"role": "user", "content": text}],
                                            template=engine.chat_template)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              seed=args.seed, stop=tuple(args.stop))
    request = GenerationRequest(prompt_tokens=tuple(engine.tokenizer.encode(text)),
                                max_tokens=args.max_tokens, loops=args.loops,
                                cache_window=args.cache_window, warm_start=args.warm_start,
                                sampling=sampling)
    if args.stream and not args.json:
        result = engine.generate_stream(request, lambda c: print(c.text, end="", flush=True))
        print()
    else:
        result = engine.generate(request)
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens,
                          "finish_reason": result.finish_reason, "stop_reason": result.stop_reason,
                          "prompt_tokens": result.prompt_tokens,
                          "completion_tokens": result.completion_tokens,
                          "loops": result.loops_used, "wall_ms": round(result.wall_ms, 3)}))
    elif not args.stream:
        print(result.text)
    return 0


# -- serve -----------------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from typing import get_args, get_type_hints

    from tinyloop.settings import Settings

    p = sub.add_parser("serve", help="run the HTTP server",
                       description="Serve the OpenAI, LM Studio and native APIs. Every flag is also "
                                   "a TINYLOOP_* environment variable; a flag beats the variable.",
                       epilog="SIGTERM, SIGINT or SIGHUP drains: new requests are refused, in-flight ones get "
                              "--graceful-timeout seconds, then the server exits 0. A second signal forces the "
                              "shutdown: open streams end with a 'shutting down' error event and [DONE], and the "
                              "server exits with 128 + that signal's number (143 for SIGTERM, 130 for SIGINT).")
    hints = get_type_hints(Settings)
    for f in Settings.fields():
        flag = "--" + f.name.replace("_", "-")
        names = [flag, "--model"] if f.name == "model_path" else [flag]
        kind = next((a for a in get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        help_text = f"{f.metadata['help']} [{f.metadata['env']}]"
        if kind is bool:
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=help_text)
        else:
            p.add_argument(*names, dest=f.name, type=kind, default=None, help=help_text)
    p.add_argument("--detach", action="store_true",
                   help="start in the background (own session); return once it serves, printing pid, "
                        "address and log path (exit 1 if it dies first)")
    p.add_argument("--log", default="/tmp/tinyloop_server.log", help="log file for --detach")
    p.add_argument("--detach-timeout", type=float, default=120.0,
                   help="seconds --detach waits for the server to serve before giving up (default 120)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from tinyloop.logs import log_to_stderr
    from tinyloop.server import check_default_loops, check_device, serve
    from tinyloop.settings import Settings

    overrides = {f.name: getattr(args, f.name) for f in Settings.fields()}
    settings = Settings.from_env(**overrides)
    for device in dict.fromkeys(settings.engine_devices):  # before the server starts (or detaches):
        check_device(device)  # a plain error and status 2
    check_default_loops(settings)
    if args.detach:
        return _detach(args, settings)
    log_to_stderr()  # the banner, the shutdown's steps, the access log

    async def main() -> None:
        async def announce(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            await serve(settings, task_status=task_status)

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(announce)
            print(f"TinyLoop serving on {', '.join(binds)}", file=sys.stderr, flush=True)

    try:
        trio.run(main)
    except BaseException as exc:
        status = _stopped_by_signal(exc)
        if status is None:
            raise
        return status
    return 0


def _stopped_by_signal(exc: BaseException) -> int | None:
    """The exit status of a serve a signal ended without draining, None for any other error:
    128 + the signal that forced the shutdown (``ShutdownForced``), or 130 for a Ctrl-C that
    came while no signal receiver was open (while the model loads), which raises
    KeyboardInterrupt. Either says so in one line, without a traceback."""
    from tinyloop.http.serve import ShutdownForced

    leaves = list(_leaves(exc))
    if not all(isinstance(e, ShutdownForced | KeyboardInterrupt) for e in leaves):
        return None
    forced = next((e for e in leaves if isinstance(e, ShutdownForced)), None)
    status = forced.exit_status if forced is not None else 130
    print(f"TinyLoop stopped: {forced or 'interrupted'} (exit status {status})", file=sys.stderr, flush=True)
    return status


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions of a (nested) exception group, or ``exc`` itself."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _detach(args: argparse.Namespace, settings: Any) -> int:
    """Start the server in its own session; return 0 once it serves, 1 if it died or timed out."""
    import os
    import subprocess
    import time

    argv = [a for a in args.argv if a != "--detach"]  # what main() parsed, not sys.argv
    log_path = Path(args.log)
    start = log_path.stat().st_size if log_path.exists() else 0  # the log is appended to
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tinyloop.cli", *argv], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=os.environ.copy())

    def ours() -> str:
        with open(log_path, "rb") as f:
            f.seek(start)
            return f.read().decode("utf-8", "replace")

    deadline = time.monotonic() + args.detach_timeout
    while "TinyLoop serving on" not in ours():
        if proc.poll() is not None:
            tail = "\n".join(ours().strip().splitlines()[-15:])
            print(f"TinyLoop server exited with status {proc.returncode} before serving; "
                  f"log {log_path}:\n{tail}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            proc.terminate()
            print(f"TinyLoop server (pid {proc.pid}) was not serving after {args.detach_timeout:g}s; "
                  f"stopped it. Log {log_path}", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"TinyLoop server pid={proc.pid} on {settings.host}:{settings.port} — log {args.log}")
    return 0


# -- entry point -----------------------------------------------------------------------------

_COMMANDS = (_add_init, _add_convert, _add_inspect, _add_export_tokenizer, _add_generate, _add_serve)


def build_parser() -> argparse.ArgumentParser:
    from tinyloop.version import package_version

    parser = argparse.ArgumentParser(prog="tinyloop", description="Serve looped transformer LMs.")
    parser.add_argument("--version", action="version", version=f"tinyloop {package_version()}",
                        help="print tinyloop's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (2 for usage and TinyLoop errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help and usage errors; callers get a status, not an exception
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    args.argv = argv  # serve --detach re-runs the same command line in the background
    try:
        return int(args.func(args))
    except TinyLoopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
