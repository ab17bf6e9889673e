"""Griffe extension for the documentation site (mkdocs.yml): show the Sphinx roles the docstrings use
(``:class:`~schedspec.spec.state.StepPlan```, ``:func:`apply_plan```, ...) as inline code, the way
Sphinx would print them (``~`` keeps the last name only), instead of the raw role markup that
mkdocstrings would otherwise print. Only the rendered text changes; the source is untouched."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|exc|obj|const):`(~?)([^`]+)`")


def plain_roles(text: str) -> str:
    """``text`` with every Sphinx cross-reference role replaced by inline code of its target."""
    def replace(match: re.Match[str]) -> str:
        short, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if short else target}`"

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles in every docstring griffe loads (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
