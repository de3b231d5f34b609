from dataclasses import fields
from pathlib import Path

import pytest

import services
from engine.args import EngineArgs
from services.settings import SGLANG_ALIASES, Settings, build_parser
from services.tokenizer.parsers.tool_parsers import TOOL_PARSERS
from services.tool_parser_names import DEFAULT_TOOL_PARSER, TOOL_PARSER_NAMES
from testing.imports import import_graph, reachable


def _parse(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    return Settings.from_cli(argv, env=env or {})


def test_defaults_without_flags_or_environment():
    s = _parse([])
    assert (
        s.host,
        s.port,
        s.worker_port,
        s.detokenizer_port,
        s.tokenizer_port,
        s.tokenizer_control_port,
    ) == ("0.0.0.0", 30000, None, None, None, None)  # ipc:// sockets in --ipc-dir
    assert (s.worker_metrics_port, s.detokenizer_metrics_port) == (None, None)  # chosen free
    assert (s.grammar_backend, s.log_level, s.heartbeat_interval, s.api_key) == (
        "auto",
        "info",
        1.0,
        None,
    )
    assert s.max_total_tokens is None and s.chunked_prefill_size == 0
    assert s.disable_overlap_schedule is None  # auto, decided by the device
    assert s.served_model_name == s.model == "embedded"


def test_every_field_has_a_flag_and_engine_fields_are_inherited_not_copied():
    options = {a.dest: a.option_strings for a in build_parser({})._actions if a.dest != "help"}
    assert set(options) == {f.name for f in fields(Settings)}
    assert {f.name for f in fields(EngineArgs)} <= set(options)
    assert options["max_total_tokens"] == ["--max-total-tokens"]
    assert options["disable_radix_cache"] == ["--disable-radix-cache", "--no-disable-radix-cache"]
    assert issubclass(Settings, EngineArgs)


def test_flags_are_parsed_to_the_field_types():
    s = _parse(
        [
            "--model",
            "/models/qwen3",
            "--max-total-tokens",
            "8192",
            "--mem-fraction-static",
            "0.7",
            "--chunked-prefill-size",
            "none",
            "--disable-radix-cache",
            "--disable-overlap-schedule",
            "--schedule-policy",
            "lpm",
            "--attention-backend",
            "torch",
            "--served-model-name",
            "qwen",
            "--worker-port",
            "40010",
            "--api-key",
            "sk-test",
            "--log-level",
            "debug",
            "--max-tokens-cap",
            "512",
            "--heartbeat-interval",
            "0.5",
        ]
    )
    assert s.model == "/models/qwen3" and s.served_model_name == "qwen"
    assert (
        s.max_total_tokens == 8192
        and s.mem_fraction_static == 0.7
        and s.chunked_prefill_size is None
    )
    assert s.disable_radix_cache is True and s.disable_overlap_schedule is True
    assert (s.schedule_policy, s.attention_backend, s.worker_port) == ("lpm", "torch", 40010)
    assert (s.api_key, s.log_level, s.max_tokens_cap, s.heartbeat_interval) == (
        "sk-test",
        "debug",
        512,
        0.5,
    )


def test_environment_variables_override_defaults():
    s = _parse(
        [],
        env={
            "RADIXSERVE_MAX_TOTAL_TOKENS": "2048",
            "RADIXSERVE_DISABLE_RADIX_CACHE": "true",
            "RADIXSERVE_DISABLE_OVERLAP_SCHEDULE": "0",
            "RADIXSERVE_API_KEY": "none",
            "RADIXSERVE_CONTEXT_LENGTH": "None",
            "RADIXSERVE_SERVICE_HOST": "10.0.0.1",  # not a field: ignored
        },
    )
    assert s.max_total_tokens == 2048 and s.disable_radix_cache is True
    assert s.disable_overlap_schedule is False
    assert s.api_key == "none"  # strings stay literal: "none" must not switch authentication off
    assert s.context_length is None


def test_flags_beat_environment_variables():
    env = {
        "RADIXSERVE_PORT": "31000",
        "RADIXSERVE_DISABLE_RADIX_CACHE": "1",
        "RADIXSERVE_LOG_LEVEL": "error",
    }
    s = _parse(["--port", "32000", "--no-disable-radix-cache"], env=env)
    assert (s.port, s.disable_radix_cache, s.log_level) == (32000, False, "error")


def test_reads_the_process_environment_by_default(monkeypatch, capsys):
    monkeypatch.setenv("RADIXSERVE_WORKER_PORT", "41010")
    assert Settings.from_cli([]).worker_port == 41010
    with pytest.raises(SystemExit):
        Settings.from_cli(["--help"], prog="python -m services.worker")
    assert capsys.readouterr().out.startswith("usage: python -m services.worker")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--max-total-tokens", "lots"],
            {},
            "argument --max-total-tokens: expected an integer, got 'lots'",
        ),
        (
            ["--mem-fraction-static", "nan"],
            {},
            "argument --mem-fraction-static: expected a finite number",
        ),
        (["--log-level", "loud"], {}, "argument --log-level: invalid choice: 'loud'"),
        (["--max-tokens", "9"], {}, "unrecognized arguments: --max-tokens 9"),  # no abbreviations
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (
            [],
            {"RADIXSERVE_MAX_RUNNING_REQUESTS": "12x"},
            "environment variable RADIXSERVE_MAX_RUNNING_REQUESTS='12x': expected an integer",
        ),
        (
            [],
            {"RADIXSERVE_ENABLE_MIXED_CHUNK": "maybe"},
            "RADIXSERVE_ENABLE_MIXED_CHUNK='maybe': expected true/false",
        ),
        ([], {"RADIXSERVE_PORT": "tcp://10.0.0.1:30000"}, "enableServiceLinks: false"),
        (
            ["--worker-port", "30011", "--detokenizer-port", "30011"],
            {},
            "ports must differ; these share one: [['worker_port', 'detokenizer_port']]",
        ),
        (["--port", "70000"], {}, "port must be in [1, 65535], got 70000"),
        (["--max-tokens-cap", "0"], {}, "max_tokens_cap must be >= 1, got 0"),
        (["--heartbeat-interval", "0"], {}, "heartbeat_interval must be > 0, got 0.0"),
        (
            ["--kv-events-config", '{"publisher": "zmq", "hwm": 0}'],
            {},
            "--kv-events-config: hwm must be >= 1",
        ),
        (
            ["--kv-events-config", '{"publisher": "zmq", "endpont": "tcp://*:1"}'],
            {},
            "--kv-events-config: Object contains unknown field `endpont`",
        ),
        (["--kv-events-block-size", "0"], {}, "kv_events_block_size must be >= 1, got 0"),
    ],
)
def test_bad_values_exit_with_a_message_naming_the_setting(argv, env, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv, env)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_api_key_is_kept_out_of_repr_and_help():
    s = _parse(["--api-key", "sk-secret"])
    assert "sk-secret" not in repr(s)
    assert "sk-secret" not in build_parser({"RADIXSERVE_API_KEY": "sk-secret"}).format_help()


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="grammar_backend must be one of"):
        Settings(grammar_backend="outlines")


