"""Walking nested containers (dicts, lists, tuples, namedtuples, dataclasses): batches and collectives' payloads."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


def map_leaves(data: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every leaf under dicts, lists, tuples, namedtuples and dataclass instances.

    Containers are rebuilt with their own type, so an OrderedDict, a defaultdict (with its default_factory),
    a namedtuple or a user's dataclass comes back as one. Leaves are visited in a fixed order (insertion order
    for mappings), which the collectives rely on to match leaves across ranks.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    kind = type(data)
    if kind is tuple or kind is list:  # the usual batch: skip the generic checks below (~1 us each)
        return kind([map_leaves(value, fn) for value in data])
    if kind is dict:
        return {key: map_leaves(value, fn) for key, value in data.items()}
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        # replace() re-runs __init__/__post_init__, so fields with init=False are what those make of them.
        changes = {f.name: map_leaves(getattr(data, f.name), fn) for f in dataclasses.fields(data) if f.init}
        return dataclasses.replace(data, **changes)
    if isinstance(data, MutableMapping):
        # A shallow copy keeps the type and its extras (defaultdict's default_factory, attributes) without
        # knowing the constructor's signature; the copy's values are then replaced in place.
        out = copy.copy(data)
        for key, value in data.items():
            out[key] = map_leaves(value, fn)
        return out
    if isinstance(data, Mapping):
        return kind({key: map_leaves(value, fn) for key, value in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(map_leaves(value, fn) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_leaves(value, fn) for value in data)
    return fn(data)
