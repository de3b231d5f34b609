"""One settings object for the tokenizer, worker and detokenizer.

`Settings` is `EngineArgs` plus the service fields, so every engine option is a server
flag without being listed twice. The command line is generated from the fields: field
`max_total_tokens` is flag `--max-total-tokens` and environment variable
`RADIXSERVE_MAX_TOTAL_TOKENS`; the flag beats the variable, the variable beats the default.
Where SGLang spells an option radixserve has differently (`--model-path`), its spelling is
an alias of the flag (`SGLANG_ALIASES`).
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from engine.args import EngineArgs
from engine.cache.kv_events import DEFAULT_BLOCK_SIZE
from services.chat_templates import read_chat_template
from services.ipc import endpoint
from services.kv_events_config import KVEventsConfig
from services.tool_parser_names import DEFAULT_TOOL_PARSER, TOOL_PARSER_NAMES

ENV_PREFIX = "RADIXSERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _opt(default: Any, help: str, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **kwargs})


_ZMQ_PORT_HELP = " on tcp://127.0.0.1:PORT (none: an ipc:// socket in --ipc-dir)"
_METRICS_PORT_HELP = " (none: a free port, chosen at start; /get_server_info shows it)"
ZMQ_PORT_ROLES = {
    "worker_port": "worker",
    "detokenizer_port": "detokenizer",
    "tokenizer_port": "tokenizer",
    "tokenizer_control_port": "tokenizer",
}
"""Each ZMQ port field and the role whose PULL socket binds it."""
MAX_IPC_PATH = 107
"""Bytes of a Unix socket's path at most (sun_path, less its terminating NUL)."""
LAUNCH_ID_HEADER = "x-radixserve-launch-id"
"""The header of the tokenizer's /health answer that carries `--launch-id`."""
SGLANG_ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("--model-path",),
    "tokenizer": ("--tokenizer-path",),
    "tp_size": ("--tensor-parallel-size",),
    "dist_init_addr": ("--nccl-init-addr",),
    "dist_init_timeout": ("--dist-timeout",),
    "speculative_draft_model_path": ("--speculative-draft-model",),
    "cuda_graph_max_bs": ("--cuda-graph-max-bs-decode",),
}
"""SGLang's flags (python/sglang/srt/server_args.py) for the fields whose own flag it spells
otherwise, so that an SGLang command line works here; each field's own flag works too."""
MULTI_VALUE_FIELDS = frozenset({"lora_paths"})
"""Flags that take several values, as SGLang's `--lora-paths a=/x b=/y`, joined by spaces
into the field's one string (which also accepts `a=/x,b=/y`)."""