def test_to_engine_args_carries_every_engine_field():
    s = _parse(
        [
            "--max-total-tokens",
            "4096",
            "--schedule-policy",
            "lpm",
            "--disable-overlap-schedule",
            "--radix-eviction-policy",
            "slru",
            "--random-seed",
            "3",
            "--port",
            "31000",
        ]
    )
    args = s.to_engine_args()
    assert type(args) is EngineArgs
    assert args == EngineArgs(
        max_total_tokens=4096,
        schedule_policy="lpm",
        disable_overlap_schedule=True,
        radix_eviction_policy="slru",
        random_seed=3,
    )
    for f in fields(EngineArgs):
        assert getattr(args, f.name) == getattr(s, f.name)


def test_settings_import_no_module_of_the_three_processes():
    """All three processes read the settings, so the settings import none of them: the
    walk counts imports inside functions and `if TYPE_CHECKING:` blocks, and stays within
    services/ because engine/ never imports services (tests/engine/test_import_graph.py)."""
    services_dir = Path(services.__file__).parent
    graph = import_graph(services_dir, services_dir.parent)
    imported = reachable(graph, "services.settings")
    assert {"services.settings", "services.ipc", "services.kv_events_config"} <= imported
    processes = {"services.tokenizer", "services.worker", "services.detokenizer"}
    assert sorted(m for m in imported if ".".join(m.split(".")[:2]) in processes) == []


