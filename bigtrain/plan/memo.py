"""Caches for the layout search: a search prices tens of thousands of layouts, most of whose terms
read only a few of a layout's fields (the saved activations read neither the ZeRO stage nor dp; the
stage's compute reads neither the ZeRO stage nor the schedule), so each such term is computed once
per distinct value of what it reads and shared by the layouts that agree there.

Every function cached here is a pure function of frozen values (``ModelSpec``, ``Layout``,
``Cluster``, numbers and strings): a cached answer is the one the function would compute again.
:func:`by_layout_fields` keys on the layout *without* the fields a function is declared not to
read; tests/test_plan_search_speed.py changes each of those fields and checks the uncached
function's answer does not move, and compares a warm search's answers with ones computed afresh.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Callable

from bigtrain.plan.layout import Layout

_CACHES: list = []  # every cache here, for clear_caches
# function -> the layout fields it is declared not to read (the test varies them)
IGNORED_FIELDS: dict[Callable, tuple[str, ...]] = {}
MAX_ENTRIES = 1 << 16  # a cache this full starts again (a long process plans many models)


def cached(maxsize: int = 8192):
    """``functools.lru_cache`` registered for :func:`clear_caches`."""
    def wrap(fn):
        out = functools.lru_cache(maxsize=maxsize)(fn)
        _CACHES.append(out)
        return out
    return wrap


def by_layout_fields(*ignored: str):
    """Cache ``fn(model, layout, *rest)`` on the model, the rest and the layout's fields other than
    ``ignored`` (those ``fn`` does not read, directly or through what it calls)."""
    names = [f.name for f in dataclasses.fields(Layout)]
    unknown = set(ignored) - set(names)
    if unknown:
        raise ValueError(f"by_layout_fields: {sorted(unknown)} are not Layout fields")
    read = operator.attrgetter(*(n for n in names if n not in ignored))

    def wrap(fn):
        cache: dict = {}

        @functools.wraps(fn)
        def wrapper(model, layout, *rest, **named):
            key = (model, read(layout), *rest, *sorted(named.items()))
            try:
                return cache[key]
            except KeyError:
                pass
            except TypeError:  # an unhashable argument (a profile built with a list in it): not cached
                return fn(model, layout, *rest, **named)
            if len(cache) >= MAX_ENTRIES:
                cache.clear()
            value = cache[key] = fn(model, layout, *rest, **named)
            return value

        wrapper.cache_clear = cache.clear
        wrapper.uncached = fn
        _CACHES.append(wrapper)
        IGNORED_FIELDS[fn] = tuple(ignored)
        return wrapper
    return wrap


def clear_caches() -> None:
    """Forget every cached answer (tests: a fresh computation to compare a warm one with)."""
    for cache in _CACHES:
        cache.cache_clear()
