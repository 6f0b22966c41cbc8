"""A griffe extension for the API reference: doctest examples in docstrings become code blocks.

The docstrings are plain text with ``>>>`` examples (checked by doctest); Markdown would read
``>>>`` as nested quotes, so each run of example lines is fenced as ``pycon``.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    out: list[str] = []
    in_example = False
    for line in text.splitlines():
        stripped = line.lstrip()
        if not in_example and stripped.startswith(">>>"):
            out.append("```pycon")
            in_example = True
        elif in_example and not stripped:
            out.append("```")
            in_example = False
        out.append(line)
    if in_example:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
