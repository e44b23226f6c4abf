"""What the engine server says about itself: the cards of /v1/models (the base model, then each registered adapter, as
vLLM lists them) and /v1/state (load, page pool, prefix cache, adapters)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loraplex.engine.serve.api_errors import ApiError
from loraplex.engine.serve.protocol import ModelCard, ModelList

if TYPE_CHECKING:
    from loraplex.engine.serve.serving import OpenAIServing


def model_card(serving: OpenAIServing, model_id: str) -> ModelCard:
    """One card of `model_cards()`; 404 model_not_found for a name it does not list."""
    card = next((c for c in model_cards(serving).data if c.id == model_id), None)
    if card is None:
        raise ApiError(404, f"The model `{model_id[:256]}` does not exist.", code="model_not_found", param="model")
    return card


def model_cards(serving: OpenAIServing) -> ModelList:
    """The base model, then every registered adapter, as vLLM lists them."""
    cards = [
        ModelCard(
            id=serving.model_name,
            created=serving.created,
            root=str(serving.engine.core.config.model),
            max_model_len=serving.max_model_len,
            parameters=serving.engine.core.model_config.num_parameters(),
            active_parameters=serving.engine.core.model_config.active_parameters(),
        )
    ]
    for registered in serving.loras.adapters():
        cards.append(
            ModelCard(
                id=registered.ref.name,
                created=registered.created,
                root=registered.ref.source,
                parent=serving.model_name,
                max_model_len=serving.max_model_len,
            )
        )
    return ModelList(data=cards)


def engine_state(serving: OpenAIServing) -> dict[str, Any]:
    """GET /v1/state: the engine's load, pool and prefix cache, and its adapters."""
    state = serving.engine.state()
    pool = state.pool
    return {
        "model": serving.model_name,
        "max_model_len": serving.max_model_len,
        "healthy": serving.engine.is_healthy,
        "num_waiting": state.num_waiting,
        "num_running": state.num_running,
        "num_preemptions": state.num_preemptions,
        "num_steps": state.num_steps,
        "weight_bytes": state.weight_bytes,
        "quantization": state.quantization,
        "pool": {
            "num_pages": pool.num_pages,
            "num_free": pool.num_free,
            "page_bytes": pool.page_bytes,
            "by_kind": dict(pool.by_kind),
            "num_evictable": pool.num_evictable,
        },
        "prefix_cache": {
            "blocks": state.prefix_cache_blocks,
            "queried_tokens": state.prefix_cache_queried_tokens,
            "hit_tokens": state.prefix_cache_hit_tokens,
        },
        "adapters": serving.loras.report(),
        "operators": dict(state.operators),
    }
