"""Sealed reasoning: what a stateless Responses client (Codex CLI: `store: false` with `include:
["reasoning.encrypted_content"]`) carries between turns instead of a stored response. The think block's text is
encrypted and authenticated (AES-256-GCM) under a key derived from the deployment's secret key, bound to the tenant
(another tenant's sealed item does not open), and opened again when the client sends it back: an item that does not
open (tampered, truncated, another deployment's or tenant's) is a 400, never passed on."""

from __future__ import annotations

import base64
import binascii
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PREFIX = "lpx1."  # the format's version: a sealed item of another format is refused, not misread
NONCE_BYTES = 12


class InvalidSeal(ValueError):
    """The sealed content does not open with this deployment's key for this tenant."""


class ReasoningSeal:
    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("the sealing key must be 32 bytes")
        self._aead = AESGCM(key)

    @staticmethod
    def _bound(tenant: str) -> bytes:
        return f"loraplex reasoning\0{tenant}".encode()

    def seal(self, tenant: str, text: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, text.encode(), self._bound(tenant))
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode("ascii")

    def open(self, tenant: str, token: str) -> str:
        if not token.startswith(PREFIX):
            raise InvalidSeal("not sealed by this server")
        try:
            raw = base64.urlsafe_b64decode(token[len(PREFIX) :].encode("ascii"))
            return self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], self._bound(tenant)).decode()
        except (InvalidTag, binascii.Error, UnicodeError, ValueError) as exc:
            raise InvalidSeal("the sealed content was altered, or is not this account's") from exc
