"""Layouts: how a whole tree is divided or combined, resolved once per structure into a plan.

A layout is a single rule, a prefix tree of rules in the vmap/pmap convention
(:mod:`.prefix`), or :func:`by_path` patterns, dotted fnmatch strings and tuples for exact paths
(:mod:`.by_path`); :mod:`.plan` resolves any of them for one structure. Errors about fitting a
layout to data end with :data:`EXPLAIN_POINTER`.
"""

from __future__ import annotations

from .._errors import EXPLAIN_POINTER
from .._rules import to_rule
from .._tree import display_path
from .by_path import ByPath, RuleSource, by_path, path_text, writable_path
from .plan import Plan, describe_source, layout_key, rebase, resolve, resolve_sources

__all__ = [
    "EXPLAIN_POINTER",
    "ByPath",
    "Plan",
    "RuleSource",
    "by_path",
    "describe_source",
    "display_path",
    "layout_key",
    "path_text",
    "rebase",
    "resolve",
    "resolve_sources",
    "to_rule",
    "writable_path",
]
