// Shared by the dashboard and the timeline: JSON from the gateway's /v1 routes, with the API key
// (asked for on a 401, kept in sessionStorage; a #key=... fragment, never sent to the server, pre-fills it).
"use strict";
const DLS = (() => {
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (fragment.get("key")) { sessionStorage.setItem("dls-key", fragment.get("key")); history.replaceState(null, "", location.pathname + location.search); }
  const palette = ["#3867d6", "#20bf6b", "#fa8231", "#8854d0", "#eb3b5a", "#0fb9b1", "#f7b731", "#4b6584"];
  const colours = new Map();
  function colour(id) { if (!colours.has(id)) colours.set(id, palette[colours.size % palette.length]); return colours.get(id); }
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) { if (k === "class") node.className = v; else if (k === "style") node.style.cssText = v; else node.setAttribute(k, v); }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
    return node;
  }
  function askKey(onKey) {
    const box = document.getElementById("keybox");
    box.classList.add("show");
    box.querySelector("button").onclick = () => { sessionStorage.setItem("dls-key", box.querySelector("input").value.trim()); box.classList.remove("show"); onKey(); };
  }
  async function getJSON(path) {
    const key = sessionStorage.getItem("dls-key");
    const reply = await fetch(path, { headers: key ? { Authorization: "Bearer " + key } : {} });
    if (reply.status === 401) { const e = new Error("API key needed"); e.status = 401; throw e; }
    const body = await reply.json();
    if (!reply.ok) { const e = new Error((body.error && body.error.message) || reply.statusText); e.status = reply.status; throw e; }
    return body;
  }
  const fmt = {
    pct: (v) => v == null ? "–" : (100 * v).toFixed(1) + "%",
    ms: (v) => v == null ? "–" : v >= 10000 ? (v / 1000).toFixed(1) + " s" : Math.round(v) + " ms",
    num: (v, d = 2) => v == null ? "–" : Number(v).toFixed(d),
  };
  return { colour, el, askKey, getJSON, fmt };
})();
