"""The embedded mode's fleet: one engine in this process, serving the configured (or demo) base model.

It runs the engine's own HTTP app in process (InProcessEngineClient), so requests take exactly the path they
take to a remote engine. Adapters are read from the platform's object store, the only root the engine trusts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from loraplex.engine import (
    QUANTIZATIONS,
    AsyncEngine,
    EngineConfig,
    QuantizationName,
    ReasoningConfig,
    SpeculativeConfig,
    parse_memory_budget,
)
from loraplex.engine.serve import engine_record
from loraplex.platform.domain.fleet.client import InProcessEngineClient
from loraplex.platform.domain.fleet.registry import LocalFleet, Replica
from loraplex.platform.settings import Settings

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "loraplex-demo"
# The demo model is registered as a reasoning model (its `think` adapter writes a short think block), with budgets
# sized to its 256-token context.
DEMO_REASONING_CONFIG = ReasoningConfig(
    parser="qwen3", budgets={"none": 0, "minimal": 8, "low": 16, "medium": 48, "high": 128}, default_effort="medium"
)


def demo_model_path() -> Path | None:
    """The demo model committed in the repository (a source checkout), if this is one."""
    candidate = Path(__file__).resolve().parents[3] / "demo" / "model"
    return candidate if (candidate / "config.json").is_file() else None


def embedded_model(settings: Settings) -> tuple[str, Path]:
    """(base model name, folder) the embedded engine serves."""
    if settings.engine_model is not None:
        path = Path(settings.engine_model).resolve()
        return path.name, path
    demo = demo_model_path()
    if demo is None:
        raise RuntimeError(
            "no model for the embedded engine: set LORAPLEX_ENGINE_MODEL to a model folder "
            "(the demo model ships only in a source checkout)"
        )
    return DEMO_MODEL_NAME, demo


def embedded_quantization(settings: Settings, registered: str | None) -> QuantizationName | None:
    """The quantization the embedded engine serves: LORAPLEX_ENGINE_QUANTIZATION if set ("none" for full weights),
    else the one its base model is registered with (`registered`, the base_models row's field)."""
    chosen = settings.engine_quantization or registered or "none"
    if chosen == "none":
        return None
    for known in QUANTIZATIONS:
        if chosen == known:
            return known
    raise RuntimeError(f"the base model's quantization {chosen!r} is not one the engine knows")


def embedded_speculative_config(settings: Settings, registered: dict[str, Any] | None) -> SpeculativeConfig | None:
    """How the embedded engine speculates: LORAPLEX_ENGINE_SPECULATIVE_CONFIG if set ("none": not at all), else as
    its base model is registered (`registered`, the base_models row's JSON object; None: not at all)."""
    chosen = settings.engine_speculative_config
    if chosen == "none":  # Settings gives "none" in that spelling
        return None
    if chosen is not None:
        return SpeculativeConfig.parse(chosen)
    if registered is None:
        return None
    try:
        return SpeculativeConfig.parse(registered)
    except ValueError as exc:
        raise RuntimeError(
            f"the base model's speculative_config is not one the engine takes ({exc}): set another through "
            "PATCH /admin/base-models/{name}, or LORAPLEX_ENGINE_SPECULATIVE_CONFIG=none"
        ) from None


def embedded_reasoning_config(
    name: str, registered: dict[str, Any] | None, *, first_start: bool
) -> ReasoningConfig | None:
    """How the embedded engine reasons: as its base model `name` is registered (`registered`, the base_models row's
    JSON object; None: it does not). On the first start, before the model is registered, the demo model reasons by
    DEMO_REASONING_CONFIG and any other model does not."""
    if first_start:
        return DEMO_REASONING_CONFIG if name == DEMO_MODEL_NAME else None
    if registered is None:
        return None
    try:
        return ReasoningConfig.from_dict(registered)
    except ValueError as exc:
        raise RuntimeError(
            f"the base model's reasoning_config is not one the engine takes ({exc}): set another through "
            "PATCH /admin/base-models/{name}"
        ) from None


def adapter_roots(settings: Settings) -> list[str]:
    if settings.s3_bucket is not None:
        return [f"s3://{settings.s3_bucket}/tenants/"]
    return [str(settings.objects_dir.resolve() / "tenants")]


async def start_embedded_fleet(
    settings: Settings,
    quantization: QuantizationName | None = None,
    speculative_config: SpeculativeConfig | None = None,
    reasoning: ReasoningConfig | None = None,
) -> tuple[LocalFleet, AsyncEngine, str, Path]:
    from loraplex.engine.serve import create_engine_app

    name, path = embedded_model(settings)
    config = EngineConfig(
        model=path,
        dtype=settings.engine_dtype,
        quantization=quantization,
        speculative_config=speculative_config,
        reasoning=reasoning,
        max_model_len=settings.engine_max_model_len,
        kv_budget=parse_memory_budget(settings.engine_kv_budget),
        served_model_name=name,
        # The rank uploads are validated against: an adapter the platform accepted must be one the engine can serve.
        max_lora_rank=settings.max_lora_rank,
        s3_endpoint_url=settings.s3_endpoint_url,
        s3_region=settings.s3_region,
        # The platform's own credentials: the engine reads adapters from the bucket the platform writes them to.
        s3_access_key_id=settings.s3_access_key_id,
        s3_secret_access_key=(
            settings.s3_secret_access_key.get_secret_value() if settings.s3_secret_access_key is not None else None
        ),
    )
    started = time.perf_counter()
    engine = await AsyncEngine.create(config)
    logger.info(
        "embedded engine serving %s from %s (%s, %s, %s, %.1f s)",
        name,
        path,
        quantization or "unquantized",
        f"speculating by {speculative_config.method}" if speculative_config is not None else "not speculating",
        f"reasoning by {reasoning.parser}" if reasoning is not None else "not reasoning",
        time.perf_counter() - started,
    )
    app = create_engine_app(engine, adapter_roots=adapter_roots(settings))

    def state() -> Replica:
        return engine_record(engine, "embedded", "in-process", name)

    return LocalFleet(replica_state=state, engine_client=InProcessEngineClient(app)), engine, name, path
