"""Words for people, shared by every page the platform renders (the console and the billing page)."""

from __future__ import annotations


def plural(count: int, singular: str, plural_form: str | None = None) -> str:
    """`1 request`, `2 requests`, `1,024 requests`; `plural_form` where adding "s" is wrong."""
    word = singular if count == 1 else (plural_form or singular + "s")
    return f"{count:,} {word}"
