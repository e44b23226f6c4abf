"""Edge types shared by every domain: OpenAI-style lists and validated names."""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from litestar.params import QueryParameter
from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints

from loraplex.platform.db.pagination import MAX_PAGE_SIZE

T = TypeVar("T")


def _printable(value: str) -> str:
    if any(not c.isprintable() for c in value):
        raise ValueError("must not contain control characters")
    return value


Name = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200),
    AfterValidator(_printable),
]


class RequestBody(BaseModel):
    """Base of request bodies: unknown fields are an error, as in OpenAI's API."""

    model_config = ConfigDict(extra="forbid")


class ObjectList(BaseModel, Generic[T]):
    """`{"object": "list", "data": [...], "has_more": ..., "first_id": ..., "last_id": ...}`, like OpenAI's lists."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None

    @classmethod
    def of(cls, items: list[Any], *, has_more: bool) -> ObjectList[T]:
        return cls(
            data=items,
            has_more=has_more,
            first_id=str(items[0].id) if items else None,
            last_id=str(items[-1].id) if items else None,
        )


# Query parameters of every list endpoint.
PageLimit = Annotated[int, QueryParameter(ge=1, le=MAX_PAGE_SIZE, description="Page size, 1-100.")]
