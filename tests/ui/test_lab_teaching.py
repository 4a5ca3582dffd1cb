"""The teaching panels in a real JupyterLab (the quickstart's dashboard, the session shared with test_lab_e2e.py):
step mode, the request timeline, "Why?", the KV highlight, cancel, prompt words, the submit cap, the first-token
state, the plots' segments and axes, the compact config panel, and presentation mode (theme, font scale).

Every test performs the action with real mouse / keyboard events and checks the result in Python (a synced trait
or the engine), in a pixel region of a canvas, or in the DOM; screenshots at 1440x900, in JupyterLab's light and
dark themes, go to test-artifacts/ui/ (<name>-light.png, <name>-dark.png). The tests run in file order.
"""

from __future__ import annotations

import ast
import json
import math
import re
import time

import pytest

from .lab import ARTIFACTS, settle

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def s(lab_session):
    """The shared session, with the engine set up for teaching: chunks of 16 tokens, a fresh run."""
    lab_session.run("engine.resume(); engine.set_step_rate(None); engine.cancel_all()")
    lab_session.run("engine.reconfigure(engine.user_config.copy(max_batch_tokens=16))")
    return lab_session


def steps_planned(s) -> int:
    return int(s.py("sum(1 for e in engine.events.events('step_planned'))"))


def live_states(s) -> dict:
    return ast.literal_eval(s.py("{o.request_id: o.state.name for o in engine.requests_snapshot()}"))


def wait_py(s, expr: str, timeout: float = 60.0, every: float = 0.2) -> str:
    deadline = time.monotonic() + timeout
    while True:
        v = s.py(expr)
        if v == "True":
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{expr} still {v} after {timeout} s")
        time.sleep(every)


def submit(s, prompt: str, max_new: int) -> str:
    page = s.page
    box = page.locator(".cbnb-submit .cbnb-prompt")
    box.scroll_into_view_if_needed()
    box.fill("")
    box.press_sequentially(prompt, delay=2)
    page.locator(".cbnb-submit .cbnb-max-new").fill(str(max_new))
    before = page.locator(".cbnb-submit > .cbnb-message").text_content() or ""
    page.locator(".cbnb-submit .cbnb-submit-btn").click()
    page.wait_for_function("""(b) => { const m = document.querySelector('.cbnb-submit > .cbnb-message').textContent;
        return m !== b && /Submitted req-\\d+/.test(m); }""", arg=before, timeout=30_000)
    return re.search(r"Submitted (req-\d+)", page.locator(".cbnb-submit > .cbnb-message").text_content()).group(1)


def canvas_pixel(page, selector: str, x: float, y: float) -> list[int]:
    return page.evaluate("""([sel, x, y]) => { const c = document.querySelector(sel);
        return Array.from(c.getContext('2d').getImageData(Math.floor(x), Math.floor(y), 1, 1).data); }""",
                         [selector, x, y])


