"""Settings a script makes at its top level, carried from the caller into the ranks a plain launch starts.

Under torchrun or srun every rank runs the script's top-level code; under a plain launch it runs once, in the
caller, and ranks are forked from a server that never ran it. So what people set there is captured at the
distribute() call and applied in each rank before fn runs, making a rank start as a torchrun worker would:

- logging: the root logger's level and handlers (formatter, level and filters included), ``logging.disable``,
  and every other logger configured differently from what the rank's own imports made (level, propagation,
  handlers); a handler travels by value, with its lock made anew, stdout/stderr bound to the rank's, and a file
  handler reopened for appending (the caller already created or truncated the file); a Jupyter kernel's own
  application logger stays the kernel's; the handlers of a logger other than the root one, made of a library's
  classes (mlflow's import sets up its own and SQLAlchemy's loggers with its formatter), stay the rank's own where
  the rank has imported neither that library nor the logger's package: copying them would import the library
  (~1 s a rank) for loggers nothing in the rank uses before that import, which sets them up anew;
- warnings filters (a library's warning class travels by name: _travelling_filter);
- torch: default dtype, deterministic algorithms, float32 matmul precision, anomaly detection, cuDNN flags;
- global RNG states: python ``random``, numpy's legacy global RNG, torch's CPU generator, and CUDA's (its
  states when the caller initialised CUDA, else the seed ``torch.manual_seed`` gave it, which CUDA applies lazily);
- the script's definitions: the functions and classes of ``__main__`` that travelled with fn become attributes of
  the rank's ``__main__``, so pickling them by reference works there (a ``multiprocessing.Pool`` mapping a
  function of the script), and the rank's ``__main__`` names the script's file, so a spawn or forkserver child of
  the rank imports the script as torchrun's grandchildren do.
"""

from __future__ import annotations

import importlib.machinery
import io
import logging
import random
import sys
import threading
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, cast

import cloudpickle
import torch

from qaccel.errors import warn_once

