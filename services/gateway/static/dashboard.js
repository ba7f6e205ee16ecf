"use strict";
(() => {
  const { el, colour, fmt, getJSON, askKey } = DLS;
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs, text) { const n = document.createElementNS(SVG, tag); for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v); if (text != null) n.textContent = text; return n; }

  function instances(body) {
    const tbody = $("instances").querySelector("tbody");
    tbody.replaceChildren(...body.instances.map((i) => el("tr", { "data-instance": i.instance_id },
      el("td", {}, el("span", { class: "chip", style: "background:" + colour(i.instance_id) }, i.instance_id)),
      el("td", {}, i.node), el("td", { class: "num" }, i.tp), el("td", {}, i.status),
      el("td", {}, el("div", { class: "bar", title: i.num_resident + " / " + i.max_batch },
        el("span", { style: "width:" + Math.min(100, 100 * (i.load || 0)) + "%" })), " " + i.num_resident + " / " + i.max_batch),
      el("td", { class: "num" }, fmt.num(i.last_threshold, 2)), el("td", { class: "num" }, i.steps_seen),
      el("td", { class: "num" }, i.last_step_age_s == null ? "–" : i.last_step_age_s.toFixed(1) + " s ago"),
      el("td", { class: "num" }, i.heartbeat_age_s.toFixed(1) + " s ago"))));
    if (!body.instances.length) tbody.append(el("tr", {}, el("td", { colspan: 9, class: "dim" }, "no live instance")));
  }

  function sloChart(series, bucket) {
    const chart = $("slo-chart"); chart.replaceChildren();
    const W = 600, H = 180, L = 36, B = 20;
    for (const y of [0, 0.5, 1]) {
      chart.append(svg("line", { x1: L, x2: W, y1: H - B - y * (H - B - 10), y2: H - B - y * (H - B - 10), stroke: "#e1e4ea" }));
      chart.append(svg("text", { x: 2, y: H - B - y * (H - B - 10) + 4 }, (100 * y) + "%"));
    }
    if (!series.length) { chart.append(svg("text", { x: L + 10, y: H / 2 }, "no finished requests yet")); return; }
    const t0 = series[0].t, t1 = Math.max(series[series.length - 1].t, t0 + bucket);
    const x = (t) => L + (W - L - 10) * (t - t0) / (t1 - t0);
    const y = (a) => H - B - a * (H - B - 10);
    chart.append(svg("polyline", { fill: "none", stroke: "#3867d6", "stroke-width": 2,
      points: series.map((p) => x(p.t) + "," + y(p.attainment)).join(" ") }));
    for (const p of series) {
      const dot = svg("circle", { cx: x(p.t), cy: y(p.attainment), r: 3, fill: "#3867d6" });
      dot.append(svg("title", {}, Math.round(p.age_s) + " s ago: " + fmt.pct(p.attainment) + " of " + p.requests));
      chart.append(dot);
    }
    chart.append(svg("text", { x: L, y: H - 4 }, Math.round(series[0].age_s) + " s ago"));
    chart.append(svg("text", { x: W - 40, y: H - 4 }, "now"));
  }

  function thresholdChart(thr) {
    const chart = $("thr-chart"); chart.replaceChildren();
    const entries = Object.entries(thr.histogram);
    if (!entries.length) { chart.append(svg("text", { x: 20, y: 90 }, "no steps in the last minute")); return; }
    const max = Math.max(...entries.map(([, n]) => n)), W = 600, H = 180, B = 20, w = (W - 20) / entries.length;
    entries.forEach(([t, n], k) => {
      const h = (H - B - 16) * n / max;
      chart.append(svg("rect", { x: 10 + k * w + 4, y: H - B - h, width: w - 8, height: h, fill: "#20bf6b" }));
      chart.append(svg("text", { x: 10 + k * w + w / 2 - 8, y: H - 4 }, t));
      chart.append(svg("text", { x: 10 + k * w + w / 2 - 8, y: H - B - h - 3 }, n));
    });
  }

  function requests(body) {
    const tbody = $("requests").querySelector("tbody");
    tbody.replaceChildren(...body.recent_requests.map((r) => el("tr", {},
      el("td", {}, el("a", { href: "/requests/" + encodeURIComponent(r.id) }, r.id)),
      el("td", { class: r.ok && r.slo_met ? "ok" : "bad" }, r.ok ? (r.slo_met ? "within SLO" : "SLO missed") : "failed: " + r.reason),
      el("td", { class: "num" }, fmt.ms(r.latency_ms)), el("td", { class: "num" }, fmt.ms(r.slo_ms)),
      el("td", { class: "num" }, r.steps), el("td", { class: "num" }, fmt.num(r.mean_threshold, 2)),
      el("td", {}, ...r.instances.map((i) => el("span", { class: "chip", style: "background:" + colour(i) + ";margin-right:4px" }, i))),
      el("td", { class: "num" }, r.migrations))));
    if (!body.recent_requests.length) tbody.append(el("tr", {}, el("td", { colspan: 8, class: "dim" }, "no request finished through this gateway yet")));
  }

  async function refresh() {
    let body;
    try { body = await getJSON("/v1/cluster"); }
    catch (e) { $("status").textContent = e.message; if (e.status === 401) { askKey(refresh); return; } setTimeout(refresh, 4000); return; }
    const s = body.slo;
    $("status").textContent = (body.ready.nats && body.ready.redis ? "connected" : "degraded") + " · " + body.models.join(", ") + " · " + new Date(body.now * 1000).toLocaleTimeString();
    $("slo-total").textContent = fmt.pct(s.attainment);
    $("slo-detail").textContent = s.met + " of " + (s.finished + s.failed) + " within SLO (" + s.failed + " failed) · mean latency " + fmt.ms(s.mean_latency_ms);
    $("slo-recent").textContent = fmt.pct(s.recent_attainment);
    $("recent-detail").textContent = "mean threshold " + fmt.num(body.thresholds.mean, 2) + " over " + body.thresholds.steps + " steps";
    $("load").textContent = body.load.in_flight + " in flight";
    $("load-detail").textContent = body.load.resident + " resident on instances, batch capacity " + body.load.capacity;
    $("tp").textContent = body.instances.length + " instance" + (body.instances.length === 1 ? "" : "s");
    $("tp-detail").textContent = Object.entries(body.tp_degrees).map(([tp, n]) => n + " × TP-" + tp).join(", ") || "none";
    const uncalibrated = Object.entries(body.calibration || {}).filter(([, c]) => !c.calibrated);
    $("calibration").hidden = !uncalibrated.length;
    $("calibration").textContent = uncalibrated.map(([m, c]) => m + " is uncalibrated: served at the highest candidate threshold only, planned with the step times its workers measure. Calibrate it: " + c.how_to).join(" ");
    instances(body); sloChart(s.series, s.bucket_s); thresholdChart(body.thresholds); requests(body);
    document.body.dataset.loaded = "1";
    setTimeout(refresh, 2000);
  }
  refresh();
})();
