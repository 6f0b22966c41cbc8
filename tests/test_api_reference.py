"""The API reference covers every public name, and every public name has a docstring.

The site (``mkdocs build --strict`` in ``make test``) renders ``docs/api/*.md`` from the
docstrings; this test fails first when a public name has none or no page shows it.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import torch_distribute as td

API_PAGES = Path(__file__).resolve().parents[1] / "docs" / "api"


def rendered() -> set[str]:
    """The identifiers the API pages render (``::: torch_distribute.X`` lines)."""
    return {line[4:].strip() for page in API_PAGES.glob("*.md")
            for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("::: ")}


def public_objects(module: types.ModuleType, prefix: str, seen: set[str]):
    """``(dotted name, object)`` for every name in ``__all__``, through public subpackages."""
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            if obj.__name__ not in seen:
                seen.add(obj.__name__)
                yield from public_objects(obj, f"{prefix}.{name}", seen)
        else:
            yield f"{prefix}.{name}", obj


def test_every_public_class_and_function_has_a_docstring():
    missing = [name for name, obj in public_objects(td, "td", set())
               if (inspect.isclass(obj) or inspect.isfunction(obj))
               and obj.__module__.startswith("torch_distribute") and not (obj.__doc__ or "").strip()]
    assert not missing, f"public names without a docstring (the API reference shows none): {missing}"


def test_every_top_level_name_is_on_an_api_page():
    pages = rendered()
    missing = [name for name in td.__all__ if f"torch_distribute.{name}" not in pages]
    assert not missing, f"add these to a page in docs/api/: {missing}"