_RLOCK = type(threading.RLock())
_LOCK = type(threading.Lock())
# handler -> (its signature, its pickled copy): torch alone puts ~40 handlers on its loggers, and re-pickling them
# at every launch would cost ~2 ms; a handler whose signature is unchanged is sent as pickled last time
_copies: weakref.WeakKeyDictionary[logging.Handler, tuple[tuple, bytes]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LoggerSetup:
    """One logger's configuration; ``handlers`` are pickled copies (None where one could not be copied)."""

    name: str  # "" for the root logger
    signature: tuple
    level: int
    propagate: bool
    disabled: bool
    handlers: tuple[bytes, ...] | None
    needs: frozenset[str] = frozenset()  # the packages whose classes the handlers are (not the standard library's)


@dataclass(frozen=True)
class Inherited:
    """What a rank takes over from the caller's process at the distribute() call."""

    loggers: tuple[LoggerSetup, ...]
    logging_disable: int
    warning_filters: list
    default_dtype: torch.dtype
    deterministic: tuple[bool, bool]
    matmul_precision: str
    anomaly: tuple[bool, bool]
    cudnn: tuple[bool, bool]
    rng: dict[str, Any]
    main_file: str | None
    main_module: str | None


def capture() -> Inherited:
    """The caller's settings, now."""
    uncopied: list[str] = []
    loggers = tuple(_logger_setup(name, logger, uncopied) for name, logger in _configured_loggers())
    if uncopied:
        _warn_uncopied(uncopied)
    return Inherited(
        loggers=loggers,
        logging_disable=logging.root.manager.disable,
        warning_filters=[_travelling_filter(entry) for entry in warnings.filters],
        default_dtype=torch.get_default_dtype(),
        deterministic=(
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        matmul_precision=torch.get_float32_matmul_precision(),
        anomaly=(torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        cudnn=(torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        rng=_rng_states(),
        main_file=getattr(sys.modules["__main__"], "__file__", None),
        main_module=getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", None),
    )


def apply(inherited: Inherited) -> None:
    """Make this rank's settings the caller's; only what differs is touched, so the rank's own imports keep theirs."""
    for setup in inherited.loggers:
        _apply_logger(setup)
    logging.disable(inherited.logging_disable)
    cast(list, warnings.filters)[:] = [_rank_filter(entry) for entry in inherited.warning_filters]  # typeshed: Sequence
    _filters_changed()
    if torch.get_default_dtype() != inherited.default_dtype:
        torch.set_default_dtype(inherited.default_dtype)
    mode, warn_only = inherited.deterministic
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
        mode,
        warn_only,
    ):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    if torch.get_float32_matmul_precision() != inherited.matmul_precision:
        torch.set_float32_matmul_precision(inherited.matmul_precision)
    if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != inherited.anomaly:
        torch.autograd.set_detect_anomaly(*inherited.anomaly)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = inherited.cudnn
    _set_rng_states(inherited.rng)


def adopt_script(inherited: Inherited | None, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Give this rank's ``__main__`` the script's definitions that travelled with the call, and the script's name.

    cloudpickle rebuilds all ``__main__`` functions of one pickle around one shared globals dict, which holds
    every name of the script they use; found through fn, or through an argument of a class of the script.
    """
    main = sys.modules["__main__"]
    script_globals = _script_globals([fn, *args, *kwargs.values()])
    if script_globals is not None:
        for name, value in script_globals.items():
            if not name.startswith("__"):
                setattr(main, name, value)
    if inherited is not None and inherited.main_file is not None:
        main.__file__ = inherited.main_file
    if inherited is not None and inherited.main_module is not None:
        main.__spec__ = importlib.machinery.ModuleSpec(inherited.main_module, None)


def _script_globals(objects: list[Any]) -> dict[str, Any] | None:
    candidates = list(objects)
    candidates += [value for obj in objects for value in getattr(obj, "__dict__", {}).values()]  # loader.dataset
    for obj in candidates:
        function = getattr(obj, "__func__", obj)
        if isinstance(function, types.FunctionType) and function.__module__ == "__main__":
            return function.__globals__
        cls = obj if isinstance(obj, type) else type(obj)
        if cls.__module__ == "__main__":
            for attr in vars(cls).values():
                if isinstance(attr, types.FunctionType):
                    return attr.__globals__
    return None


# ---- warnings filters ----


def _travelling_filter(entry: tuple[Any, ...]) -> tuple:
    """A warnings filter as it travels: a category of a library module goes by name (_NamedCategory), so that
    the rank does not import that module to unpickle it (a Jupyter kernel's filter on IPython's completer warning
    made every rank import all of IPython, 0.15 s a launch)."""
    action, message, category, module, lineno = entry
    if category.__module__ in ("builtins", "__main__"):
        return entry
    return action, message, (category.__module__, category.__qualname__), module, lineno


def _rank_filter(entry: tuple[Any, ...]) -> tuple:
    action, message, category, module, lineno = entry
    if isinstance(category, tuple):
        category = _category(*category)
    return action, message, category, module, lineno


def _category(module: str, qualname: str) -> type:
    """The warning class ``module.qualname`` if the rank has imported its module, else a stand-in that matches it
    (and its subclasses) by name, as the class itself would, once something the rank runs imports it."""
    if module in sys.modules:
        found: Any = sys.modules[module]
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if isinstance(found, type):
            return found
    return _NamedCategory(
        qualname.rsplit(".", 1)[-1],
        (Warning,),
        {"names": (module, qualname), "__module__": module, "__qualname__": qualname},
    )


class _NamedCategory(type):
    """The metaclass of a warning category named but not imported: ``issubclass(category, stand_in)``, which the
    warnings machinery asks of each filter, is true of the named class and its subclasses."""

    names: tuple[str, str]

    def __subclasscheck__(cls, subclass: type) -> bool:
        return any(
            (getattr(base, "__module__", None), getattr(base, "__qualname__", None)) == cls.names
            for base in getattr(subclass, "__mro__", ())
        )


# ---- logging ----


def _configured_loggers() -> list[tuple[str, logging.Logger]]:
    """The root logger, and every logger whose configuration is not the default one."""
    found: list[tuple[str, logging.Logger]] = [("", logging.root)]
    kernel_app = _kernel_app_logger()
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (
            isinstance(logger, logging.Logger)
            and logger is not kernel_app
            and (logger.level != logging.NOTSET or logger.handlers or not logger.propagate or logger.disabled)
        ):
            found.append((name, logger))
    return found


def _kernel_app_logger() -> logging.Logger | None:
    """A Jupyter kernel's own application logger, which writes the kernel's messages to the terminal that started
    it: it belongs to the kernel, as pytest's capture handlers belong to the test process, not to the ranks."""
    kernelapp = sys.modules.get("ipykernel.kernelapp")
    app = getattr(kernelapp, "IPKernelApp", None)
    return app.instance().log if app is not None and app.initialized() else None


def _signature(logger: logging.Logger) -> tuple:
    """What tells two loggers' configurations apart, comparable between the caller and a rank."""
    return (logger.level, logger.propagate, logger.disabled, tuple(_handler_signature(h) for h in logger.handlers))


def _handler_signature(handler: logging.Handler) -> tuple:
    stream = getattr(handler, "stream", None)
    target = getattr(handler, "baseFilename", None) or _std_name(stream) or type(stream).__name__
    formatter = handler.formatter
    form = None if formatter is None else (type(formatter).__qualname__, formatter._fmt, formatter.datefmt)
    return (type(handler).__module__, type(handler).__qualname__, target, handler.level, form, len(handler.filters))


def _logger_setup(name: str, logger: logging.Logger, uncopied: list[str]) -> LoggerSetup:
    """``logger``'s configuration, its handlers pickled; a handler that cannot be is described in ``uncopied``."""
    copies: list[bytes] | None = []
    for handler in logger.handlers:
        if type(handler).__module__.startswith("_pytest."):
            continue  # pytest's capture handlers belong to the test process; a rank's output is not captured
        try:
            copies.append(_copy_of(handler))
        except Exception as exc:  # noqa: BLE001 - any handler that cannot travel is reported, not fatal
            uncopied.append(f"the {type(handler).__name__} of logger {name or 'root'!r} ({exc})")
            copies = None
            break
    return LoggerSetup(
        name,
        _signature(logger),
        logger.level,
        logger.propagate,
        logger.disabled,
        None if copies is None else tuple(copies),
        _needs(logger),
    )


def _needs(logger: logging.Logger) -> frozenset[str]:
    """The packages, other than the standard library and the script, whose classes ``logger``'s handlers are
    made of (handler, formatter, filters): unpickling the handlers imports them."""
    parts = [*logger.handlers, *(h.formatter for h in logger.handlers)]
    parts += [f for h in logger.handlers for f in h.filters]
    packages = {type(part).__module__.partition(".")[0] for part in parts if part is not None}
    return frozenset(packages - set(sys.stdlib_module_names) - {"builtins", "__main__"})


def _copy_of(handler: logging.Handler) -> bytes:
    signature = _handler_signature(handler)
    cached = _copies.get(handler)
    if cached is None or cached[0] != signature:
        cached = _copies[handler] = (signature, _HandlerPickler.dumps(handler))
    return cached[1]


def _warn_uncopied(uncopied: list[str]) -> None:
    """One warning for every handler that cannot travel (a library's loggers can hold dozens, e.g. bound to a
    stream that was sys.stderr when the library was imported), once per such set."""
    shown = "; ".join(uncopied[:5]) + (f"; and {len(uncopied) - 5} more" if len(uncopied) > 5 else "")
    warn_once(
        ("uncopied handlers", *uncopied),
        f"qaccel: {shown}: cannot be copied into the ranks, which keep their own handlers for "
        f"{'that logger' if len(uncopied) == 1 else 'those loggers'}. Configure a handler inside the function "
        "you distribute if ranks should use it.",
        stacklevel=4,
    )


def _apply_logger(setup: LoggerSetup) -> None:
    logger = logging.getLogger(setup.name or None)
    if _signature(logger) == setup.signature:
        return  # the rank's imports configured it as the caller has it (library loggers, mostly)
    logger.setLevel(setup.level)
    logger.propagate = setup.propagate
    logger.disabled = setup.disabled
    if setup.handlers is not None and _in_use(setup):
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        for data in setup.handlers:
            logger.addHandler(cloudpickle.loads(data))


def _in_use(setup: LoggerSetup) -> bool:
    """Whether the rank may use this logger before it imports anything more: the root logger, a logger of a package
    the rank has imported, or one whose handlers need no package the rank lacks."""
    return not setup.name or setup.name.partition(".")[0] in sys.modules or setup.needs <= sys.modules.keys()


def _std_name(stream: Any) -> str | None:
    """ "stdout" or "stderr" when ``stream`` is that standard stream (compared by identity), else None."""
    for name in ("stdout", "stderr"):
        if stream is not None and (stream is getattr(sys, name) or stream is getattr(sys, f"__{name}__")):
            return name
    return None


def _std_stream(name: str) -> Any:
    return getattr(sys, name)


def _file_handler(cls: type[logging.Handler], state: dict[str, Any]) -> logging.Handler:
    handler = cls.__new__(cls)
    handler.__dict__.update(state)
    return handler


class _HandlerPickler(cloudpickle.Pickler):
    """cloudpickle, plus what a logging handler holds: locks (made anew), the standard streams (the rank's own)
    and a file handler's open file (reopened on first use, for appending)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (_RLOCK, _LOCK)):
            return type(obj), ()
        name = _std_name(obj)
        if name is not None:
            return _std_stream, (name,)
        if isinstance(obj, logging.FileHandler):
            state = {**obj.__dict__, "stream": None, "mode": "a" if "w" in obj.mode else obj.mode}
            return _file_handler, (type(obj), state)
        return super().reducer_override(obj)

    @classmethod
    def dumps(cls, obj: Any) -> bytes:
        buffer = io.BytesIO()
        cls(buffer).dump(obj)
        return buffer.getvalue()


def _filters_changed() -> None:
    """Tell the warnings module its filter list changed, so cached 'already warned' decisions are dropped."""
    changed = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
    if changed is not None:
        changed()


# ---- random states ----


def _rng_states() -> dict[str, Any]:
    numpy = sys.modules.get("numpy")
    return {
        "python": random.getstate(),
        "numpy": numpy.random.get_state() if numpy is not None else None,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "seed": torch.initial_seed(),
    }


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    if states["numpy"] is not None:
        import numpy

        numpy.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])  # queued until this rank initialises CUDA
    else:
        torch.cuda.manual_seed_all(states["seed"])  # what torch.manual_seed(seed) queued in the caller
