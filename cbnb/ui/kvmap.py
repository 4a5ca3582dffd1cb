"""`KVPageMapPanel`: every KV block as a cell on a canvas, coloured by state and attention type.

The map travels as one byte per block (`state.encode_kv`: state code + clamped refcount), so 100,000 blocks are
100 kB per update, and only when a cell changed. Owners and fill counts are not sent with it: the front-end asks
for one block's details when the pointer rests on it (a custom message), and the panel answers from the snapshot
it last sent, so the answer matches what is on screen.

The map is pushed on every poll, whether or not a view is on screen (a view's visibility report is a message that
could wait behind a busy cell; data never waits on it): an off-screen view only skips drawing. Set
``always_snapshot=False`` to take snapshots only while a view reports itself on screen (the IntersectionObserver's
report), e.g. for a dashboard over a cache of millions of blocks.

Highlight: the request under the pointer (a block of the map, or a request in another panel) or the selected one
has all of its blocks highlighted (`highlight`: `state.request_blocks`, with the other owners of its shared blocks);
a click on a block selects its owner (the "Why?" panel tells its story).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import traitlets

from . import _assets
from .base import Panel
from .poller import Frame
from .state import encode_kv, kv_block_details, request_blocks

__all__ = ["KVPageMapPanel"]


class KVPageMapPanel(Panel):
    """The KV page map.

    Args:
        engine: the engine.
        always_snapshot: True (the default): snapshot on every poll; False: only while a view is on screen (and
            once at the start).
        poller, autostart: see `Panel`.

    Synced state:
        groups: per layer group {index, attention_type, page_size, num_layers, num_blocks, offset, padding_blocks,
            counts, tokens_filled}.
        cells: bytes, one per block of all groups (group g's blocks at [offset, offset + num_blocks)).
        request_count: requests owning blocks in the snapshot.
        highlight: the highlighted request's blocks (`state.request_blocks`) plus "mode" ("hover" or "select"), or
            {} when none.
    """

    _esm = _assets.esm("kvmap.js")
    groups = traitlets.List().tag(sync=True)
    cells = traitlets.Bytes(b"").tag(sync=True)
    request_count = traitlets.Int(0).tag(sync=True)
    highlight = traitlets.Dict().tag(sync=True)

    def __init__(self, engine: Any, *, always_snapshot: bool = True, **kwargs: Any) -> None:
        self.always_snapshot = always_snapshot
        self._views: dict[str, bool] = {}
        self._views_lock = threading.Lock()
        self._snapshot = None  # the snapshot behind the current `cells`
        self._hovered: str | None = None
        self._selected: str | None = None
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
        out = {"groups": meta, "cells": cells, "request_count": len(frame.snapshot.request_ids)}
        hl = self._highlight()
        if hl != self.highlight:
            out["highlight"] = hl
        return out

    # ------------------------------------------------------------------------------------------ highlight
    def _highlight(self) -> dict[str, Any]:
        rid, mode = (self._hovered, "hover") if self._hovered else (self._selected, "select")
        if not rid or self._snapshot is None:
            return {}
        return {**request_blocks(self._snapshot, rid), "mode": mode}

    def highlight_request(self, request_id: str | None, mode: str = "select") -> None:
        """Highlight a request's blocks ("hover" wins over "select"; None clears that mode)."""
        with self._lock:
            if mode == "hover":
                self._hovered = request_id or None
            else:
                self._selected = request_id or None
            hl = self._highlight()
            if hl != self.highlight:
                self.highlight = hl

    def on_selection(self, what: str, request_id: str | None) -> None:
        """`Selection` listener: highlight the hovered or selected request's blocks."""
        self.highlight_request(request_id, "hover" if what == "hover" else "select")

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
        d = kv_block_details(self._snapshot, int(group), int(block))
        if d["state"] == "shared" and len(d["owners"]) >= 2:
            d["note"] = self._shared_note(d["owners"])
        return d

    def _shared_note(self, owners: list[str]) -> str:
        """Why a shared block's owners may all show 0 cached tokens on the board: "cached" counts the prompt
        tokens a request found in the cache when it was admitted; owners admitted together computed the page once
        and share it, so none of them found it there."""
        try:
            outs = {o.request_id: o for o in self.engine.requests_snapshot()}
        except Exception:
            return ""
        cached = [int(getattr(outs[r], "prefix_cached_tokens", 0) or 0) for r in owners if r in outs]
        if not cached or any(cached):
            return ""
        n = len(owners)
        return (f"none of its {n} owners found this page in the cache at admission (the board's cached column is 0 "
                f"for {'both' if n == 2 else 'all'}): they were admitted together, so it was computed once and is "
                "shared")

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
        owners = reply.get("owners") or []
        # The block's (first) owner: all of its blocks light up, here and for the other panels' selection.
        if self.selection is not None:
            self.hover_request(owners[0] if owners else None)
        else:
            self.highlight_request(owners[0] if owners else None, "hover")

    def _on_hover_request(self, msg: dict) -> None:  # the pointer left the map
        rid = msg.get("id")
        rid = rid if isinstance(rid, str) and rid else None
        if self.selection is not None:
            self.hover_request(rid)
        else:
            self.highlight_request(rid, "hover")

    def _on_click(self, msg: dict) -> None:
        """A click on a block selects its (first) owner."""
        try:
            owners = self.details(msg.get("group", -1), msg.get("block", -1)).get("owners") or []
        except (ValueError, TypeError):
            owners = []
        if not owners:
            self.show("That block has no owner: nothing to explain.", "info")
            return
        if self.selection is not None:
            self.select_request(owners[0])
        else:
            self.highlight_request(owners[0], "select")
