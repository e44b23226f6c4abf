"""Embeddings: how an embedding model pools its hidden states, read from the checkpoint as sentence-transformers saves
it, and a request's pooled vector built up over its prefill's chunks.

A sentence-transformers folder lists its modules in `modules.json`; the Pooling module's folder (`1_Pooling`) has a
config.json whose `pooling_mode_*` flag says how token states become one vector (Qwen3-Embedding: the last token,
`pooling_mode_lasttoken`; most BERT-style ones: the mean; some: the first, `pooling_mode_cls_token`), and a
Normalize module (`2_Normalize`) scales it to unit length. A checkpoint without `modules.json` is not an embedding
model. Pooling runs over the final norm's output (what transformers' `last_hidden_state` is). A request's
`dimensions` keeps the first that many components (Matryoshka models such as Qwen3-Embedding) and normalizes again
when the model normalizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.errors import CheckpointError, RequestError

PoolingMode = Literal["last", "mean", "cls"]

# What an embedding request is checked with: its prompt, and room for one position, which it never generates.
EMBEDDING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
MODULES_FILE = "modules.json"
_POOLING_TYPE = "sentence_transformers.models.Pooling"
_NORMALIZE_TYPE = "sentence_transformers.models.Normalize"
_TRANSFORMER_TYPE = "sentence_transformers.models.Transformer"
_MODES: dict[str, PoolingMode] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How the checkpoint's embeddings are made."""

    mode: PoolingMode
    normalize: bool


def read_pooling_config(folder: Path) -> PoolingConfig | None:
    """The checkpoint's pooling (sentence-transformers' modules.json), or None for a model that is not an embedding
    model. Raises CheckpointError naming the file and field of one loraplex does not run."""
    modules_file = folder / MODULES_FILE
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{modules_file}: not valid JSON ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{modules_file}: must be a list of modules")
    kinds = [str(module.get("type", "")) for module in modules]
    unknown = [kind for kind in kinds if kind not in (_TRANSFORMER_TYPE, _POOLING_TYPE, _NORMALIZE_TYPE)]
    if unknown:
        raise CheckpointError(
            f"{modules_file}: module type {unknown[0]!r} is not supported; loraplex runs Transformer, Pooling and "
            "Normalize modules"
        )
    pooling = [module for module in modules if module.get("type") == _POOLING_TYPE]
    if len(pooling) != 1:
        raise CheckpointError(f"{modules_file}: an embedding model needs exactly one Pooling module")
    config_file = folder / str(pooling[0].get("path", "")) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_file}: the Pooling module's config cannot be read ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: must be an object")
    for field in _UNSUPPORTED_MODES:
        if config.get(field) is True:
            raise CheckpointError(f"{config_file}: {field} is not supported; loraplex pools by last token, mean or CLS")
    modes = [mode for field, mode in _MODES.items() if config.get(field) is True]
    if len(modes) != 1:
        raise CheckpointError(f"{config_file}: exactly one of {', '.join(_MODES)} must be true, got {len(modes)}")
    if config.get("include_prompt", True) is not True:
        raise CheckpointError(f"{config_file}: include_prompt false (instruction-excluded pooling) is not supported")
    return PoolingConfig(modes[0], normalize=_NORMALIZE_TYPE in kinds)


@dataclass(slots=True)
class PoolingState:
    """One embedding request's pooled vector as its prefill's chunks arrive (restarted by a preemption)."""

    mode: PoolingMode
    normalize: bool
    dimensions: int | None  # keep the first that many components; None: all
    acc: torch.Tensor | None = None  # float32 [hidden]: the sum (mean), the first row (cls) or the last row seen
    embedding: list[float] | None = None  # once the prompt is done

    def add(self, rows: torch.Tensor, start: int) -> None:
        """This step's final hidden states [num_new, hidden] of the request's tokens from position `start`."""
        rows = rows.float()
        if self.mode == "mean":
            total = rows.sum(0)
            self.acc = total if start == 0 or self.acc is None else self.acc + total
        elif self.mode == "cls":
            if start == 0:
                self.acc = rows[0].clone()
        else:
            self.acc = rows[-1].clone()

    def finish(self, num_tokens: int) -> list[float]:
        assert self.acc is not None, "a pooled request finishes after its prompt ran"
        vector = self.acc / num_tokens if self.mode == "mean" else self.acc
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = vector / vector.norm().clamp(min=1e-12)
        self.embedding = vector.tolist()
        return self.embedding


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden_size:
        raise RequestError(
            f"dimensions must be an integer from 1 to {hidden_size} (the model's embedding size), got {dimensions!r}",
            param="dimensions",
        )


def check_task(config: PoolingConfig | None, *, embedding: bool) -> None:
    """RequestError unless a model of this pooling (None: not an embedding model) does that task."""
    if embedding == (config is not None):
        return
    raise RequestError(
        "this model is an embedding model: it serves embeddings (/v1/embeddings), not generation"
        if not embedding
        else "this model is not an embedding model (its checkpoint has no sentence-transformers modules.json "
        "with a Pooling module): it serves generation, not embeddings",
        param="model",
        code="model_not_supported",
    )


def new_pooling_state(config: PoolingConfig | None, dimensions: int | None, hidden_size: int) -> PoolingState:
    """A new embedding request's pooling; RequestError for a model that does not embed or `dimensions` it cannot
    give."""
    check_task(config, embedding=True)
    assert config is not None
    check_dimensions(dimensions, hidden_size)
    return PoolingState(config.mode, config.normalize, dimensions)
