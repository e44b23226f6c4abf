"""PLACEHOLDER: the Models & prices page (being written)."""

from __future__ import annotations

from litestar import Controller, get
from litestar.response import Template

from loraplex.platform.console.access import Caller
from loraplex.platform.console.pages import page


class AdminModelPages(Controller):
    path = "/models"

    @get("/")
    async def index(self, caller: Caller) -> Template:
        return page("placeholder.html", caller, title="Models & prices")
