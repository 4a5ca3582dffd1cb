"""Clicks while a cell runs: the panels' widget messages are handled on a kernel subshell of cbnb's own.

A Jupyter kernel handles the messages a browser sends to widgets (a click, a slider, "I am on screen") on its
main shell thread, between cells: while a cell blocks (`engine.generate`, a sweep, the user's own
`time.sleep` loop) every click waits for the cell to end. ipykernel 7 runs *subshells* (JEP 91: extra shell
threads, each with its own event loop) and, from 7.4 on, routes each comm message to the subshell that its comm
names (`Comm._reply_subshell_for`). cbnb creates one subshell per kernel and points every panel's comm at it, so
Pause, Step, Cancel, Apply and selections are handled on that thread whatever the main thread is doing.

The subshell is kept "busy" by a task that holds its execution lock for the kernel's lifetime: ipykernel then
dispatches comm messages there as concurrent work, which publishes no busy/idle status of its own, and no code cell
can ever run there. cbnb publishes the statuses itself, after each message: "idle" for that message (the widget
front-end sends its next state update only once the previous one is acknowledged so), then, when a cell is running
on the main shell, "busy" for that cell again, so the notebook's kernel indicator stays true. (Which cell is
running comes from IPython's pre/post_run_cell events, under a lock, so the "busy" can never follow the cell's own
final "idle".)

Outside a kernel, or with an ipykernel that cannot route comms (< 7.4), nothing changes: clicks then wait for the
running cell, and `route_status()` says so (the Controls panel shows it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

__all__ = ["in_kernel", "route_comm", "route_status", "ui_subshell"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, Any] = {"kernel": None, "subshell": None, "status": None}
_cell_lock = threading.Lock()
_cell: dict[str, Any] = {"parent": None}  # the execute_request now running on the main shell, or None


def _kernel() -> Any:
    try:
        from ipykernel.kernelbase import Kernel
    except ImportError:
        return None
    return Kernel.instance() if Kernel.initialized() else None


def in_kernel() -> bool:
    """True when this code runs inside a Jupyter (ipykernel) kernel."""
    return _kernel() is not None


def _unsupported(kernel: Any) -> str | None:
    """Why comm messages cannot be routed off the main shell in this kernel (None: they can)."""
    try:
        import ipykernel
        from ipykernel.comm.comm import BaseComm
    except ImportError:
        return "no ipykernel"
    if getattr(kernel, "shell_channel_thread", None) is None or not hasattr(BaseComm, "_reply_subshell_for"):
        return f"ipykernel {ipykernel.__version__} handles widget messages only between cells (7.4 or newer routes them)"
    return None


def _create(kernel: Any, timeout: float) -> str:
    """Create a subshell on the shell-channel thread (where ipykernel creates them) and hold its lock."""
    sct = kernel.shell_channel_thread
    manager = sct.manager
    done = threading.Event()
    box: dict[str, Any] = {}

    def create() -> None:
        try:
            box["id"] = manager._create_subshell()
        except BaseException as e:  # reported to the caller below
            box["error"] = e
        finally:
            done.set()

    sct.io_loop.add_callback(create)
    if not done.wait(timeout):
        raise TimeoutError(f"the kernel did not create a subshell within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    sid = box["id"]
    lock = manager.get_subshell_asyncio_lock(sid)
    held = threading.Event()

    async def hold() -> None:
        # Held until the kernel stops: comm messages for this subshell are then dispatched as concurrent tasks
        # (no busy/idle status published for them), and no execute_request could ever run here.
        async with lock:
            held.set()
            await asyncio.Event().wait()

    manager._get_subshell(sid).io_loop.add_callback(hold)
    if not held.wait(timeout):
        raise TimeoutError(f"the kernel's subshell did not start within {timeout:g} s")
    return sid


def _watch_cells(kernel: Any) -> None:
    """Track the running cell's request (main thread, IPython events), for `_acknowledge`."""
    shell = getattr(kernel, "shell", None)
    if shell is None:
        return

    def started(*_a: Any) -> None:
        with _cell_lock:
            _cell["parent"] = kernel.get_parent("shell")

    def ended(*_a: Any) -> None:
        with _cell_lock:
            _cell["parent"] = None

    shell.events.register("pre_run_cell", started)
    shell.events.register("post_run_cell", ended)


def _acknowledge(kernel: Any, msg: dict) -> None:
    """Publish "idle" for a handled comm message, then "busy" again for the cell still running, if any."""
    with _cell_lock:
        kernel._publish_status("idle", "shell", parent=msg)
        if _cell["parent"] is not None:
            kernel._publish_status("busy", "shell", parent=_cell["parent"])


def ui_subshell(timeout: float = 5.0) -> str | None:
    """The id of cbnb's UI subshell in this kernel, created on first use; None when none can be had.

    Returns:
        The subshell id (a uuid string), or None outside a kernel, with an ipykernel older than 7.4, or when the
        kernel refused (the reason is in `route_status()`).
    """
    kernel = _kernel()
    if kernel is None:
        return None
    with _lock:
        if _state["kernel"] is kernel:
            return _state["subshell"]
        _state.update(kernel=kernel, subshell=None, status=None)
        why = _unsupported(kernel)
        if why is not None:
            _state["status"] = why
            return None
        if threading.current_thread() is kernel.shell_channel_thread:
            _state["status"] = "a widget was created on the kernel's shell-channel thread"
            return None
        try:
            _state["subshell"] = _create(kernel, timeout)
            _watch_cells(kernel)
        except Exception as e:  # clicks then wait for the cell, as without cbnb's routing
            log.warning("cbnb: could not create a UI subshell (%s: %s); clicks will wait for running cells",
                        type(e).__name__, e)
            _state["status"] = f"the kernel refused a subshell ({type(e).__name__}: {e})"
        return _state["subshell"]


def route_comm(widget: Any) -> bool:
    """Have the kernel hand `widget`'s incoming messages to cbnb's UI subshell.

    Returns:
        True when routed; False outside a kernel or where the kernel cannot route (see `route_status`).
    """
    comm = getattr(widget, "comm", None)
    if comm is None:
        return False
    sid = ui_subshell()
    if sid is None:
        return False
    # An instance attribute wins over ipykernel's method, which otherwise answers "the subshell that last sent".
    comm._reply_subshell_for = lambda _data, _default, _sid=sid: _sid
    kernel, handle = _state["kernel"], comm.handle_msg

    def handle_msg(msg: dict) -> None:
        try:
            handle(msg)
        finally:
            _acknowledge(kernel, msg)

    comm.handle_msg = handle_msg
    return True


def route_status() -> str:
    """One line for the user: whether clicks act while a cell runs in this kernel, and why not."""
    if not in_kernel():
        return "not in a Jupyter kernel"
    sid = ui_subshell()
    if sid is not None:
        return "clicks act while a cell runs (widget messages go to cbnb's kernel subshell)"
    return f"clicks wait for the running cell: {_state['status']}"