@dataclass
class Settings(EngineArgs):
    """Every engine option plus what the three processes need to find each other and serve."""

    tool_call_parser: str = _opt(
        DEFAULT_TOOL_PARSER,
        "how tool calls are read from the model's text (vLLM's names)",
        choices=TOOL_PARSER_NAMES,
    )
    host: str = _opt(
        "0.0.0.0", "HTTP bind address (the ZMQ sockets never leave the host: ipc:// or 127.0.0.1)"
    )
    port: int = _opt(30000, "HTTP port of the OpenAI-compatible API")
    served_model_name: str | None = _opt(None, "model id in the API (default: --model)")
    worker_port: int | None = _opt(None, f"ZMQ tokenizer → worker{_ZMQ_PORT_HELP}")
    detokenizer_port: int | None = _opt(None, f"ZMQ worker → detokenizer{_ZMQ_PORT_HELP}")
    tokenizer_port: int | None = _opt(None, f"ZMQ detokenizer → tokenizer{_ZMQ_PORT_HELP}")
    tokenizer_control_port: int | None = _opt(
        None,
        f"ZMQ worker → tokenizer (ready, control replies, heartbeats){_ZMQ_PORT_HELP}",
    )
    ipc_dir: str | None = _opt(
        None,
        "directory of the ipc:// sockets of the ZMQ ports left unset (radixserve serve makes a "
        "private one, removed at exit; processes started alone need the same one)",
    )
    worker_metrics_port: int | None = _opt(
        None, f"worker /metrics and /healthz (bound on --host){_METRICS_PORT_HELP}"
    )
    detokenizer_metrics_port: int | None = _opt(
        None, f"detokenizer /metrics and /healthz (bound on --host){_METRICS_PORT_HELP}"
    )
    launch_id: str | None = _opt(
        None,
        "set by radixserve serve for its children: the tokenizer's /health answers it in the "
        f"{LAUNCH_ID_HEADER} header, so that serve knows it reached its own server",
    )
    log_probe_requests: bool = _opt(
        False,
        "access-log lines for /health, /healthz and /metrics too (kubelet probes and "
        "Prometheus scrapes; left out by default)",
    )
    stall_timeout: float = _opt(
        60.0,
        "worker and detokenizer /healthz answer 503 once their loop has made no progress (a "
        "turn, or a layer of a prefill's forward) for this long (s)",
    )
    graceful_shutdown_timeout: float = _opt(
        30.0,
        "on SIGTERM the server stops accepting, lets requests in flight finish for this long, "
        "then stops the worker and detokenizer (s)",
    )
    watchdog_timeout: float = _opt(
        300.0,
        "worker and detokenizer exit (status 3) once their loop has made no progress (a turn, "
        "or a layer of a prefill's forward) for this long (s)",
    )
    # repr=False: settings get logged at startup, the key must not be.
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "bearer key required on the API (not on /metrics, /health*); "
            "prefer the env variable"
        },
    )
    admin_api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "bearer key required on operator endpoints (/flush_cache, abort_all, "
            "check_integrity, adapter loading); none: the API key guards them"
        },
    )
    api_key_file: str | None = _opt(
        None,
        "file of API keys, one 'key [tenant]' per line ('#' comments); beside --api-key; a key "
        "without a tenant is its own tenant",
    )
    cache_isolation: str = _opt(
        "none",
        "radix-cache sharing: none (every client shares prefixes) or tenant (one namespace per "
        "tenant of --api-key-file, so cached_tokens reveals nothing across tenants)",
        choices=("none", "tenant"),
    )
    ipc_keys_dir: str | None = _opt(
        None,
        "directory of the CURVE keys that authenticate the ZMQ wire between the three processes "
        "(radixserve serve generates one when unset)",
    )
    chat_template: str | None = _opt(
        None,
        "the chat template: a named one (gemma3) or a Jinja file; default: the model's own "
        "(a model without one answers chat requests with a 400)",
    )
    allow_special_tokens_in_content: bool = _opt(
        False,
        "tokenize user and tool content with its special tokens parsed (trusted callers only: "
        "such text can forge turns)",
    )
    disable_openapi: bool = _opt(
        False, "serve no OpenAPI document (/openapi.json) and no API explorer (/docs)"
    )
    http_header_timeout: float = _opt(
        10.0, "close an HTTP connection whose request headers take longer than this (s)"
    )
    http_body_timeout: float = _opt(
        30.0, "answer 408 when a request body stalls for this long between chunks (s)"
    )
    max_connections: int = _opt(
        1024, "open HTTP connections at most; beyond it new ones are answered 503"
    )
    max_stop_strings: int = _opt(32, "stop strings per request at most")
    max_stop_string_length: int = _opt(1024, "characters per stop string at most")
    max_stop_token_ids: int = _opt(256, "stop_token_ids per request at most")
    max_logit_bias: int = _opt(1024, "logit_bias entries per request at most")
    max_top_logprobs: int = _opt(
        20, "top_logprobs (and prompt top logprobs) per position at most (OpenAI's limit)"
    )
    max_prompt_chars: int = _opt(
        1 << 20,
        "characters of prompt text (all messages, or all prompts of a batch) at most, checked "
        "before tokenizing",
    )
    max_n: int = _opt(128, "samples per prompt (n) at most (OpenAI's limit)")
    max_sequences_per_request: int = _opt(
        1024, "sequences of one request (prompts of a batch × n) at most"
    )
    log_level: str = _opt("info", "logging level", choices=LOG_LEVELS)
    max_tokens_cap: int = _opt(
        4096, "server-side cap on a request's max_tokens, protecting the KV pool"
    )
    heartbeat_interval: float = _opt(
        1.0,
        "seconds between heartbeats; a peer whose connection dropped (its process exited) "
        "and then stays silent for 3 intervals is dead",
    )
    peer_timeout: float = _opt(
        30.0,
        "a peer silent this long is dead even while its connections stay up (frozen, or its "
        "host gone); a late heartbeat from a busy peer is no death (s)",
    )
    max_queued_requests: int | None = _opt(
        None,
        "load shedding: answer 429 while this many requests wait for their first token "
        "(none: no limit)",
    )
    kv_events_config: str | None = _opt(
        None,
        "publish the radix tree as KV-cache events for routers: JSON with SGLang's and vLLM's "
        'keys, e.g. \'{"publisher": "zmq", "topic": "kv"}\' (binds 127.0.0.1:5557 unless '
        '"endpoint" names another address)',
    )
    kv_events_block_size: int = _opt(
        DEFAULT_BLOCK_SIZE, "tokens per virtual block in the KV-cache events"
    )
    request_timeout: float | None = _opt(
        1800.0,
        "abort a request (504) still unfinished this many seconds after submission, freeing its KV "
        "(none: no limit)",
    )

    @property
    def model_id(self) -> str:
        """The model id of the API: `--served-model-name`, which defaults to `--model`."""
        assert self.served_model_name is not None, "filled in from `model` at construction"
        return self.served_model_name

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.served_model_name is None:
            self.served_model_name = self.model
        for f in fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        by_port: dict[int, list[str]] = {}
        for name in PORT_FIELDS:
            port = getattr(self, name)
            if port is None:
                continue
            if not 1 <= port <= 65535:
                raise ValueError(f"{name} must be in [1, 65535], got {port}")
            by_port.setdefault(port, []).append(name)
        clashes = [names for names in by_port.values() if len(names) > 1]
        if clashes:
            raise ValueError(f"ports must differ; these share one: {clashes}")
        if self.chat_template is not None:
            read_chat_template(self.chat_template)
        if self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if not self.heartbeat_interval > 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {self.heartbeat_interval}")
        if not self.peer_timeout > 0:
            raise ValueError(f"peer_timeout must be > 0, got {self.peer_timeout}")
        if not self.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0, got {self.stall_timeout}")
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError(
                f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout}"
            )
        if not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be >= 1 (or none), got {self.max_queued_requests}"
            )
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 (or none), got {self.request_timeout}")
        for name in SIZE_LIMIT_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("http_header_timeout", "http_body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cache_isolation == "tenant" and not self.api_key_file:
            raise ValueError("cache_isolation tenant needs --api-key-file (the tenants)")
        if self.kv_events_block_size < 1:
            raise ValueError(f"kv_events_block_size must be >= 1, got {self.kv_events_block_size}")
        self.kv_events()  # a bad --kv-events-config fails here, before any process starts
        if self.ipc_dir is not None:
            longest = self.zmq_address("tokenizer_control_port").removeprefix("ipc://")
            if len(longest.encode()) > MAX_IPC_PATH:
                raise ValueError(
                    f"ipc_dir {self.ipc_dir!r} is too long for a Unix socket path "
                    f"({longest!r} exceeds {MAX_IPC_PATH} bytes); pick a shorter directory"
                )

    def zmq_address(self, name: str) -> str:
        """The ZMQ endpoint of port field `name` (one of `ZMQ_PORT_ROLES`): loopback TCP when
        the port is set, else an ipc:// socket in `ipc_dir`. ValueError when neither is."""
        port = getattr(self, name)
        if port is not None:
            return endpoint(port)
        if self.ipc_dir is None:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} is unset and so is --ipc-dir: give the three processes the same "
                "--ipc-dir (or every ZMQ --*-port), or start them with radixserve serve"
            )
        return f"ipc://{os.path.join(self.ipc_dir, name.removesuffix('_port'))}"

    def zmq_role(self, address: int | str) -> str:
        """The role whose PULL socket binds `address` (a loopback TCP port or an endpoint)."""
        wanted = endpoint(address)
        for name, role in ZMQ_PORT_ROLES.items():
            try:
                if self.zmq_address(name) == wanted:
                    return role
            except ValueError:  # a port with no address is not the one asked for
                continue
        raise KeyError(f"no ZMQ port of these settings is {wanted}")

    def kv_events(self) -> KVEventsConfig | None:
        """The parsed `--kv-events-config`, or None when events are off."""
        if self.kv_events_config is None:
            return None
        config = KVEventsConfig.from_json(self.kv_events_config)
        return config if config.enabled else None

    def to_engine_args(self) -> EngineArgs:
        return EngineArgs(**{f.name: getattr(self, f.name) for f in fields(EngineArgs)})

    @classmethod
    def from_cli(
        cls,
        argv: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        prog: str | None = None,
        wire: bool = False,
    ) -> Settings:
        """Parse flags (default: sys.argv[1:]) over `RADIXSERVE_*` variables (default:
        os.environ). Bad values exit with status 2 and a message naming the flag or variable;
        with `wire` (a service process), so do ZMQ ports that have no address."""
        parser = build_parser(os.environ if env is None else env, prog)
        namespace = parser.parse_args(argv)
        try:
            settings = cls(**vars(namespace))
            if wire and settings.node_rank == 0:  # node K > 0 runs ranks, with no sockets
                for name in ZMQ_PORT_ROLES:
                    settings.zmq_address(name)
        except ValueError as e:
            parser.error(str(e))
        return settings


