"""The chart's LoRA values: adapters on the model volume become `--lora-paths` (and the
other LoRA flags) in all three containers, and the schema refuses what the flags cannot carry."""

from __future__ import annotations

from typing import Any

import pytest

from services.settings import Settings
from tests.deploy.conftest import CONTAINERS, helm_template, helm_template_error

ON_A_VOLUME = {"model.source": "hostPath", "model.hostPath.path": "/data", "model.path": "base"}
ADAPTERS = [{"name": "sql", "path": "adapters/sql"}, {"name": "chat", "path": "/adapters/chat"}]


def lora_args(args: list[str]) -> list[str]:
    return [a for a in args if "lora" in a]


def test_no_lora_values_no_lora_flags(default):
    for container in CONTAINERS:
        assert lora_args(default.containers[container]["args"]) == []


def test_adapters_on_the_model_volume_become_the_same_flags_in_every_container():
    sets: dict[str, Any] = {
        **ON_A_VOLUME,
        "lora.adapters": ADAPTERS,
        "lora.maxLorasPerBatch": 3,
        "lora.maxLoraRank": 16,
        "lora.runtimeUpdate": True,
        "lora.root": "adapters/",
    }
    render = helm_template(sets=sets)
    args = render.containers["worker"]["args"]
    assert lora_args(args) == [
        "--lora-paths=sql=/models/adapters/sql,chat=/models/adapters/chat",
        "--max-loras-per-batch=3",
        "--max-lora-rank=16",
        "--enable-lora-runtime-update",
        "--lora-root=/models/adapters",
    ]
    for container in CONTAINERS:
        assert lora_args(render.containers[container]["args"]) == lora_args(args)
    settings = Settings.from_cli(args, env={})
    assert (settings.max_loras_per_batch, settings.max_lora_rank) == (3, 16)
    assert settings.enable_lora_runtime_update and settings.lora_root == "/models/adapters"


def test_runtime_update_alone_needs_no_adapters():
    render = helm_template(sets={**ON_A_VOLUME, "lora.runtimeUpdate": True})
    args = lora_args(render.containers["worker"]["args"])
    assert "--enable-lora-runtime-update" in args
    assert not [a for a in args if a.startswith("--lora-paths")]


def test_adapters_need_a_model_volume():
    error = helm_template_error(sets={"lora.adapters": ADAPTERS})
    assert "model volume" in error


@pytest.mark.parametrize(
    "adapters",
    [
        [{"name": "a,b", "path": "x"}],
        [{"name": "sql", "path": "two words"}],
        [{"name": "sql"}],
        [{"name": "sql", "path": "x", "rank": 8}],
    ],
)
def test_the_schema_refuses_adapters_the_flag_cannot_carry(adapters):
    error = helm_template_error(sets={**ON_A_VOLUME, "lora.adapters": adapters})
    assert "lora.adapters" in error
