"""Our errors through Ray's wrappers: a RollflowError raised inside a Ray task or a Ray Data map function reaches
the caller as itself, with our message (not Ray's retry advice), and Ray Data does not also log it as an internal
error with a trace. No Ray import at module top."""

from __future__ import annotations

import logging
import re
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from schemas.errors import RollflowError


def _find_rollflow_error(err: BaseException | None) -> RollflowError | None:
    """The RollflowError inside Ray's wrappers: a task's error arrives as ``RayTaskError(<class>)`` whose ``cause``
    is the original exception (``__cause__`` chains do not survive pickling)."""
    seen = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if id(e) in seen or e is None:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(e, RollflowError) and not isinstance(cause, RollflowError):
            return e
        stack.extend([e.__cause__, e.__context__])
        if isinstance(cause, BaseException):
            stack.append(cause)
    return None


# Ray Data appends its retry advice to a failed task's exception message; it does not apply to user errors
_RAY_RETRY_NOTE = re.compile(r"\nFailed to .+? after \d+/\d+ attempts \(total backoff .*", re.S)


def unwrap_error(err: BaseException) -> BaseException:
    """The RollflowError inside Ray's wrappers of ``err``, as its own class and without Ray's retry advice, so users
    see our message; ``err`` itself when it carries none."""
    found = _find_rollflow_error(err)
    if found is None:
        return err
    args = list(found.args)
    if args and isinstance(args[0], str):
        args[0] = _RAY_RETRY_NOTE.sub("", args[0])
    return type(found)(*args)


@contextmanager
def unwrapped_errors(find: Callable[[BaseException], BaseException] = unwrap_error) -> Iterator[None]:
    """Re-raise an error of the block as the user error ``find`` sees in it (default :func:`unwrap_error`)."""
    try:
        yield
    except BaseException as err:
        real = find(err)
        if real is not err:
            raise real from None
        raise


class _HideReportedUserErrors(logging.Filter):
    """Ray Data logs a failed task's error as an internal Ray error with a full trace before re-raising it; for a
    RollflowError (bad input or config) the runner's caller prints one clear message instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        return _find_rollflow_error(exc) is None


def surface_user_errors() -> None:
    """Make Ray Data raise a map function's own exception (not a ``UserCodeException`` that drops it), so that
    :func:`unwrap_error` finds our errors; silence Ray's report of those errors. Idempotent."""
    import ray.data

    ray.data.DataContext.get_current().raise_original_map_exception = True
    for name in ("ray.data.exceptions", "ray.data._internal.execution.streaming_executor_state"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HideReportedUserErrors) for f in logger.filters):
            logger.addFilter(_HideReportedUserErrors())


def unplaced_hint(asks: dict[str, float]) -> str:
    """Why actors that each ask ``asks`` are not placed: what the cluster has free now of those resources, and where
    to look (the training group's and the engine pool's placement limits). Needs a Ray connection."""
    import ray

    free = {k: round(v, 2) for k, v in sorted(ray.available_resources().items()) if k in ("CPU", "GPU") or k in asks}
    return (f"each asks {asks} and the cluster has {free} free now; another stage or process holds the rest (ray "
            "status), or the plan does not fit: rollflow plan --config ... shows what each stage reserves")
