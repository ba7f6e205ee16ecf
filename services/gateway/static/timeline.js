"use strict";
(() => {
  const { el, colour, fmt, getJSON, askKey } = DLS;
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  const requestId = decodeURIComponent(location.pathname.split("/").pop());
  function svg(tag, attrs, text) { const n = document.createElementNS(SVG, tag); for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v); if (text != null) n.textContent = text; return n; }

  function chip(id) { return el("span", { class: "chip", style: "background:" + colour(id) }, id); }

  function canvasRow(tokens, frame) {
    const committed = new Set(frame.committed), fresh = new Set(frame.new);
    return el("div", { class: "canvas" }, ...tokens.map((t, p) => {
      if (!committed.has(p)) return el("span", { class: "mask" }, "_");
      const cls = (fresh.has(p) ? "new " : "") + (t === "" ? "eos" : "");
      return el("span", { class: cls.trim(), title: "position " + p }, t === "" ? "·" : t);
    }));
  }

  function gantt(body, request) {
    const chart = $("gantt"); chart.replaceChildren();
    const W = 800, H = 120, L = 10;
    const end = Math.max(1, ...body.steps.map((s) => s.start_ms + s.duration_ms), request.finished_at ? (request.finished_at - request.arrival_time) * 1000 : 0);
    const x = (ms) => L + (W - 2 * L) * ms / end;
    const lanes = body.instances;
    body.steps.forEach((s) => {
      const lane = lanes.indexOf(s.instance_id), y = 10 + lane * Math.min(30, (H - 30) / Math.max(1, lanes.length));
      const bar = svg("rect", { x: x(s.start_ms), y, width: Math.max(2, x(s.start_ms + s.duration_ms) - x(s.start_ms)), height: 20,
        fill: colour(s.instance_id), opacity: s.kind === "recompute" ? 1 : 0.6 });
      bar.append(svg("title", {}, "step " + s.step_index + " on " + s.instance_id + " at threshold " + s.threshold));
      chart.append(bar);
    });
    if (request.deadline) chart.append(svg("line", { x1: x((request.deadline - request.arrival_time) * 1000), x2: x((request.deadline - request.arrival_time) * 1000), y1: 0, y2: H, stroke: "#d64545", "stroke-dasharray": "4 3" }));
    chart.append(svg("text", { x: L, y: H - 4 }, "arrival"));
    chart.append(svg("text", { x: W - 90, y: H - 4 }, fmt.ms(end) + " later"));
  }

  async function load() {
    let body;
    try { body = await getJSON("/v1/requests/" + encodeURIComponent(requestId) + "/timeline"); }
    catch (e) { $("status").textContent = e.message; if (e.status === 401) askKey(load); return; }
    const r = body.request;
    $("status").textContent = r.status;
    $("rid").textContent = body.id;
    $("summary").textContent = r.status + " · " + r.model + " · " + r.gen_length + " tokens in blocks of " + r.block_length + " · cache " + r.cache;
    const latency = r.finished_at ? (r.finished_at - r.arrival_time) * 1000 : null;
    $("latency").textContent = fmt.ms(latency);
    $("slo").replaceChildren(el("span", { class: r.slo_met == null ? "" : r.slo_met ? "ok" : "bad" }, r.slo_met == null ? "not finished" : r.slo_met ? "within SLO" : "SLO missed"), " · SLO " + fmt.ms(r.slo_ms));
    $("nsteps").textContent = r.num_steps;
    $("steps-detail").textContent = r.num_recompute_steps + " recompute · " + r.num_migrations + " migration(s) · " + body.instances.length + " instance(s)";
    $("prompt").textContent = r.prompt;
    $("output").textContent = r.output == null ? r.canvas : r.output;
    gantt(body, r);
    $("steps").querySelector("tbody").replaceChildren(...body.steps.map((s) => el("tr", { "data-step": s.step_index },
      el("td", { class: "num" }, s.step_index), el("td", {}, chip(s.instance_id)), el("td", {}, s.kind),
      el("td", { class: "num" }, s.block_index), el("td", { class: "num" }, fmt.num(s.threshold, 2)),
      el("td", { class: "num" }, s.batch_size), el("td", { class: "num" }, s.tokens_committed),
      el("td", {}, el("code", {}, JSON.stringify(s.committed_text))), el("td", { class: "num" }, fmt.ms(s.start_ms)),
      el("td", { class: "num" }, fmt.ms(s.duration_ms)), el("td", {}, s.loaded_state ? "loaded from Redis" : ""))));
    $("frames").querySelector("tbody").replaceChildren(...body.frames.map((f) => el("tr", {},
      el("td", { class: "num dim" }, f.step_index ? "after step " + f.step_index : "start"),
      el("td", {}, canvasRow(body.tokens, f)))));
    document.body.dataset.loaded = "1";
    if (r.status !== "finished" && r.status !== "rejected" && r.status !== "cancelled") setTimeout(load, 1000);
  }
  load();
})();