def wait_text(page, selector: str, pattern: str, timeout: float = 15.0) -> str:
    """Wait until the element's text matches `pattern` (re.S); returns the text (the last one seen on failure)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = page.evaluate("(s) => { const e = document.querySelector(s); return e ? e.textContent : null; }",
                             selector) or ""
        if re.search(pattern, text, re.S):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{selector}: {text!r} does not match {pattern!r}")


def luma(rgb) -> float:
    return 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]


# ---------------------------------------------------------------------------------------------- step mode
def test_step_mode_walks_a_lone_prompt_one_step_per_click(s):
    page = s.page
    page.locator(".cbnb-controls").scroll_into_view_if_needed()
    page.locator(".cbnb-controls .cbnb-pause").click()
    page.wait_for_function("() => document.querySelector('.cbnb-controls').dataset.paused === 'true'", timeout=30_000)
    assert s.py("engine.paused") == "True"
    before = steps_planned(s)
    rid = submit(s, "Why is the sky blue?", 6)
    s.rid_lone = rid
    row = f".cbnb-board tr[data-id='{rid}']"
    page.wait_for_selector(f"{row}[data-state=PENDING]", timeout=30_000)
    page.wait_for_function("""() => /1 waiting \\(submissions queue until Step or Resume\\)/.test(
        document.querySelector('.cbnb-controls-status').textContent)""", timeout=30_000)
    time.sleep(1.0)
    assert steps_planned(s) == before and live_states(s)[rid] == "PENDING"  # queued visibly, nothing ran
    s.shots("10-step-paused-queued", ".cbnb-controls")
    prompt_len = int(s.py(f"len(next(o for o in engine.requests_snapshot() if o.request_id == {rid!r}).prompt_token_ids)"))
    seen = []
    for k in range(40):
        n0 = steps_planned(s)
        page.locator(".cbnb-controls .cbnb-step").click()
        page.wait_for_function("() => /^Step \\d+:.*Paused\\.$/.test(document.querySelector('.cbnb-controls > .cbnb-message').textContent)"
                               " && !document.querySelector('.cbnb-controls .cbnb-step').disabled", timeout=60_000)
        assert steps_planned(s) == n0 + 1  # exactly one scheduling step per click
        state = live_states(s).get(rid, "FINISHED")
        seen.append(state)
        page.wait_for_selector(f"{row}[data-state={state}]", timeout=30_000)  # the board shows it after the step
        if k == 1:
            s.shots("11-step-prefill-chunk", ".cbnb-timeline")
        if state == "FINISHED":
            break
        page.evaluate("() => { document.querySelector('.cbnb-controls > .cbnb-message').textContent = ''; }")
    chunks = math.ceil(prompt_len / 16)
    n_out = int(s.py(f"len(next(o for o in engine.requests_snapshot() if o.request_id == {rid!r}).token_ids)"))
    # Chunks of 16 (the last one samples token 1: DECODING), one decode per later token, then FINISHED (6 tokens, or
    # fewer at EOS).
    assert seen == ["PREFILLING"] * (chunks - 1) + ["DECODING"] * (n_out - 1) + ["FINISHED"], (prompt_len, seen)
    assert 2 <= n_out <= 6
    page.locator(".cbnb-controls .cbnb-resume").click()
    page.wait_for_function("() => document.querySelector('.cbnb-controls').dataset.paused === 'false'", timeout=30_000)
    assert s.py("engine.paused") == "False"
    page.locator(".cbnb-controls .cbnb-rate").select_option("2")
    wait_py(s, "engine.step_rate == 2.0", 15)
    page.wait_for_function("() => /slow motion \\(2 steps\\/s\\)/.test(document.querySelector('.cbnb-controls-status').textContent)",
                           timeout=15_000)
    page.locator(".cbnb-controls .cbnb-rate").select_option("0")
    wait_py(s, "engine.step_rate is None", 15)
    assert s.errors == [], s.errors


# ---------------------------------------------------------------------------------------------- timeline
def test_timeline_shows_the_chunks_and_hover_names_the_numbers(s):
    page = s.page
    tl = page.locator(".cbnb-timeline")
    tl.scroll_into_view_if_needed()
    rid = s.rid_lone
    page.wait_for_function("(r) => (document.querySelector('.cbnb-timeline').__cbnbGeo || {rows: []}).rows.includes(r)",
                           arg=rid, timeout=30_000)
    time.sleep(0.3)
    geo = page.evaluate("() => document.querySelector('.cbnb-timeline').__cbnbGeo")
    first_step = int(s.py(f"next(e.step for e in engine.events.events('step_planned') "
                          f"if any(t[0] == {rid!r} for t in e.taken))"))
    row = geo["rows"].index(rid) - geo["row0"]
    col = first_step - geo["first"] - geo["col0"]
    assert 0 <= col < geo["shown"], (col, geo)
    y = geo["headH"] + row * geo["rowH"] - geo["yOff"] + geo["rowH"] / 2
    x0 = geo["gutter"] + col * geo["colW"]
    dark = s.theme == "dark"
    px = canvas_pixel(page, ".cbnb-tl-canvas", x0 + 1, y)  # the chunk fills its cell from the left
    want = [0x6f, 0xa3, 0xe0] if dark else [0x3d, 0x6f, 0xa8]  # the prefill colour
    assert all(abs(a - b) <= 3 for a, b in zip(px, want)), px
    box = page.locator(".cbnb-tl-canvas").bounding_box()
    page.mouse.move(box["x"] + x0 + 2, box["y"] + y)
    tip = wait_text(page, ".cbnb-tl-tooltip", r"prefill: 16 tokens \(positions 0-15\).*\n?.*blocks held: \d+")
    assert f"{rid} · step {first_step} · prefill" in tip
    s.shots("12-timeline-hover", ".cbnb-timeline")
    draws = page.evaluate("() => document.querySelector('.cbnb-timeline').__cbnbDrawMs")
    (ARTIFACTS / "timeline_lab_draw_ms.json").write_text(json.dumps(draws))
    page.mouse.move(5, 5)


# ---------------------------------------------------------------------------------------------- why?
def why_request(page) -> str:
    return page.evaluate("() => document.querySelector('.cbnb-why').dataset.request || ''")


def test_why_opens_from_board_stream_and_timeline(s):
    page = s.page
    rid = s.rid_lone
    row = page.locator(f".cbnb-board tr[data-id='{rid}']")
    row.locator("td.cbnb-col-prompt_text").click()  # scrolls, and retries while the board redraws the row
    page.wait_for_function("(r) => document.querySelector('.cbnb-why').dataset.request === r", arg=rid, timeout=30_000)
    assert s.py("dash.why.request_id") == repr(rid) and s.py("dash.board.selected") == repr(rid)
    prefill = page.locator(".cbnb-why .cbnb-why-entry[data-kind=prefill] .cbnb-why-what").text_content()
    assert re.match(r"prompt: \d+ chunks of 16, 16", prefill), prefill
    kinds = page.evaluate("() => Array.from(document.querySelectorAll('.cbnb-why-entry')).map(e => e.dataset.kind)")
    assert kinds[0] == "arrival" and kinds[-1] == "end" and "decode" in kinds
    s.shots("13-why-from-board", ".cbnb-why")
    # Two at once under max_batch_tokens=16: the second waits for the token budget; its stream card tells why.
    s.run("_why = [engine.submit(q, max_new_tokens=3) for q in ('Name a fruit.', 'Name a colour.')]")
    wait_py(s, "all(h.done() for h in _why)", 120)
    second = ast.literal_eval(s.py("_why[1].request_id"))
    card = page.locator(f".cbnb-stream-item[data-id='{second}']")
    card.scroll_into_view_if_needed()
    card.locator(".cbnb-stream-text").click()
    page.wait_for_function("(r) => document.querySelector('.cbnb-why').dataset.request === r", arg=second,
                           timeout=30_000)
    wait = page.locator(".cbnb-why .cbnb-why-entry[data-reason=token_budget]").first
    assert "left out" in wait.text_content() and "budget 16 tokens" in wait.text_content()
    assert wait.locator(".cbnb-why-field").all_text_contents() == ["max_batch_tokens"]
    s.shots("14-why-waiting-from-stream", ".cbnb-why")
    # A click on a timeline row: its request's story.
    page.locator(".cbnb-timeline").scroll_into_view_if_needed()
    time.sleep(0.3)
    geo = page.evaluate("() => document.querySelector('.cbnb-timeline').__cbnbGeo")
    r = geo["rows"].index(rid) - geo["row0"]
    box = page.locator(".cbnb-tl-canvas").bounding_box()
    page.mouse.click(box["x"] + 20, box["y"] + geo["headH"] + r * geo["rowH"] - geo["yOff"] + geo["rowH"] / 2)
    page.wait_for_function("(r) => document.querySelector('.cbnb-why').dataset.request === r", arg=rid, timeout=30_000)
    assert s.py("dash.timeline.selected") == repr(rid)
    assert s.errors == [], s.errors


# ---------------------------------------------------------------------------------------------- KV highlight, cancel
def kv_block_xy(page, block: int) -> tuple[float, float, dict]:
    g = page.evaluate("() => document.querySelector('.cbnb-kvmap').__cbnbKvGeo[0]")
    return (block % g["cols"]) * g["cell"], (block // g["cols"]) * g["cell"], g


def test_kv_hover_lights_up_a_request_and_its_sharers_and_click_explains(s):
    page = s.page
    prompt = "Tell me a long story about a lighthouse keeper and the sea."
    s.run(f"_kv = [engine.submit({prompt!r}, max_new_tokens=400, ignore_eos=True)]")
    wait_py(s, "len(engine.cache.allocators[0].table(_kv[0].request_id)) >= 2", 120)
    s.run(f"_kv.append(engine.submit({prompt!r}, max_new_tokens=400, ignore_eos=True))")  # shares the prompt's blocks
    wait_py(s, "len(engine.cache.allocators[0].table(_kv[1].request_id)) >= 2", 120)
    assert s.py("engine.pause()") == "True"  # hold: the map stays as measured
    a, b = ast.literal_eval(s.py("[h.request_id for h in _kv]"))
    table_b = ast.literal_eval(s.py("engine.cache.allocators[0].table(_kv[1].request_id)"))
    shared = ast.literal_eval(s.py("[x for x in engine.cache.allocators[0].table(_kv[1].request_id) "
                                   "if x in engine.cache.allocators[0].table(_kv[0].request_id)]"))
    assert shared, "the second request shares no block"
    kv = page.locator(".cbnb-kvmap")
    kv.scroll_into_view_if_needed()
    page.wait_for_function("(n) => { const t = document.querySelector('.cbnb-kv-group-title'); return t && "
                           "/allocated/.test(document.querySelector('.cbnb-kvmap .cbnb-legend').textContent); }",
                           arg=0, timeout=30_000)
    time.sleep(1.0)  # the snapshot of the held engine
    own = [x for x in table_b if x not in shared][-1]
    x, y, g = kv_block_xy(page, own)
    box = page.locator(".cbnb-kvmap canvas").first.bounding_box()
    page.mouse.move(box["x"] + x + g["cell"] / 2, box["y"] + y + g["cell"] / 2)
    page.wait_for_function("""(r) => new RegExp('pointing at: ' + r + ' · \\\\d+ blocks · \\\\d+ shared with').test(
        document.querySelector('.cbnb-kv-highlight').textContent)""", arg=b, timeout=30_000)
    caption = page.locator(".cbnb-kv-highlight").text_content()
    assert f"{len(table_b)} blocks" in caption and f"shared with {a} ({len(shared)})" in caption, caption
    hl = ast.literal_eval(s.py("dash.kvmap.highlight['blocks'][0]"))
    assert hl == sorted(table_b)
    time.sleep(0.3)
    dark = s.theme == "dark"
    # Pixels: the hovered request's own block is outlined, a shared one outlined in the sharing colour, and a free
    # block is faded towards the background.
    edge = canvas_pixel(page, ".cbnb-kvmap canvas", x + 0.5, y + g["cell"] / 2)
    assert luma(edge) < 40, edge
    sx, sy, _ = kv_block_xy(page, shared[0])
    sedge = canvas_pixel(page, ".cbnb-kvmap canvas", sx + 0.5, sy + g["cell"] / 2)
    assert abs(sedge[0] - 0xc2) < 40 and sedge[1] < 90, sedge
    free = int(s.py("[int(i) for i, st in enumerate(engine.snapshot().groups[0].state) if st == 0][-1]"))
    fx, fy, _ = kv_block_xy(page, free)
    fpx = canvas_pixel(page, ".cbnb-kvmap canvas", fx + g["cell"] / 2, fy + g["cell"] / 2)
    assert luma(fpx) > 240 if not dark else luma(fpx) < 60, fpx
    s.shots("15-kv-highlight-shared", ".cbnb-kvmap")
    kv.scroll_into_view_if_needed()  # the screenshots scrolled: measure the block's place again
    x, y, g = kv_block_xy(page, own)
    box = page.locator(".cbnb-kvmap canvas").first.bounding_box()
    page.mouse.click(box["x"] + x + g["cell"] / 2, box["y"] + y + g["cell"] / 2)  # a click: the owner's story
    page.wait_for_function("(r) => document.querySelector('.cbnb-why').dataset.request === r", arg=b, timeout=30_000)
    page.mouse.move(5, 5)
    s.run("engine.resume()")


def test_board_cancel_row_then_cancel_all(s):
    page = s.page
    s.run("_kv.append(engine.submit('Count to one hundred.', max_new_tokens=400, ignore_eos=True))")
    c = ast.literal_eval(s.py("_kv[2].request_id"))
    row = page.locator(f".cbnb-board tr[data-id='{c}']")
    row.wait_for(timeout=30_000)
    # The board redraws its rows at every update: scroll by selector (a held element may be replaced meanwhile).
    page.evaluate("(sel) => document.querySelector(sel).scrollIntoView({block: 'center'})",
                  f".cbnb-board tr[data-id='{c}']")
    row.locator(".cbnb-row-cancel").click()
    wait_py(s, "_kv[2].done() and _kv[2].result().state.name == 'CANCELLED'", 30)
    page.wait_for_selector(f".cbnb-board tr[data-id='{c}'][data-state=CANCELLED]", timeout=30_000)
    assert "Cancel requested for" in page.locator(".cbnb-board > .cbnb-message").text_content()
    btn = page.locator(".cbnb-board .cbnb-cancel-all")
    page.wait_for_function("() => /Cancel all \\(2\\)/.test(document.querySelector('.cbnb-board .cbnb-cancel-all').textContent)",
                           timeout=30_000)
    s.shots("16-board-cancel", ".cbnb-board")
    btn.click()
    wait_py(s, "all(h.done() for h in _kv) and not engine.core.requests", 30)
    assert ast.literal_eval(s.py("[h.result().state.name for h in _kv]")) == ["CANCELLED"] * 3
    page.wait_for_function("() => /Cancelled 2 unfinished requests/.test(document.querySelector('.cbnb-board > .cbnb-message').textContent)",
                           timeout=30_000)
    # The button follows the rows, which the next update brings (the message is set at once).
    page.wait_for_function("() => document.querySelector('.cbnb-board .cbnb-cancel-all').disabled", timeout=30_000)


def test_prompt_words_on_cards_and_rows(s):
    page = s.page
    rid = s.rid_lone
    cell = page.locator(f".cbnb-board tr[data-id='{rid}'] td.cbnb-col-prompt_text")
    assert cell.text_content() == "Why is the sky blue?" and cell.get_attribute("title") == "Why is the sky blue?"
    head = page.locator(".cbnb-board th.cbnb-col-prompt_text")
    assert head.text_content() == "prompt" and "first words" in head.get_attribute("title")
    card = page.locator(f".cbnb-stream-item[data-id='{rid}'] .cbnb-stream-prompt")
    if card.count():  # the card is on screen while among the newest ended requests
        assert card.text_content() == "Why is the sky blue?"
    s.shots("17-prompt-words", ".cbnb-stream")


def test_submit_says_the_cap_and_why(s):
    page = s.page
    rid = submit(s, "Say hello.", 100000)
    msg = page.locator(".cbnb-submit > .cbnb-message").text_content()
    m = re.search(r"up to (\d+) new tokens \(asked 100000: the model's (\d+) max positions minus the (\d+) prompt "
                  r"tokens\)", msg)
    assert m, msg
    cap, positions, prompt = map(int, m.groups())
    assert cap == positions - prompt and positions == int(s.py("engine.max_positions"))
    page.wait_for_function(f"""() => {{ const c = document.querySelector(".cbnb-stream-item[data-id='{rid}'] .cbnb-count");
        return c && c.textContent.endsWith('/{cap} tokens'); }}""", timeout=30_000)
    s.shots("18-submit-cap", ".cbnb-submit")
    # The model may end its answer (EOS) first; a request still running is cancelled from its card.
    # (it may also end while the click waits: its card then hides the button, so retry while it is still running)
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    deadline = time.monotonic() + 90
    while s.py(f"any(r.request_id == '{rid}' for r in engine.core.requests.values())") == "True":
        assert time.monotonic() < deadline, "the running request's Cancel button never became clickable"
        try:
            page.locator(f".cbnb-stream-item[data-id='{rid}']:not(.cbnb-ended) .cbnb-cancel").click(timeout=10_000)
            break
        except PlaywrightTimeout:
            continue
    wait_py(s, "not engine.core.requests", 30)


def test_board_names_the_first_token_in_flight(s):
    page = s.page
    # A slow forward (2.5 s per step) holds the state between "last chunk scheduled" and "first token applied".
    s.run("_ex = engine.runner.execute; engine.runner.execute = lambda w: (__import__('time').sleep(2.5), _ex(w))[1]")
    try:
        s.run("_ft = engine.submit('Hi.', max_new_tokens=2)")
        rid = ast.literal_eval(s.py("_ft.request_id"))
        row = f".cbnb-board tr[data-id='{rid}'][data-state=DECODING]"
        page.wait_for_selector(row, timeout=60_000)
        page.locator(row).scroll_into_view_if_needed()
        page.wait_for_function(f"""() => {{ const r = document.querySelector("{row}");
            return r && /0\\/2 · 1st token in flight/.test(r.querySelector('td.cbnb-col-output_tokens').textContent)
                   && r.querySelector('td.cbnb-col-ttft_ms').textContent === '…'; }}""", timeout=30_000)
        tip = page.locator(f"{row} td.cbnb-col-ttft_ms").get_attribute("title")
        assert "first token arrives when this step ends" in tip
        page.screenshot(path=str(ARTIFACTS / "19-first-token-in-flight-light.png"))
        s.set_theme("dark")
        page.locator(row).scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "19-first-token-in-flight-dark.png"))
        s.set_theme("light")
    finally:
        s.run("engine.runner.execute = _ex")
    wait_py(s, "_ft.done()", 60)


# ---------------------------------------------------------------------------------------------- config
def test_config_compact_lock_invalid_edit_and_apply_mid_run(s):
    page = s.page
    cfg = page.locator(".cbnb-config")
    cfg.scroll_into_view_if_needed()
    geo = page.evaluate("""() => { const c = document.querySelector('.cbnb-config');
        const cols = Array.from(c.querySelectorAll('.cbnb-config-col')).map(e => e.getBoundingClientRect());
        const kv = document.querySelector('.cbnb-kvmap').getBoundingClientRect();
        return {h: c.getBoundingClientRect().height, kv: kv.height, cols: cols.map(r => [r.x, r.y]),
                help: c.querySelectorAll('.cbnb-config-help').length,
                cudaOpen: c.querySelector('.cbnb-cuda-fields').open,
                tip: c.querySelector('.cbnb-config-row[data-field=safety_margin] .cbnb-config-label').title,
                apply: c.querySelector('.cbnb-apply').title}; }""")
    assert geo["h"] < 600, geo  # was ~1019 px
    (x1, y1), (x2, y2) = geo["cols"]
    assert x2 > x1 + 100 and abs(y1 - y2) < 2, geo  # two columns side by side
    assert geo["help"] == 0 and "Share of the cache kept free" in geo["tip"] and geo["cudaOpen"] is False
    assert "mid-run" in geo["apply"] and "recomputed in the new cache" in geo["apply"]
    # The lock: a new page_size rescales num_blocks, the cache keeps its bytes.
    page.locator(".cbnb-config .cbnb-lock-bytes").check()
    wait_py(s, "dash.config.lock_bytes", 15)
    before = ast.literal_eval(s.py("(dash.config.values['page_size'], dash.config.values['num_blocks'])"))
    page.locator(".cbnb-config select[data-field=page_size]").select_option(str(before[0] // 2))
    wait_py(s, f"dash.config.values['num_blocks'] == {before[1] * 2}", 15)
    page.wait_for_function(f"""() => document.querySelector('.cbnb-config-num[data-field=num_blocks]')
        .value === '{before[1] * 2}'""", timeout=15_000)
    assert "Cache bytes kept" in page.locator(".cbnb-config .cbnb-apply-bar .cbnb-message").text_content()
    s.shots("20-config-compact-lock", ".cbnb-config")
    page.locator(".cbnb-config .cbnb-reset").click()
    wait_py(s, f"dash.config.values['page_size'] == {before[0]}", 15)
    page.locator(".cbnb-config .cbnb-lock-bytes").uncheck()
    # An edit that cannot be sized: no code of older values, and no "-> 0 B" in the legend.
    s.run("dash.config.set(num_blocks=10**7)")
    page.wait_for_function("() => document.querySelector('.cbnb-config .cbnb-code').textContent.startsWith('# not valid yet')",
                           timeout=15_000)
    code = page.locator(".cbnb-config .cbnb-code").text_content()
    legend = page.locator(".cbnb-config .cbnb-memory .cbnb-legend").text_content()
    stale = f"num_blocks={before[1]}"
    assert stale not in code and "ContinuousBatchingConfig(" not in code and "num_blocks=10000000 needs" in code
    assert "→ ?" in legend and "→ 0 B" not in legend
    assert page.locator(".cbnb-config .cbnb-mem-note").text_content() == "not valid"
    s.shots("21-config-invalid-edit", ".cbnb-config")
    page.locator(".cbnb-config .cbnb-reset").click()
    page.wait_for_function("() => document.querySelector('.cbnb-config .cbnb-code').textContent.startsWith('from ')",
                           timeout=15_000)
    # The code box wraps its long lines inside the panel (no sideways scrolling on a projector), and never inside
    # a word: the copied text is the code as written.
    lines = page.evaluate("""() => { const pre = document.querySelector('.cbnb-config .cbnb-code');
        const cs = getComputedStyle(pre);
        return {ws: cs.whiteSpace, wb: cs.wordBreak, scroll: pre.scrollWidth, width: pre.clientWidth}; }""")
    assert lines["ws"] == "pre-wrap" and lines["wb"] == "normal" and lines["scroll"] <= lines["width"] + 1, lines
    # Apply mid-run: the unfinished request is kept and recomputes its KV.
    s.run("_mid = engine.submit('List five animals.', max_new_tokens=30, ignore_eos=True)")
    wait_py(s, "any(len(o.token_ids) >= 3 for o in engine.requests_snapshot() if o.request_id == _mid.request_id)", 120)
    slider = page.locator(".cbnb-config input[type=range][data-field=max_batch_tokens]")
    slider.scroll_into_view_if_needed()
    slider.focus()
    for _ in range(3):
        page.keyboard.press("ArrowRight")  # 16 -> 64
    page.locator(".cbnb-config .cbnb-apply").click()
    page.wait_for_function("() => /^Applied at once/.test(document.querySelector('.cbnb-config .cbnb-apply-bar .cbnb-message').textContent)",
                           timeout=120_000)
    msg = page.locator(".cbnb-config .cbnb-apply-bar .cbnb-message").text_content()
    assert re.search(r"1 unfinished request kept, their KV \([\d,]+ tokens\) recomputed in the new cache", msg), msg
    assert s.py("engine.config.max_batch_tokens") == "64"
    bar = page.evaluate("""() => { const b = document.querySelector('.cbnb-config .cbnb-apply-bar');
        return [getComputedStyle(b).position, b.contains(document.querySelector('.cbnb-config .cbnb-apply'))]; }""")
    assert bar == ["sticky", True]
    s.shots("22-config-applied-mid-run", ".cbnb-config .cbnb-apply-bar")
    wait_py(s, "_mid.done()", 120)
    assert ast.literal_eval(s.py("(_mid.result().state.name, len(_mid.result().token_ids))")) == ("FINISHED", 30)
    kinds = ast.literal_eval(s.py("[(e.kind, e.reason) for e in engine.explain(_mid.request_id).entries]"))
    assert ("reconfigure", None) in kinds and ("prefill", "recompute") in kinds, kinds


# ---------------------------------------------------------------------------------------------- plots
def plot_info(page) -> list[dict]:
    return page.evaluate("""() => Array.from(document.querySelectorAll('.cbnb-plots .js-plotly-plot')).map(g => ({
        range: g._fullLayout.xaxis.range, names: g.data.map(t => t.name), showlegend: g._fullLayout.showlegend,
        legend: g.querySelectorAll('.legend .traces').length,
        title: (g.querySelector('.gtitle') || {}).textContent, titlePx: parseFloat(getComputedStyle(g.querySelector('.gtitle')).fontSize),
        shapes: (g.layout.shapes || []).map(s => [s.type, (s.line || {}).dash || '']),
        notes: (g.layout.annotations || []).map(a => a.text),
        y2: Array.from(g.querySelectorAll('.y2tick text')).map(t => t.textContent),
        y2range: g._fullLayout.yaxis2 ? g._fullLayout.yaxis2.range : null,
        bottom: g.getBoundingClientRect().bottom }))""")


def nice(ticks: list[str]) -> bool:
    vals = [float(t.replace(",", "").replace("−", "-").replace("k", "e3")) for t in ticks if t.strip()]
    if len(vals) < 2:
        return True
    step = vals[1] - vals[0]
    mant = step / 10 ** math.floor(math.log10(step))
    return all(abs((b - a) - step) < 1e-6 * max(1, step) for a, b in zip(vals, vals[1:])) and \
        any(abs(mant - m) < 1e-6 for m in (1, 2, 2.5, 5))


def test_plots_segments_legend_meanings_and_axes(s):
    page = s.page
    page.locator(".cbnb-plots .cbnb-new-run").scroll_into_view_if_needed()
    page.locator(".cbnb-plots .cbnb-new-run").click()
    wait_py(s, "dash.plots.runs[-1]['cause'] == 'reset_stats'", 30)
    s.run("engine.generate(['Hi.'], max_new_tokens=2)")  # a step, so that the next marker is a run of its own
    # Two prompts at once under a 16-token budget: left-out steps in the new segment.
    s.run("engine.reconfigure(engine.user_config.copy(max_batch_tokens=16))")
    s.run("_pl = [engine.submit(q, max_new_tokens=4) for q in ('Name a river.', 'Name a mountain.')]")
    wait_py(s, "all(h.done() for h in _pl)", 120)
    time.sleep(1.5)
    plots = page.locator(".cbnb-plots")
    for i in range(6):  # draw every chart (they draw once on screen)
        page.locator(".cbnb-plots .js-plotly-plot").nth(i).scroll_into_view_if_needed()
        time.sleep(0.4)
    page.wait_for_function("""() => { const g = document.querySelectorAll('.cbnb-plots .js-plotly-plot')[1];
        return g && g.data.length >= 1; }""", timeout=30_000)
    time.sleep(1.0)
    info = plot_info(page)
    ranges = {tuple(round(v, 3) for v in p["range"]) for p in info}
    assert len(ranges) == 1, [p["range"] for p in info]  # one step axis: the charts line up
    skip = info[1]
    assert skip["names"] == ["token budget"] and skip["showlegend"] and skip["legend"] == 1  # one reason: legend kept
    meaning = page.locator(".cbnb-plots .cbnb-reason-legend [data-reason=token_budget]").text_content()
    assert "max_batch_tokens query tokens were already taken" in meaning
    runs = ast.literal_eval(s.py("[(r['cause'], r['label']) for r in dash.plots.runs]"))
    assert runs[-1][0] == "reconfigure" and runs[-1][1].startswith("max_batch_tokens=16"), runs
    assert ("reset_stats", "New run button") in runs
    last = len(runs) - 1
    assert any(n.startswith(f"run {last}: max_batch_tokens=16") for n in info[2]["notes"]), info[2]["notes"]
    assert ["line", "dash"] in info[2]["shapes"] and ["rect", ""] in info[2]["shapes"]  # marker, faded earlier runs
    assert info[3]["title"].startswith(f"Prefix-cache hits, run {last}:")
    assert all(p["titlePx"] >= 12 for p in info), [p["titlePx"] for p in info]
    for k in (3, 5):
        assert nice(info[k]["y2"]), info[k]["y2"]  # 20/40/60, not 29.7/59.4/89.1
    top = max(2, math.ceil(1.15 * float(s.py("float(max(dash.plots.series_arrays()['steps']['decode']))"))))
    assert info[0]["y2range"] == [0, top], info[0]["y2range"]  # decode tokens on their own scale: visible
    # The KV chart's line is broken where the segments start (a NaN row), not drawn across.
    moves = page.evaluate("""() => { const g = document.querySelectorAll('.cbnb-plots .js-plotly-plot')[2];
        return Array.from(g.querySelectorAll('.scatterlayer .trace')[0].querySelectorAll('path.js-line'))
            .map(p => (p.getAttribute('d').match(/M/g) || []).length).reduce((a, b) => a + b, 0); }""")
    assert moves >= 2, moves
    # The CUDA-graph note sits under its chart, outside the plot area.
    note = page.locator(".cbnb-plots .cbnb-graph-note").bounding_box()
    assert note["y"] >= info[4]["bottom"] - 1 and "CUDA graphs: 0 captures" in page.locator(".cbnb-graph-note").text_content()
    # Hover the skip chart at a left-out step: the reason and its meaning.
    step = int(s.py("max(e.step for e in engine.events.events('step_planned') if e.skipped)"))
    g = page.locator(".cbnb-plots .js-plotly-plot").nth(1)
    g.scroll_into_view_if_needed()
    xy = page.evaluate("""(st) => { const g = document.querySelectorAll('.cbnb-plots .js-plotly-plot')[1];
        const L = g._fullLayout, r = g.getBoundingClientRect();
        return [r.left + L._size.l + L.xaxis.l2p(st), r.top + L._size.t + L._size.h / 2]; }""", step)
    page.mouse.move(*xy)
    page.wait_for_function("() => /token budget/.test((document.querySelectorAll('.cbnb-plots .js-plotly-plot')[1]"
                           ".querySelector('.hoverlayer') || {}).textContent || '')", timeout=15_000)
    hover = page.evaluate("() => document.querySelectorAll('.cbnb-plots .js-plotly-plot')[1].querySelector('.hoverlayer').textContent")
    assert "left out" in hover and "token budget" in hover, hover
    s.shots("23-plots-skip-hover", None)
    page.mouse.move(5, 5)
    plots.scroll_into_view_if_needed()
    s.shots("24-plots-segments-top", ".cbnb-plots")
    page.locator(".cbnb-plots .js-plotly-plot").nth(4).scroll_into_view_if_needed()
    s.shots("25-plots-segments-bottom", None)
    assert s.errors == [], s.errors


# ---------------------------------------------------------------------------------------------- presentation
# The charts on screen (as their IntersectionObserver sees them) have redrawn in the dark theme: font colour from the
# theme's CSS and, where a run veil is drawn, the dark veil; at least the last chart is on screen.
_ONE_THEME = """(n) => {
    const fg = getComputedStyle(document.body).getPropertyValue('--jp-ui-font-color1').trim();
    const on = (e) => { const r = e.getBoundingClientRect(); let top = 0, bottom = innerHeight;
        // (the body's overflow applies to the viewport, not to its own box, which may be 0 px high)
        for (let a = e.parentElement; a && a !== document.body; a = a.parentElement) {
            if (/(auto|scroll|hidden)/.test(getComputedStyle(a).overflowY)) {
                const q = a.getBoundingClientRect(); top = Math.max(top, q.top); bottom = Math.min(bottom, q.bottom); } }
        return r.height > 0 && r.bottom > top && r.top < bottom; };
    const plots = Array.from(document.querySelectorAll('.cbnb-plots .js-plotly-plot'));
    if (plots.length !== n || !on(plots[n - 1])) return false;
    return plots.filter(on).every(g => g.layout && String(g.layout.font.color).trim() === fg
        && (g.layout.shapes || []).filter(sh => sh.type === 'rect').every(sh => sh.fillcolor === 'rgba(20,20,20,0.55)'));
}"""

_THEMES_DRAWN = """() => ({fg: getComputedStyle(document.body).getPropertyValue('--jp-ui-font-color1').trim(),
    charts: Array.from(document.querySelectorAll('.cbnb-plots .js-plotly-plot')).map(g => ({
        top: Math.round(g.getBoundingClientRect().top), font: g.layout && String(g.layout.font.color),
        veils: (g.layout && g.layout.shapes || []).filter(sh => sh.type === 'rect').map(sh => sh.fillcolor)}))})"""


def test_theme_colours_and_font_scale(s):
    page = s.page
    s.set_theme("dark")
    page.locator(".cbnb-kvmap").scroll_into_view_if_needed()
    settle(page)
    free = int(s.py("[int(i) for i, st in enumerate(engine.snapshot().groups[0].state) if st == 0][-1]"))
    x, y, g = kv_block_xy(page, free)
    # The map redrew in the dark palette: a free block is the dark theme's grey (98, 104, 114: luma 103, light enough
    # to read on the near-black page, test_lab_projector.py checks its contrast), not the light theme's (luma 228).
    assert luma(canvas_pixel(page, ".cbnb-kvmap canvas", x + g["cell"] / 2, y + g["cell"] / 2)) < 150
    page.locator(".cbnb-timeline").scroll_into_view_if_needed()
    settle(page)
    assert luma(canvas_pixel(page, ".cbnb-tl-canvas", 3, 3)) < 80  # the timeline's background
    page.locator(".cbnb-plots .js-plotly-plot").first.scroll_into_view_if_needed()
    # The first chart, on screen, redraws in the dark theme's colours: light titles on the dark page (a wait on
    # that itself: a busy machine draws it later, not never).
    fill_js = "() => getComputedStyle(document.querySelector('.cbnb-plots .gtitle')).fill"
    try:
        page.wait_for_function("""() => { const m = getComputedStyle(document.querySelector('.cbnb-plots .gtitle'))
            .fill.match(/\\d+/g); return m && 0.2126 * m[0] + 0.7152 * m[1] + 0.0722 * m[2] > 150; }""", timeout=60_000)
    except Exception:  # playwright's TimeoutError: the assert below says which colour it stayed
        pass
    fill = page.evaluate(fill_js)
    assert luma([int(v) for v in re.findall(r"\d+", fill)[:3]]) > 150, fill
    assert "dark theme" in page.locator(".cbnb-controls .cbnb-theme-name").text_content()
    # Every chart, once on screen, is drawn in one theme: the veil over earlier runs is the dark one, as its text
    # (a switch once left the lower charts with light veils and grid under dark-theme text).
    page.locator(".cbnb-plots .js-plotly-plot").last.scroll_into_view_if_needed()
    try:
        page.wait_for_function(_ONE_THEME, arg=len(page.locator(".cbnb-plots .js-plotly-plot").all()), timeout=60_000)
    except Exception as e:  # playwright's TimeoutError: say what each chart was drawn with
        raise AssertionError(page.evaluate(_THEMES_DRAWN)) from e
    s.set_theme("light")
    # Font scale 2x for a projector: every panel, plotly charts included.
    scale = page.locator(".cbnb-controls .cbnb-font-scale")
    scale.scroll_into_view_if_needed()
    scale.focus()
    page.keyboard.press("End")
    wait_py(s, "dash.controls.font_scale == 2.0", 15)
    css = page.evaluate("() => getComputedStyle(document.documentElement).getPropertyValue('--cbnb-scale').trim()")
    assert css == "2"
    title_px = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('.cbnb-board .cbnb-panel-title')).fontSize)")
    assert title_px == 28.0
    page.locator(".cbnb-plots .js-plotly-plot").first.scroll_into_view_if_needed()
    page.wait_for_function("() => parseFloat(getComputedStyle(document.querySelector('.cbnb-plots .gtitle')).fontSize) >= 24",
                           timeout=30_000)
    s.shots("26-presentation-2x", ".cbnb-plots")
    page.locator(".cbnb-controls").scroll_into_view_if_needed()
    s.shots("27-presentation-2x-controls", ".cbnb-controls")
    scale.focus()
    page.keyboard.press("Home")
    wait_py(s, "dash.controls.font_scale == 1.0", 15)
    page.locator(".cbnb-plots .js-plotly-plot").first.scroll_into_view_if_needed()  # charts redraw on screen
    page.wait_for_function("() => parseFloat(getComputedStyle(document.querySelector('.cbnb-plots .gtitle')).fontSize) === 12",
                           timeout=30_000)
    # Back at 1x the grid reflows to narrower cells: every chart follows its cell (none spills over a neighbour).
    page.locator(".cbnb-plots").scroll_into_view_if_needed()
    page.wait_for_function("""() => Array.from(document.querySelectorAll('.cbnb-plots .js-plotly-plot')).every(p => {
        const svg = p.querySelector('.main-svg');
        return svg && svg.getBoundingClientRect().width <= p.getBoundingClientRect().width + 2; })""",
                           timeout=30_000)
    assert s.errors == [], s.errors
