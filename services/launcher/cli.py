"""The `flotilla` command.

    flotilla up [--port N] [--host H] [--model PATH_OR_ID] [--mcp-config FILE] [--nats-url URL]
                [--served-model-name NAME] [--state-file FILE] [--log-level LEVEL]
                [--tp N] [--device-ids 0,1] [--isq TYPE] [--fp8-kvcache] [--ui]
                [--cpu-moe] [--n-cpu-moe N] [--num-experts-offload-per-rank N]
                [--api-key KEY] [--no-nats-auth]
    flotilla status [--state-file FILE]
    flotilla keys create|list|revoke ...   (services/launcher/keys.py)
    flotilla fetch [--model PATH_OR_ID]
    flotilla chat [--url URL] [--model NAME] [--live] ...   (services/chat/cli.py)

`up` runs a private nats-server (supervised, on a free loopback port) unless a NATS URL is
given explicitly with --nats-url or FLOTILLA_NATS_URL: then a server answering there is shared,
and on a loopback URL where none answers a private one is started on exactly that port.
`status` checks each running suite live (its gateway's /ready, each service's health on NATS,
every child's pid) and exits 0 when every suite found is ready, 2 when one is not (or its
launcher is gone), 1 when none is found.

Short forms: `--p`/`-p` port, `--m`/`-m` model, `--w` (weights directory) and `--f` (GGUF file)
are also the model; `--d` is --device-ids. Defaults come from LauncherSettings (FLOTILLA_PORT,
FLOTILLA_MODEL, ...); --tp / --device-ids reach the engine as FLOTILLA_TP / FLOTILLA_DEVICE_IDS,
--fp8-kvcache as FLOTILLA_KV_CACHE_DTYPE=fp8.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from types import FrameType

from pydantic import SecretStr

from flotilla.libs.common import telemetry
from flotilla.libs.common.model_cache import resolve_model
from flotilla.libs.common.nats_auth import NatsSecurity
from flotilla.libs.common.settings import LauncherSettings
from flotilla.services.chat.args import add_arguments as add_chat_arguments
from flotilla.services.launcher.keys import add_arguments as add_keys_arguments
from flotilla.services.launcher.keys import run as run_keys
from flotilla.services.launcher.readiness import Probe, check_once
from flotilla.services.launcher.state import SuiteState, pid_alive, run_dir
from flotilla.services.launcher.suite import (
    NATS_SERVICES,
    StopRequested,
    Suite,
    SuiteError,
    SuiteOptions,
)

log = logging.getLogger("flotilla")


def build_parser(settings: LauncherSettings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flotilla", allow_abbrev=False,
        description="Serve a local LLM behind an OpenAI-compatible API (gateway, tokenizer, "
                    "engine and tools services over NATS).")
    parser.set_defaults(settings=settings)  # `up` reads the shared NATS's credentials from it
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def model_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", "--m", "-m", "--w", "--f", dest="model", default=settings.model,
                       metavar="PATH_OR_ID",
                       help="GGUF file, HF model directory, hub id 'org/name', or 'default' "
                            "(SmolLM2-135M-Instruct); --w and --f are aliases "
                            f"(default: {settings.model})")

    up = commands.add_parser("up", allow_abbrev=False,
                             help="start the whole suite and serve until Ctrl-C")
    up.add_argument("--port", "--p", "-p", type=int, default=settings.port,
                    help=f"gateway port; 0 = any free port (default: {settings.port})")
    up.add_argument("--host", default=settings.host,
                    help=f"gateway bind address (default: {settings.host})")
    model_option(up)
    up.add_argument("--mcp-config", type=Path, default=None, metavar="FILE",
                    help="mcp.json (Claude Desktop shape) with the MCP servers to offer as tools")
    explicit = settings.nats_url if "nats_url" in settings.model_fields_set else None
    up.add_argument("--nats-url", default=explicit,
                    help="share the NATS server at this URL (a loopback URL where none answers "
                         "gets a private one on that port); default: a private nats-server on "
                         "a free port" + (f" (FLOTILLA_NATS_URL: {explicit})" if explicit
                                          else ""))
    up.add_argument("--served-model-name", default=settings.served_model_name, metavar="NAME",
                    help="model name clients use (default: derived from the model)")
    up.add_argument("--state-file", type=Path, default=None, metavar="FILE",
                    help="where to write pids and URLs (default: "
                         f"{run_dir(settings.run_dir)}/flotilla-<port>.json)")
    up.add_argument("--log-level", default=settings.log_level,
                    help=f"log level of the launcher and services (default: {settings.log_level})")
    up.add_argument("--start-timeout", type=float, default=settings.start_timeout_s,
                    metavar="SECONDS", help="give up if not ready within this long")
    up.add_argument("--tp", type=int, default=None, metavar="N",
                    help="tensor-parallel ranks of the engine pod (default: one per device id, "
                         "else 1)")
    up.add_argument("--device-ids", "--d", dest="device_ids", type=_device_ids, default=None,
                    metavar="0,1", help="GPU of each engine rank (default: 0..tp-1)")
    up.add_argument("--isq", default=None, metavar="TYPE",
                    choices=["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k",
                             "q6k", "fp8"],
                    help="quantize float weights while loading (in-situ), e.g. q4k or fp8")
    up.add_argument("--cpu-moe", action="store_true",
                    help="keep every MoE expert in host memory, run on the CPU (llama.cpp's "
                         "--cpu-moe; FLOTILLA_CPU_MOE)")
    up.add_argument("--n-cpu-moe", type=int, default=None, metavar="N",
                    help="keep the MoE experts of decoder layers 0..N-1 in host memory "
                         "(llama.cpp's --n-cpu-moe; FLOTILLA_N_CPU_MOE)")
    up.add_argument("--num-experts-offload-per-rank", type=int, default=None, metavar="N",
                    help="keep the last N experts of each GPU rank in every MoE layer in host "
                         "memory (FLOTILLA_NUM_EXPERTS_OFFLOAD_PER_RANK)")
    up.add_argument("--moe-offload-mode", choices=["cpu", "stream"], default=None,
                    help="offloaded experts run on the CPU (default) or are streamed to the "
                         "GPU each step (FLOTILLA_MOE_OFFLOAD_MODE)")
    up.add_argument("--fp8-kvcache", action="store_true",
                    help="store the KV cache in fp8 (e4m3, a scale per token and head): ~1.94x "
                         "the tokens of bf16; not for MLA models (DeepSeek-V2/V3)")

    up.add_argument("--ui", "--ui-server", dest="ui", action="store_true", default=settings.ui,
                    help="serve the chat web UI at / on the gateway's port (FLOTILLA_UI)")

    up.add_argument("--api-key", dest="api_keys", action="append", default=None,
                    metavar="KEY", help="require this API key (Authorization: Bearer KEY or "
                    "x-api-key); repeat for more (default: FLOTILLA_API_KEYS; none = no "
                    "authentication)")
    up.add_argument("--no-nats-auth", dest="nats_auth", action="store_false",
                    default=settings.nats_auth,
                    help="run the private nats-server without its generated token "
                         "(FLOTILLA_NATS_AUTH=0)")

    status = commands.add_parser(
        "status", help="show each running suite (from its state file), checked now")
    status.add_argument("--state-file", type=Path, default=None, metavar="FILE")
    for command in (up, status):
        command.set_defaults(run_dir=run_dir(settings.run_dir))

    fetch = commands.add_parser("fetch", help="download/resolve a model and print its path")
    model_option(fetch)

    add_chat_arguments(commands.add_parser(
        "chat", help="chat with a running gateway in this terminal"), settings)
    add_keys_arguments(commands.add_parser(
        "keys", help="create, list or revoke API keys (kept hashed in Redis)"), settings)
    return parser


def moe_offload_env(args: argparse.Namespace) -> dict[str, str]:
    """The engine settings of the MoE offload flags that were given."""
    env = {"FLOTILLA_CPU_MOE": "1"} if args.cpu_moe else {}
    for flag in ("n_cpu_moe", "num_experts_offload_per_rank", "moe_offload_mode"):
        if getattr(args, flag) is not None:
            env[f"FLOTILLA_{flag.upper()}"] = str(getattr(args, flag))
    return env


def _device_ids(text: str) -> str:
    ids = text.replace(" ", "").split(",")
    if not all(i.isdigit() for i in ids):
        raise argparse.ArgumentTypeError(f"expected GPU ids like 0,1, got {text!r}")
    return ",".join(ids)


def cmd_up(args: argparse.Namespace) -> int:
    telemetry.setup_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    try:
        nats_security = NatsSecurity.from_settings(args.settings)
    except ValueError as exc:  # e.g. a TLS file that is not there
        print(f"flotilla: {exc}", file=sys.stderr)
        return 1
    suite = Suite(SuiteOptions(
        model=args.model, host=args.host, port=args.port, nats_url=args.nats_url,
        mcp_config=args.mcp_config, served_model_name=args.served_model_name,
        log_level=args.log_level, state_file=args.state_file, start_timeout_s=args.start_timeout,
        tp=args.tp, device_ids=args.device_ids, isq=args.isq, fp8_kvcache=args.fp8_kvcache,
        moe_offload=moe_offload_env(args),
        ui=args.ui, api_keys=",".join(args.api_keys) if args.api_keys else None,
        nats_auth=args.nats_auth, nats_security=nats_security, run_dir=args.run_dir))

    def on_signal(signum: int, _: FrameType | None) -> None:
        if suite.stop_requested:  # a second Ctrl-C: stop waiting politely
            raise KeyboardInterrupt
        log.info("received %s, stopping", signal.Signals(signum).name)
        suite.stop_requested = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        suite.start()
    except StopRequested:
        return 130
    except SuiteError as exc:
        print(f"flotilla: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C while starting; start() has cleaned up
        return 130
    assert suite.state is not None
    print(f"flotilla is serving {suite.state.model} at {suite.url}", flush=True)
    if args.ui:
        print(f"chat UI at {suite.url.removesuffix('/v1')}/", flush=True)
    print(f"state: {suite.state_file}  logs: {suite.state.log_dir}", flush=True)
    try:
        suite.serve_forever()
    finally:
        suite.stop()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    files = ([args.state_file] if args.state_file
             else sorted(args.run_dir.glob("flotilla-*.json")) if args.run_dir.is_dir() else [])
    found, all_ready = False, True
    for path in files:
        try:
            state = SuiteState.read(path)
        except (OSError, ValueError, TypeError) as exc:
            print(f"{path}: unreadable ({exc})")
            continue
        found = True
        ready = show_status(path, state)
        all_ready = all_ready and ready
    if not found:
        print(f"no running flotilla found in {args.run_dir}")
        return 1
    return 0 if all_ready else 2


def show_status(path: Path, state: SuiteState) -> bool:
    """Print one suite's status, checked now; whether it is ready."""
    if not pid_alive(state.launcher_pid):
        print(f"{path}: not running (stale: launcher pid {state.launcher_pid} is gone)")
        return False
    down = [f"{name} pid {pid} down" if pid else f"{name} not started"
            for name, pid in state.pids.items()
            if not pid_alive(pid) and (pid or name != "nats-server" or state.nats_private)]
    ready_url = state.gateway_url.removesuffix("/v1") + "/ready"
    token = Path(state.nats_token_file) if state.nats_token_file else None
    security = (NatsSecurity(token=SecretStr(token.read_text())) if token and token.is_file()
                else None)
    live = asyncio.run(check_once(Probe(ready_url, state.nats_url, NATS_SERVICES, security)))
    reasons = down + list(live.reasons)
    if not reasons:
        verdict = "ready"
    else:
        verdict = ("not ready" if state.serving else "starting") + ": " + "; ".join(reasons)
    print(f"{path}: {verdict}")
    print(f"  model {state.model} at {state.gateway_url}  (nats {state.nats_url}, "
          f"{'private' if state.nats_private else 'shared'})")
    for name, pid in state.pids.items():
        if pid is not None:
            restarts = state.restarts.get(name, 0)
            print(f"  {name:<12} pid {pid:<8} {'up' if pid_alive(pid) else 'down'}"
                  f"{f'  restarts {restarts}' if restarts else ''}")
    return not reasons


def cmd_fetch(args: argparse.Namespace) -> int:
    try:
        print(resolve_model(args.model))
    except (OSError, RuntimeError) as exc:
        print(f"flotilla: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from flotilla.services.chat.cli import run  # the openai SDK and rich load only for `chat`

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser(LauncherSettings()).parse_args(argv)
    handler = {"up": cmd_up, "status": cmd_status, "fetch": cmd_fetch,
               "chat": cmd_chat, "keys": run_keys}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