SIZE_LIMIT_FIELDS = (
    "max_connections",
    "max_stop_strings",
    "max_stop_string_length",
    "max_stop_token_ids",
    "max_logit_bias",
    "max_top_logprobs",
    "max_prompt_chars",
    "max_n",
    "max_sequences_per_request",
)

PORT_FIELDS = (
    "port",
    "worker_port",
    "detokenizer_port",
    "tokenizer_port",
    "tokenizer_control_port",
    "worker_metrics_port",
    "detokenizer_metrics_port",
)


def build_parser(env: Mapping[str, str], prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per Settings field, defaults taken from `env`.
    No abbreviations: `--max-tokens` must not quietly mean `--max-tokens-cap`."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "radixserve: every flag can also be set as RADIXSERVE_<FLAG_IN_CAPS> in the "
            "environment."
        ),
        allow_abbrev=False,
    )
    hints = typing.get_type_hints(Settings)
    for f in fields(Settings):
        base, optional = _scalar_type(hints[f.name], f.name)
        parse = _parser_for(base, optional)
        default = f.default
        env_name = ENV_PREFIX + f.name.upper()
        if env_name in env:
            try:
                default = parse(env[env_name])
            except argparse.ArgumentTypeError as e:
                parser.error(f"environment variable {env_name}={env[env_name]!r}: {e}")
        # The shown default is the resolved one, except for secrets (repr=False).
        shown = f" (default: {default})" if f.repr and default is not None else ""
        help_text = f"{f.metadata.get('help', '')}{shown} [env {env_name}]".replace("%", "%%")
        flags = ["--" + f.name.replace("_", "-"), *SGLANG_ALIASES.get(f.name, ())]
        if base is bool:
            parser.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif f.name in MULTI_VALUE_FIELDS:
            parser.add_argument(
                *flags, nargs="+", action=_JoinValues, default=default, help=help_text
            )
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(
                *flags,
                type=parse,
                default=default,
                help=help_text,
                choices=choices,
                metavar=None if choices else f.name.upper(),
            )
    return parser


