"""API key format, entropy and keyed hashing."""

from __future__ import annotations

import math

import pytest

from loraplex.platform.domain.api_keys.keys import (
    SECRET_LENGTH,
    KeyHasher,
    KeyKind,
    generate_key,
    parse_key,
)

pytestmark = pytest.mark.unit


class TestGenerateKey:
    def test_shape_and_round_trip(self) -> None:
        new_key = generate_key(KeyKind.TENANT)
        assert new_key.full_key.startswith(f"lpx_{new_key.key_id}_")
        parsed = parse_key(new_key.full_key)
        assert parsed is not None
        assert parsed.kind is KeyKind.TENANT
        assert parsed.key_id == new_key.key_id

    def test_admin_keys_are_distinguishable(self) -> None:
        parsed = parse_key(generate_key(KeyKind.ADMIN).full_key)
        assert parsed is not None and parsed.kind is KeyKind.ADMIN

    def test_secret_has_at_least_128_bits(self) -> None:
        secret = generate_key(KeyKind.TENANT).full_key.split("_")[2]
        assert len(secret) == SECRET_LENGTH
        assert len(secret) * math.log2(62) >= 128

    def test_keys_do_not_repeat(self) -> None:
        keys = {generate_key(KeyKind.TENANT).full_key for _ in range(2000)}
        assert len(keys) == 2000


class TestParseKey:
    @pytest.mark.parametrize(
        "text",
        [
            "",
            "lpx",
            "sk-abc",
            "lpx_short_secret",
            "lpx_abcdefghijklmnop",
            "lpx_abcdefghijklmnop_" + "a" * 31,
            "lpx_abcdefghijklmnop_" + "a" * 33,
            "lpx_ABCDEFGHIJKLMNOP_" + "a" * 32,
            "lpx_abcdefghijklmnop_" + "a" * 31 + "!",
            "xyz_abcdefghijklmnop_" + "a" * 32,
            "lpx_abcdefghijklmnop_" + "a" * 32 + "_extra",
        ],
    )
    def test_refuses_malformed(self, text: str) -> None:
        assert parse_key(text) is None


class TestKeyHasher:
    def test_verifies_only_the_same_key(self) -> None:
        hasher = KeyHasher(b"k" * 32)
        key = generate_key(KeyKind.TENANT).full_key
        stored = hasher.hash(key)
        assert hasher.verify(key, stored)
        assert not hasher.verify(key[:-1] + ("a" if key[-1] != "a" else "b"), stored)
        assert key not in stored

    def test_hash_depends_on_the_secret_key(self) -> None:
        key = generate_key(KeyKind.TENANT).full_key
        assert KeyHasher(b"a" * 32).hash(key) != KeyHasher(b"b" * 32).hash(key)

    def test_refuses_short_secret_key(self) -> None:
        with pytest.raises(ValueError, match="16 bytes"):
            KeyHasher(b"short")
