"""How a python reward function is called (rewards/forms.py): a plain call, or an `async def`
one on the process's one reward event loop (TRL's `async_loop`: a daemon thread), several
calls awaited together (asyncio.gather). Any exception, and `exit()`, becomes a
`RewardError` naming the function."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Awaitable, Callable

from .custom import RewardError

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def reward_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for async reward functions (TRL's `async_loop`), running on a
    daemon thread: one loop for every call, so a client a function keeps between calls works."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="reward-async", daemon=True).start()
        return _loop


def _run(coroutine: Awaitable) -> Any:
    async def wrap() -> Any:
        return await coroutine
    return asyncio.run_coroutine_threadsafe(wrap(), reward_loop()).result()


def _fail(where: str, err: BaseException) -> RewardError:
    return RewardError(f"{where} raised {type(err).__name__}: {err}")


def call(fn: Callable, where: str, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, awaited on the reward loop when it gives an awaitable."""
    try:
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = _run(value)
    except (Exception, SystemExit) as err:  # exit() in a scoring thread would hang the rollout loop
        raise _fail(where, err) from err
    return value


def call_each(fn: Callable, where: str, calls: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
    """`fn(*args, **kwargs)` for each of `calls`; an async function's calls awaited together
    (asyncio.gather), not one after the other."""
    if not is_async(fn):
        return [call(fn, where, *args, **kw) for args, kw in calls]

    async def each(args: tuple, kw: dict[str, Any]) -> Any:
        try:
            return await fn(*args, **kw)
        except (Exception, SystemExit) as err:
            raise _fail(where, err) from err

    async def together() -> list[Any]:
        return list(await asyncio.gather(*(each(args, kw) for args, kw in calls)))
    return _run(together())


def is_async(fn: Callable) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
