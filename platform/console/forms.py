"""Reading console forms: a URL-encoded body as a dict of strings, validated by a pydantic model in lax mode.

A browser sends every field as text ("10", "on", ""), so forms cannot go through the API's strict body validation:
handlers take `data: FormData` and call `parse_form(Model, data)`, which raises a 400 ApiError whose message names
the field, for the page to show beside the form it re-renders. The CSRF field is read by the guard and ignored here.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from litestar.enums import RequestEncodingType
from litestar.params import Body
from pydantic import BaseModel, ConfigDict, ValidationError

from loraplex.platform.errors import ApiError

M = TypeVar("M", bound=BaseModel)

FormData = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]


class Form(BaseModel):
    """Base of console forms: lax types (text to numbers), blank text as absent, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", str_strip_whitespace=True)


def parse_form(model: type[M], data: dict[str, Any], *, labels: dict[str, str] | None = None) -> M:
    """`data` as `model`, blank fields dropped (so optional fields left empty are None). `labels` maps field names to
    what the page calls them, for the message."""
    values = {k: v for k, v in data.items() if not (isinstance(v, str) and not v.strip())}
    try:
        return model.model_validate(values, strict=False)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        label = (labels or {}).get(field, field.replace("_", " "))
        if error["type"] == "missing":
            message = f"Fill in {label}."
        else:
            # pydantic words a validator's ValueError as "Value error, <message>": the message is what a person reads.
            reason = str(error["msg"]).removeprefix("Value error, ")
            message = f"{label[:1].upper()}{label[1:]}: {reason}."
        raise ApiError(400, message, code="invalid_form", param=field) from None
