"""PLACEHOLDER: the Fleet page (being written)."""

from __future__ import annotations

from litestar import Controller, get
from litestar.response import Template

from loraplex.platform.console.access import Caller
from loraplex.platform.console.pages import page


class AdminFleetPages(Controller):
    path = "/fleet"

    @get("/")
    async def index(self, caller: Caller) -> Template:
        return page("placeholder.html", caller, title="Fleet")
