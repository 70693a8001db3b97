"""How a call travels to its ranks: fn and its arguments pickled by value with cloudpickle, keeping the file names
of code pickled by value and a torch optimizer's own attributes, and a failure that names the argument at fault."""

from __future__ import annotations

import collections
import inspect
import io
import marshal
import sys
import types
from collections.abc import Callable
from typing import Any, ClassVar, cast

import cloudpickle

from qaccel.launch import caller_state


class _FileNamesKept(cloudpickle.Pickler):
    """cloudpickle, except that code pickled by value keeps its file name (cloudpickle 3.1.3 and later write
    "<dynamic-code>"): a rank's traceback and hang report then name the script's file and show its lines. Code
    travels as marshal writes it, which the ranks read back whole: they run the same Python, as cloudpickle's code
    by value needs anyway."""

    dispatch_table: ClassVar[collections.ChainMap] = collections.ChainMap(
        {types.CodeType: lambda code: (marshal.loads, (marshal.dumps(code),))},
        cast(collections.ChainMap, cloudpickle.Pickler.dispatch_table),  # a ChainMap (pickle's stubs: a Mapping)
    )

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._caller_state = caller_state.reducer()

    def reducer_override(self, obj: Any) -> Any:
        if self._caller_state is not None:
            reduced = self._caller_state(obj)
            if reduced is not NotImplemented:
                return reduced
        if _torch_pickles_part_of(obj):
            return _whole_optimizer(obj)
        return super().reducer_override(obj)


# What a torch optimizer's pickle leaves out: its hooks (torch's __setstate__ makes them anew) and an LR scheduler's
# wrapper of the instance's step (it holds a weak reference; the scheduler made on a rank wraps it again).
_PROCESS_LOCAL = ("step", "_opt_called")


def _torch_pickles_part_of(obj: Any) -> bool:
    """Whether ``obj`` is a torch optimizer pickled by torch's ``Optimizer.__getstate__`` (not its class's own)."""
    optim = sys.modules.get("torch.optim")  # not imported: obj is no optimizer
    return (
        optim is not None
        and isinstance(obj, optim.Optimizer)
        and type(obj).__getstate__ is optim.Optimizer.__getstate__
    )


def _whole_optimizer(optimizer: Any) -> tuple[Any, ...]:
    """A torch optimizer with its own attributes: torch's ``Optimizer.__getstate__`` keeps only ``defaults``,
    ``state`` and ``param_groups``, so on the ranks LBFGS would miss its ``_params`` and a subclass what its
    ``__init__`` set (perceptrain's AdamLBFGS its inner Adam and L-BFGS, its step count)."""
    state = {
        name: value
        for name, value in vars(optimizer).items()
        if name not in _PROCESS_LOCAL and not (name.startswith("_optimizer_") and name.endswith("_hooks"))
    }
    return _new, (type(optimizer),), state


def _new(cls: Any) -> Any:
    """An instance of ``cls`` not yet initialised, for pickle to set its state (copyreg's ``__newobj__``)."""
    return cls.__new__(cls)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled by cloudpickle, code keeping its file names; read it back with ``pickle.loads``."""
    buffer = io.BytesIO()
    _FileNamesKept(buffer).dump(obj)
    return buffer.getvalue()


def dumps_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """``(None, fn, args, kwargs)`` pickled, a launch's payload without the caller's settings; a failure is a
    TypeError naming the part that cannot be pickled."""
    try:
        return dumps((None, fn, args, kwargs))
    except caller_state.MadeInCaller as exc:
        raise caller_state.MadeInCaller(f"distribute({_name(fn)}): {exc}") from None
    except Exception as exc:
        raise _unpicklable(fn, args, kwargs, exc) from exc


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _unpicklable(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception) -> TypeError:
    """A TypeError naming the first of fn and its arguments that cannot be pickled (by position and name)."""
    try:
        names = list(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        names = []
    fn_name = _name(fn)
    parts = [("the function itself", fn)]
    parts += [(f"argument {i}" + (f" ({names[i]!r})" if i < len(names) else ""), a) for i, a in enumerate(args)]
    parts += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in parts:
        try:
            cloudpickle.dumps(value)
        except Exception as part_exc:  # noqa: BLE001 - the first failure is the one to name
            return TypeError(
                f"distribute({fn_name}): {label}, a {type(value).__name__}, cannot be pickled to send it to the "
                f"ranks: {part_exc}. Create it inside {fn_name} instead, or pass what it is made from."
            )
    return TypeError(f"distribute({fn_name}): the call cannot be pickled to send it to the ranks: {exc}")
