"""Edge types shared by every domain: OpenAI-style lists and validated names."""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from litestar.params import QueryParameter
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, StringConstraints, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from loraplex.platform.db.pagination import MAX_PAGE_SIZE

T = TypeVar("T")


def _printable(value: str) -> str:
    if any(not c.isprintable() for c in value):
        raise ValueError("must not contain control characters")
    return value


# Text that is stored or looked up: printable, so never a NUL byte, which Postgres refuses in text (SQLite would
# store it; the answer must not depend on the database).
Printable = AfterValidator(_printable)

# A name given to something, or naming something that exists (a base model, an endpoint, `model`).
Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200), Printable]


class RequestBody(BaseModel):
    """Base of request bodies: unknown fields are an error, and types are strict, as in OpenAI's API (`"16"` is not
    a number, `"yes"` not a boolean, `true` not a temperature); a number is accepted where a float is. The app
    validates bodies in strict mode (create_app's PydanticPlugin), which overrides any per-field setting: a field
    whose JSON form is a string of another type (a UUID, a decimal, a timestamp, an enum) is annotated with
    `from_json_string`."""

    model_config = ConfigDict(extra="forbid", strict=True)


def from_json_string(kind: Any, *, numbers: bool = False) -> BeforeValidator:
    """Parse a field of type `kind` from its JSON form, a string (and, with `numbers`, a JSON number), as
    pydantic's lax mode does; anything else goes on to the strict check (`true` is not a UUID)."""
    adapter: TypeAdapter[Any] = TypeAdapter(kind)
    accepted: tuple[type, ...] = (str, int, float) if numbers else (str,)

    def parse(value: Any) -> Any:
        if not isinstance(value, accepted) or isinstance(value, bool):
            return value
        try:
            return adapter.validate_python(value, strict=False)
        except PydanticValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"]) from None

    return BeforeValidator(parse)


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
