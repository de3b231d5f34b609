"""`--api-key-file`, `--api-key` and `--admin-api-key` as the API sees them: who a bearer key
is, which tenant it belongs to, and the key files refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.settings import Settings
from services.tokenizer.middleware import ApiKeyFileError, ApiKeys

KEY_FILE = """\
# tenants of the staging cluster
sk-acme-1 acme
sk-acme-2   acme   # the second key of acme
sk-lone

sk-globex globex
"""


def keys_of(tmp_path: Path, text: str = KEY_FILE, **settings: str) -> ApiKeys:
    path = tmp_path / "keys"
    path.write_text(text)
    return ApiKeys.from_settings(Settings(model="m", api_key_file=str(path), **settings))


def tenant(keys: ApiKeys, key: str) -> str | None:
    found = keys.identify(key.encode())
    assert found is not None, key
    return found.tenant


def test_keys_of_one_tenant_share_it_and_others_do_not(tmp_path: Path):
    keys = keys_of(tmp_path, api_key="sk-flag")
    tenants = {k: tenant(keys, k) for k in ("sk-acme-1", "sk-acme-2", "sk-lone", "sk-globex")}
    assert tenants["sk-acme-1"] == tenants["sk-acme-2"]
    assert len({*tenants.values(), tenant(keys, "sk-flag")}) == 4  # a bare key: its own tenant


def test_a_tenant_digest_names_neither_the_tenant_nor_a_key(tmp_path: Path):
    keys = keys_of(tmp_path)
    for key in ("sk-acme-1", "sk-lone"):
        digest = tenant(keys, key)
        assert digest is not None and "acme" not in digest and key not in digest


def test_unknown_or_missing_keys_are_refused(tmp_path: Path):
    keys = keys_of(tmp_path)
    assert keys.identify(b"sk-acme-3") is None
    assert keys.identify(b"") is None


def test_the_admin_key_alone_operates(tmp_path: Path):
    keys = keys_of(tmp_path, admin_api_key="sk-admin")
    admin, user = keys.identify(b"sk-admin"), keys.identify(b"sk-acme-1")
    assert admin is not None and admin.operator
    assert user is not None and not user.operator and user.identified


def test_without_an_admin_key_every_api_key_operates(tmp_path: Path):
    user = keys_of(tmp_path).identify(b"sk-lone")
    assert user is not None and user.operator


def test_an_open_api_with_an_admin_key_lets_anyone_in_but_not_operate():
    keys = ApiKeys.from_settings(Settings(model="m", admin_api_key="sk-admin"))
    anyone = keys.identify(b"")
    assert anyone is not None and not anyone.operator and not anyone.identified


@pytest.mark.parametrize(
    ("text", "settings", "message"),
    [
        ("sk-a acme extra\n", {}, r"keys:1: expected 'key \[tenant\]', got 3 fields"),
        ("# nothing but comments\n\n", {}, "no API keys in it"),
        ("sk-a acme\nsk-a globex\n", {}, "an API key is given twice"),
        ("sk-a\n", {"admin_api_key": "sk-a"}, "an API key is given twice"),
        ("sk-a\n", {"api_key": "sk-a"}, "an API key is given twice"),
    ],
)
def test_a_malformed_key_file_is_refused_without_showing_a_key(
    tmp_path: Path, text: str, settings: dict[str, str], message: str
):
    with pytest.raises(ApiKeyFileError, match=message) as refused:
        keys_of(tmp_path, text, **settings)
    assert "sk-a" not in str(refused.value)


def test_an_unreadable_key_file_is_refused(tmp_path: Path):
    settings = Settings(model="m", api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ApiKeyFileError, match="cannot read --api-key-file"):
        ApiKeys.from_settings(settings)