class _JoinValues(argparse.Action):
    """The values of a several-valued flag as one string, separated by spaces."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        joined = values if isinstance(values, str) else " ".join(map(str, values or ()))
        setattr(namespace, self.dest, joined)


def _scalar_type(hint: Any, name: str) -> tuple[type, bool]:
    """(base type, whether None is allowed) of `T` or `T | None`, T in str, int, float, bool."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional and len(args) == 2:
        hint = next(a for a in args if a is not type(None))
    if hint not in (str, int, float, bool):
        raise TypeError(f"settings field {name}: cannot make a flag for type {hint}")
    return hint, optional


def _parser_for(base: type, optional: bool) -> Callable[[str], Any]:
    """Text → value for flags and variables. For optional numbers and bools "none" means
    None (e.g. `--chunked-prefill-size none`); optional strings stay literal, so
    RADIXSERVE_API_KEY=none cannot switch authentication off."""

    def parse(text: str) -> Any:
        if optional and base is not str and text.strip().lower() == "none":
            return None
        return _PARSERS[base](text)

    return parse


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        hint = (
            " (Kubernetes service links set <SERVICE>_PORT; set enableServiceLinks: false)"
            if "://" in text
            else ""
        )
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}{hint}") from None


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false (1/0, yes/no, on/off), got {text!r}")


_PARSERS: dict[type, Callable[[str], Any]] = {
    str: str,
    int: _parse_int,
    float: _parse_float,
    bool: _parse_bool,
}
