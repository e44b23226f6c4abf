"""Typed ids, so a tenant id can never be passed where a key id is meant."""

from __future__ import annotations

import uuid
from typing import NewType

TenantId = NewType("TenantId", uuid.UUID)
ApiKeyId = NewType("ApiKeyId", str)
AdminKeyId = NewType("AdminKeyId", str)
