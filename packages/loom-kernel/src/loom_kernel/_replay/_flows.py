"""Flows: the decorator, the code hash a run pins, and step retry policies."""

from __future__ import annotations

import hashlib
import inspect
import re
import textwrap
import types
from collections.abc import Callable
from typing import Any, Final, overload

import attrs

from loom_kernel._core import InvalidArgumentError, finite_number

__all__ = ["NO_RETRY", "Flow", "RetryPolicy", "check_flow_name", "code_hash", "flow"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,99}")


@attrs.frozen
class RetryPolicy:
    """How often a step runs before its failure is final, and how long it waits between.

    The default, `RetryPolicy()`, is the engine's unless it is given another: a step
    runs up to 3 times, 1 s and then 2 s apart. `ctx.step(..., retry=None)` means the
    engine's policy; `retry=NO_RETRY` runs the step once.

    Attributes:
        attempts: total runs, at least 1 (1 means no retry).
        backoff: seconds before the first retry.
        factor: each later wait is the previous one times this.
        max_backoff: the longest wait.
        retry_on: exception types worth retrying; others fail the step at once.
    """

    attempts: int = 3
    backoff: float = 1.0
    factor: float = 2.0
    max_backoff: float = 60.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __attrs_post_init__(self) -> None:
        attempts = self.attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise InvalidArgumentError(f"attempts must be an int >= 1, not {attempts!r}")
        for name, least in (("backoff", 0.0), ("factor", 1.0), ("max_backoff", 0.0)):
            value = getattr(self, name)
            if not finite_number(value) or value < least:
                raise InvalidArgumentError(
                    f"{name} must be a finite number >= {least:g}, not {value!r}"
                )
        retry_on = self.retry_on
        if not isinstance(retry_on, tuple) or not all(
            isinstance(kind, type) and issubclass(kind, BaseException) for kind in retry_on
        ):
            raise InvalidArgumentError(
                f"retry_on must be a tuple of exception types, not {retry_on!r}"
            )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based).

        The cap applies before the growth can overflow: any attempt number, however
        large, gives at most `max_backoff`.
        """
        if self.backoff == 0 or self.max_backoff == 0:
            return 0.0
        try:
            growth = float(self.factor) ** max(0, attempt - 1)
        except OverflowError:
            return float(self.max_backoff)
        return float(min(self.max_backoff, float(self.backoff) * growth))  # inf when huge


#: One attempt: a step that raises fails at once (`ctx.step(..., retry=NO_RETRY)`).
NO_RETRY: Final = RetryPolicy(attempts=1)


def code_hash(fn: Callable[..., Any], version: str | None = None) -> str:
    """The hash an execution pins: of `version` when given, else of the function's source.

    The source is dedented so moving a flow into a class or out of one keeps its hash;
    without source (a flow built at run time) the code object's bytecode and constants
    stand in.
    """
    if version is not None:
        return "version:" + version
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        text = _code_text(fn.__code__)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _code_text(code: types.CodeType) -> str:
    """A code object as text that is the same in every process: its bytecode, names
    and constants, nested code objects (a lambda, an inner function) spelled the same
    way (their repr holds a memory address)."""
    consts = tuple(
        _code_text(const) if isinstance(const, types.CodeType) else repr(const)
        for const in code.co_consts
    )
    return repr((code.co_code, consts, code.co_names))


@attrs.frozen
class Flow:
    """A registered flow: a function `fn(ctx, input)`, sync or async.

    Attributes:
        name: the name runs are started by and journaled under.
        fn: the function.
        version: the explicit version, if given (`@flow(version="2")`).
        code_hash: what executions pin: see `code_hash`.
        is_async: True for `async def` flows.
    """

    name: str
    fn: Callable[..., Any]
    version: str | None = None
    code_hash: str = ""
    is_async: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def check_flow_name(name: object) -> str:
    """A flow's name, checked (what runs are started by and journaled under).

    Raises:
        InvalidArgumentError: it is not a valid flow name.
    """
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise InvalidArgumentError(f"invalid flow name {name!r}")
    return name


def _make(fn: Callable[..., Any], name: str | None, version: str | None) -> Flow:
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise InvalidArgumentError(f"@flow needs a Python function, not {fn!r}")
    flow_name = check_flow_name(name or fn.__name__)
    if version is not None and (not isinstance(version, str) or not version):
        raise InvalidArgumentError(f"a flow version is a non-empty str, not {version!r}")
    return Flow(
        name=flow_name,
        fn=fn,
        version=version,
        code_hash=code_hash(fn, version),
        is_async=inspect.iscoroutinefunction(fn),
    )


@overload
def flow(
    fn: Callable[..., Any], /, *, name: str | None = None, version: str | None = None
) -> Flow: ...


@overload
def flow(
    *, name: str | None = None, version: str | None = None
) -> Callable[[Callable[..., Any]], Flow]: ...


def flow(
    fn: Callable[..., Any] | None = None, /, *, name: str | None = None, version: str | None = None
) -> Flow | Callable[[Callable[..., Any]], Flow]:
    """Declare a flow: `@flow` or `@flow(name="approval", version="2")`.

    Args:
        fn: the flow function `fn(ctx, input)`, sync or `async def`.
        name: the registered name (default: the function's name).
        version: pin runs to this version instead of the hash of the source.
    """
    if fn is not None:
        return _make(fn, name, version)
    return lambda inner: _make(inner, name, version)