def test_the_tool_parser_names_settings_offer_are_the_registered_parsers():
    assert TOOL_PARSER_NAMES == tuple(TOOL_PARSERS)
    assert DEFAULT_TOOL_PARSER in TOOL_PARSERS
    parser = build_parser({})._option_string_actions["--tool-call-parser"]
    assert (parser.choices, parser.default) == (TOOL_PARSER_NAMES, DEFAULT_TOOL_PARSER)


SGLANG_FLAGS = (
    # SGLang's server flags (python/sglang/srt/server_args.py, v0.5.23) that radixserve
    # takes, with the same meaning; docs/operations.md lists them.
    "--admin-api-key",
    "--api-key",
    "--attention-backend",
    "--chat-template",
    "--chunked-prefill-size",
    "--context-length",
    "--cuda-graph-max-bs-decode",
    "--device",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--disable-radix-cache",
    "--dist-init-addr",
    "--dist-timeout",
    "--dtype",
    "--enable-deterministic-inference",
    "--enable-mixed-chunk",
    "--enable-torch-compile",
    "--grammar-backend",
    "--host",
    "--kv-cache-dtype",
    "--kv-events-config",
    "--log-level",
    "--lora-paths",
    "--max-lora-rank",
    "--max-loras-per-batch",
    "--max-prefill-tokens",
    "--max-queued-requests",
    "--max-running-requests",
    "--max-total-tokens",
    "--mem-fraction-static",
    "--model",
    "--model-path",
    "--nccl-init-addr",
    "--nnodes",
    "--node-rank",
    "--port",
    "--quantization",
    "--radix-eviction-policy",
    "--random-seed",
    "--reasoning-parser",
    "--schedule-conservativeness",
    "--schedule-policy",
    "--served-model-name",
    "--skip-tokenizer-init",
    "--speculative-adaptive",
    "--speculative-algorithm",
    "--speculative-draft-model",
    "--speculative-draft-model-path",
    "--speculative-ngram-capacity",
    "--speculative-ngram-match-type",
    "--speculative-ngram-max-bfs-breadth",
    "--speculative-ngram-max-trie-depth",
    "--speculative-ngram-min-bfs-breadth",
    "--speculative-num-draft-tokens",
    "--tensor-parallel-size",
    "--tokenizer-path",
    "--tool-call-parser",
    "--torch-compile-max-bs",
    "--tp-size",
    "--watchdog-timeout",
)


def test_the_sglang_flags_radixserve_claims_are_flags_of_its_parser():
    known = build_parser({})._option_string_actions
    assert [flag for flag in SGLANG_FLAGS if flag not in known] == []


@pytest.mark.parametrize(
    ("field", "alias"),
    [(field, alias) for field, aliases in SGLANG_ALIASES.items() for alias in aliases],
)
def test_an_sglang_spelling_sets_the_field_of_our_flag(field, alias):
    action = build_parser({})._option_string_actions[alias]
    assert action.dest == field
    assert "--" + field.replace("_", "-") in action.option_strings


def test_an_sglang_command_line_parses():
    s = _parse(
        ["--model-path", "/models/qwen3", "--tensor-parallel-size", "2", "--dist-timeout", "60"]
    )
    assert (s.model, s.tp_size, s.dist_init_timeout) == ("/models/qwen3", 2, 60.0)
    assert s.served_model_name == "/models/qwen3"


@pytest.mark.parametrize(
    "argv",
    [
        ["--lora-paths", "a=/x", "b=/y"],  # SGLang's documented form
        ["--lora-paths", "a=/x,b=/y"],
        ["--lora-paths", "a=/x b=/y"],
        ["--lora-paths=a=/x,b=/y"],
    ],
)
def test_lora_paths_take_several_values_or_one_joined_string(argv):
    assert _parse(argv).lora_entries() == {"a": "/x", "b": "/y"}


def test_lora_paths_from_the_environment_stay_one_string():
    env = {"RADIXSERVE_LORA_PATHS": "a=/x b=/y"}
    assert _parse([], env).lora_entries() == {"a": "/x", "b": "/y"}
    assert _parse(["--lora-paths", "c=/z"], env).lora_entries() == {"c": "/z"}
