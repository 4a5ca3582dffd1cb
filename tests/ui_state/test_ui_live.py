"""Clicks while a cell runs (`cbnb.ui.live`): a real ipykernel (jupyter_client, no browser) is busy in a blocking
cell, and a panel's message still acts at once, with no busy/idle status published for it.

The client below plays the browser: it sends the same comm messages an ES module sends (`model.send(...)` is an
ipywidgets "custom" message) and reads the panel's synced state from the kernel's IOPub updates.
"""

from __future__ import annotations

import time

import pytest

from cbnb.ui.live import route_comm, route_status

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

SETUP = """
import torch; torch.set_num_threads(1)
import cbnb
from cbnb.engine.models import load_model
from cbnb.ui import ControlsPanel
from cbnb.ui.live import route_status
model, _ = load_model("tiny:llama", dtype=torch.float32, device="cpu")
engine = cbnb.Engine(model, config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64))
engine.start()
panel = ControlsPanel(engine)
print("ID", panel.model_id, panel.routed, route_status())
"""


class Kernel:
    def __init__(self) -> None:
        self.km, self.kc = jupyter_client.manager.start_new_kernel(kernel_name="python3", startup_timeout=120)
        self.seen: list[dict] = []

    def execute(self, code: str) -> str:
        return self.kc.execute(code)

    def messages(self, until, timeout: float):
        """IOPub messages (kept in `seen`) until `until(msg)` is true; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; last messages: {[m['msg_type'] for m in self.seen[-8:]]}"
            try:
                m = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: keep waiting until the deadline
                continue
            self.seen.append(m)
            if until(m):
                return m

    def run(self, code: str, timeout: float = 120.0) -> str:
        mid = self.execute(code)
        out: list[str] = []

        def done(m):
            if m["parent_header"].get("msg_id") != mid:
                return False
            if m["msg_type"] == "stream":
                out.append(m["content"]["text"])
            assert m["msg_type"] != "error", m["content"]
            return m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"

        self.messages(done, timeout)
        return "".join(out)

    def send_custom(self, comm_id: str, content: dict) -> str:
        return self.send_comm(comm_id, {"method": "custom", "content": content})

    def send_comm(self, comm_id: str, data: dict) -> str:
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    def statuses(self, parent_id: str) -> list[str]:
        return [m["content"]["execution_state"] for m in self.seen
                if m["msg_type"] == "status" and m["parent_header"].get("msg_id") == parent_id]

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    try:
        yield k
    finally:
        k.close()


def _state_update(comm_id: str, key: str, value):
    def match(m):
        c = m["content"]
        return (m["msg_type"] == "comm_msg" and c.get("comm_id") == comm_id
                and c.get("data", {}).get("method") == "update" and c["data"].get("state", {}).get(key) == value)
    return match


@pytest.mark.slow
def test_pause_and_resume_act_while_a_cell_blocks_in_generate(kernel):
    out = kernel.run(SETUP)
    comm_id, routed, *status = out.split("ID", 1)[1].split()
    assert routed == "True", out
    assert " ".join(status).startswith("clicks act while a cell runs"), out
    # A cell that blocks in cbnb's own call: 200 tokens on one thread take many seconds.
    mid = kernel.execute("outs = engine.generate([[5, 6, 7, 8]] * 4, max_new_tokens=200, ignore_eos=True)")
    kernel.messages(lambda m: m["parent_header"].get("msg_id") == mid and m["msg_type"] == "execute_input", 30)
    kernel.messages(_state_update(comm_id, "running", 4), 60)  # the engine is decoding: the cell is busy
    sent = time.monotonic()
    pause_id = kernel.send_custom(comm_id, {"kind": "pause"})
    kernel.messages(_state_update(comm_id, "paused", True), 30)
    paused_after = time.monotonic() - sent
    # A state update from the page (as a slider sends): acknowledged with an "idle" for it, which the widget
    # front-end waits for before it sends the next one; then "busy" again for the cell that still runs.
    update_id = kernel.send_comm(comm_id, {"method": "update", "state": {"font_scale": 1.5}, "buffer_paths": []})
    kernel.messages(lambda m: m["msg_type"] == "status" and m["parent_header"].get("msg_id") == update_id, 30)
    kernel.messages(lambda m: m["msg_type"] == "status" and m["parent_header"].get("msg_id") == mid
                    and m["content"]["execution_state"] == "busy", 30)
    kernel.send_custom(comm_id, {"kind": "resume"})
    kernel.messages(_state_update(comm_id, "paused", False), 30)

    def cell_done(m):
        return (m["parent_header"].get("msg_id") == mid and m["msg_type"] == "status"
                and m["content"]["execution_state"] == "idle")

    kernel.messages(cell_done, 120)
    # The click acted inside the running cell (well before it ended); the bound only catches a click that waited
    # for the cell (about 0.1-0.4 s here).
    assert paused_after < 5.0, paused_after
    assert kernel.statuses(pause_id) == ["idle"] and kernel.statuses(update_id) == ["idle"]
    # The indicator: every "idle" of a comm message during the cell is followed by "busy" for the cell, and the
    # cell's own last status is its final "idle".
    cell = [m["content"]["execution_state"] for m in kernel.seen if m["msg_type"] == "status"
            and m["parent_header"].get("msg_id") == mid]
    assert cell[0] == "busy" and cell[-1] == "idle" and cell.count("idle") == 1 and cell.count("busy") >= 3
    assert kernel.run("print(len(outs), [len(o.token_ids) for o in outs], panel.font_scale)").split()[0] == "4"
    assert kernel.run("print(panel.font_scale)").strip() == "1.5"


@pytest.mark.slow
def test_a_users_own_sleep_loop_does_not_block_clicks_either(kernel):
    out = kernel.run("print('ID', panel.model_id)")
    comm_id = out.split()[1]
    mid = kernel.execute("import time\nt0 = time.time()\nwhile not engine.paused and time.time() - t0 < 60:\n"
                         "    time.sleep(0.05)\nprint('paused', engine.paused)")
    kernel.messages(lambda m: m["parent_header"].get("msg_id") == mid and m["msg_type"] == "execute_input", 30)
    kernel.send_custom(comm_id, {"kind": "pause"})
    out: list[str] = []

    def line_printed(m):  # a loaded kernel may send print()'s words in several stream messages
        if m["parent_header"].get("msg_id") == mid and m["msg_type"] == "stream":
            out.append(m["content"]["text"])
        return "\n" in "".join(out)

    kernel.messages(line_printed, 60)
    assert "".join(out).strip() == "paused True"
    kernel.send_custom(comm_id, {"kind": "resume"})
    kernel.messages(_state_update(comm_id, "paused", False), 30)


def test_outside_a_kernel_nothing_is_routed():
    class W:
        comm = object()

    assert route_comm(W()) is False
    assert route_status() == "not in a Jupyter kernel"
