"""The tenant-facing request shape of /v1/embeddings: OpenAI's fields, strictly (unknown fields refused, every list
bounded), as the completions' schemas are."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from loraplex.platform.schemas import Name, RequestBody

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
MAX_INPUT_CHARS = 1_000_000  # far past any model's context; the engine refuses what its context cannot hold
MAX_DIMENSIONS = 65_536

Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_INPUT_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1, max_length=MAX_INPUT_CHARS)]


class EmbeddingRequest(RequestBody):
    model: Name
    # A string, a list of strings, a list of token ids, or a list of such lists: one embedding per string or list.
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    dimensions: Annotated[int, Field(ge=1, le=MAX_DIMENSIONS)] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: Annotated[str, StringConstraints(max_length=256)] | None = None

    def texts_and_token_lists(self) -> tuple[list[str], list[list[int]]]:
        """The inputs as strings and as token lists (one of the two is empty)."""
        value = self.input
        if isinstance(value, str):
            return [value], []
        if all(isinstance(item, int) for item in value):
            return [], [list(value)]  # type: ignore[arg-type]
        if all(isinstance(item, str) for item in value):
            return list(value), []  # type: ignore[arg-type]
        return [], list(value)  # type: ignore[arg-type]
