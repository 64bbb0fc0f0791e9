"""A griffe extension for the site's API pages: grpo's docstrings are written for Sphinx
(``code``, :class:`~grpo.X`, :mod:`grpo.y`, :data:`Z`); mkdocstrings renders Markdown, where
those would show as literal roles. This rewrites them as Markdown code spans when griffe
loads each object (the source is not touched). Named in mkdocs.yml under the python
handler's ``extensions``."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj|exc|const):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def markdown(text: str) -> str:
    """Sphinx roles and double-backtick literals as Markdown code spans."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1] if m.group(0).count('~') else m.group(1)}`", text)
    return _LITERAL.sub(r"`\1`", text)


class RstDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
