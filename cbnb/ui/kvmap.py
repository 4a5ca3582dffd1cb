"""`KVPageMapPanel`: every KV block as a cell on a canvas, coloured by state and attention type.

The map travels as one byte per block (`state.encode_kv`: state code + clamped refcount), so 100,000 blocks are
100 kB per update, and only when a cell changed. Owners and fill counts are not sent with it: the front-end asks
for one block's details when the pointer rests on it (a custom message), and the panel answers from the snapshot
it last sent, so the answer matches what is on screen.

Snapshots are only taken while at least one view of the map is on screen (the front-end reports its visibility
with an IntersectionObserver), or always with ``always_snapshot=True`` (used by the headless benchmark).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import traitlets

from . import _assets
from .base import Panel
from .poller import Frame
from .state import encode_kv, kv_block_details

__all__ = ["KVPageMapPanel"]


class KVPageMapPanel(Panel):
    """The KV page map.

    Args:
        engine: the engine.
        always_snapshot: snapshot on every tick even when no view is visible.
        poller, autostart: see `Panel`.

    Synced state:
        groups: per layer group {index, attention_type, page_size, num_layers, num_blocks, offset, padding_blocks,
            counts, tokens_filled}.
        cells: bytes, one per block of all groups (group g's blocks at [offset, offset + num_blocks)).
        request_count: requests owning blocks in the snapshot.
    """

    _esm = _assets.esm("kvmap.js")
    groups = traitlets.List().tag(sync=True)
    cells = traitlets.Bytes(b"").tag(sync=True)
    request_count = traitlets.Int(0).tag(sync=True)

    def __init__(self, engine: Any, *, always_snapshot: bool = False, **kwargs: Any) -> None:
        self.always_snapshot = always_snapshot
        self._views: dict[str, bool] = {}
        self._views_lock = threading.Lock()
        self._snapshot = None  # the snapshot behind the current `cells`
        super().__init__(engine, **kwargs)

    @property
    def visible(self) -> bool:
        """True when a view reported itself on screen (or `always_snapshot`)."""
        with self._views_lock:
            return self.always_snapshot or any(self._views.values())

    def _needs(self) -> set[str]:
        return {"snapshot"} if self.visible or self._snapshot is None else set()

    def _values(self, frame: Frame) -> dict[str, Any]:
        if frame.snapshot is None:
            return {}
        meta, cells = encode_kv(frame.snapshot)
        self._snapshot = frame.snapshot
        return {"groups": meta, "cells": cells, "request_count": len(frame.snapshot.request_ids)}

    def refresh(self) -> None:
        """Take a snapshot now and update the map (kernel thread; no poller needed)."""
        self._update(Frame(wall=time.time(), snapshot=self.engine.snapshot()))

    def details(self, group: int, block: int) -> dict[str, Any]:
        """Hover details of one block from the snapshot on screen (see `state.kv_block_details`).

        Raises:
            ValueError: bad indices, or no snapshot yet.
        """
        if self._snapshot is None:
            raise ValueError("no page map yet")
        return kv_block_details(self._snapshot, int(group), int(block))

    # ------------------------------------------------------------------------------------------ front-end
    def _on_visible(self, msg: dict) -> None:
        view = str(msg.get("view", ""))
        on = bool(msg.get("on"))
        with self._views_lock:
            if on:
                self._views[view] = True
            else:
                self._views.pop(view, None)
        if on:
            self.poller.poke()

    def _on_hover(self, msg: dict) -> None:
        reply: dict[str, Any] = {"kind": "hover", "seq": msg.get("seq")}
        try:
            reply.update(self.details(msg.get("group", -1), msg.get("block", -1)))
        except (ValueError, TypeError) as e:
            reply["error"] = str(e)
        self.send(reply)
