// Controls: step-by-step mode for teaching (Pause / Step / Resume, slow motion) and presentation mode (a font
// scale for every cbnb panel of the page; colours follow JupyterLab's light / dark theme by themselves).

function ctlApplyScale(scale) {
  const s = Math.min(2, Math.max(1, Number(scale) || 1));
  document.documentElement.style.setProperty("--cbnb-scale", String(s));
  globalThis.dispatchEvent(new CustomEvent("cbnb:presentation", { detail: { scale: s } }));
}

function initialize({ model }) {
  cbnbTrackLatency(model, "controls");
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-controls", "Step mode and presentation");
  const row = cbnbEl("div", "cbnb-row cbnb-controls-row");
  const pause = cbnbEl("button", "cbnb-btn cbnb-pause", "Pause");
  pause.title = "Hold the engine after the step now running: panels show the state after the last step, and new "
    + "submissions wait PENDING";
  const step = cbnbEl("button", "cbnb-btn cbnb-primary cbnb-step", "Step ▶|");
  step.title = "Run exactly one scheduling step (plan, forward, apply), then hold again";
  const resume = cbnbEl("button", "cbnb-btn cbnb-resume", "▶ Resume");
  resume.title = "Let the steps run freely again";
  const rateLabel = cbnbEl("label", "cbnb-field cbnb-inline");
  const rate = cbnbEl("select", "cbnb-rate");
  rate.title = "Slow motion: at most this many steps per second";
  rateLabel.append(cbnbEl("span", "cbnb-field-label", "slow motion"), rate);
  const status = cbnbEl("span", "cbnb-controls-status");
  const scaleLabel = cbnbEl("label", "cbnb-field cbnb-inline cbnb-scale-field");
  const scale = cbnbEl("input", "cbnb-font-scale");
  scale.type = "range"; scale.min = "1"; scale.max = "2"; scale.step = "0.25";
  scale.title = "Font scale of every cbnb panel (for projectors)";
  const scaleOut = cbnbEl("span", "cbnb-scale-value");
  const themeOut = cbnbEl("span", "cbnb-hint cbnb-theme-name");
  scaleLabel.append(cbnbEl("span", "cbnb-field-label", "font"), scale, scaleOut);
  row.append(pause, step, resume, rateLabel, status, scaleLabel, themeOut);
  f.body.append(row);

  // "1 step/s", "0.5 steps/s".
  const perS = (r) => `${r} step${Number(r) === 1 ? "" : "s"}/s`;
  const fillRates = () => {
    const cur = model.get("step_rate") || 0;
    rate.replaceChildren(...(model.get("rates") || [0]).map((r) => {
      const o = cbnbEl("option", null, r ? perS(r) : "off");
      o.value = String(r);
      return o;
    }));
    rate.value = String(cur);
    if (rate.value !== String(cur)) {  // a rate set from Python that is not among the choices
      const o = cbnbEl("option", null, perS(cur)); o.value = String(cur); rate.append(o); rate.value = String(cur);
    }
  };
  const draw = () => {
    const paused = !!model.get("paused"), stepping = !!model.get("stepping");
    const es = model.get("engine_state") || "";
    const waiting = model.get("waiting") || 0, running = model.get("running") || 0;
    const last = model.get("last_step") || 0;
    f.root.dataset.paused = String(paused);
    pause.disabled = paused;
    resume.disabled = !paused;
    step.disabled = stepping || (es && es !== "running" && es !== "created");
    const r = model.get("step_rate") || 0;
    const what = paused ? `paused after step ${last}` : (r ? `slow motion (${perS(r)}) · step ${last}` : `running · step ${last}`);
    status.textContent = `${what} · ${running} running · ${waiting} waiting`
      + (paused && waiting ? " (submissions queue until Step or Resume)" : "") + (stepping ? " · stepping…" : "");
    status.classList.toggle("cbnb-paused", paused);
    fillRates();
    const s = model.get("font_scale") || 1;
    if (document.activeElement !== scale) scale.value = String(s);
    scaleOut.textContent = `${Number(s).toFixed(2)}×`;
    themeOut.textContent = `colours follow JupyterLab (${cbnbIsDark() ? "dark" : "light"} theme)`;
  };
  pause.addEventListener("click", () => model.send({ kind: "pause" }));
  step.addEventListener("click", () => model.send({ kind: "step" }));
  resume.addEventListener("click", () => model.send({ kind: "resume" }));
  rate.addEventListener("change", () => model.send({ kind: "rate", value: Number(rate.value) }));
  scale.addEventListener("input", () => {
    const s = Number(scale.value);
    model.set("font_scale", s);
    model.save_changes();
    ctlApplyScale(s);
    scaleOut.textContent = `${s.toFixed(2)}×`;
  });
  const onScale = () => { ctlApplyScale(model.get("font_scale")); draw(); };
  const schedule = cbnbOnFrame(draw);
  const names = ["paused", "stepping", "engine_state", "waiting", "running", "last_step", "step_rate", "rates"];
  for (const n of names) model.on(`change:${n}`, schedule);
  model.on("change:font_scale", onScale);
  const offTheme = cbnbOnTheme(draw);
  ctlApplyScale(model.get("font_scale"));
  draw();
  return () => {
    f.cleanup();
    offTheme();
    for (const n of names) model.off(`change:${n}`, schedule);
    model.off("change:font_scale", onScale);
  };
}

export default { initialize, render };
