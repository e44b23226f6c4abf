"""Service tiers (OpenAI's `service_tier`): how urgent a request is, what a tenant may ask for, what it is priced at.

The platform resolves a request's tier and sends it to the engine, which turns it into a scheduling priority
(flex 1, default 0, priority -1: lower runs first; the mapping is the engine's). Usage rows carry the tier and the
price book may hold a version per tier. Why and the defaults: docs/decisions/0026-service-tiers.md.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class ServiceTier(enum.StrEnum):
    FLEX = "flex"
    DEFAULT = "default"
    PRIORITY = "priority"


# Least urgent first: the order lists of tiers are shown in.
TIER_ORDER = (ServiceTier.FLEX, ServiceTier.DEFAULT, ServiceTier.PRIORITY)


def canonical_tiers(tiers: Iterable[ServiceTier | str]) -> list[ServiceTier]:
    """`tiers` as a list of distinct tiers in TIER_ORDER; ValueError when one is not a tier, one is repeated, or
    `default` is missing (a request that names no tier, or `auto`, runs on it, so a tenant must be allowed it)."""
    given = [ServiceTier(tier) for tier in tiers]
    if len(set(given)) != len(given):
        raise ValueError("each service tier may be listed once")
    if ServiceTier.DEFAULT not in given:
        raise ValueError("the service tiers must include 'default': requests that name no tier (or 'auto') run on it")
    return [tier for tier in TIER_ORDER if tier in given]
