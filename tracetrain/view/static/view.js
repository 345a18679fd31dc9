// tracetrain view: token details on hover and click; the run page follows a run that trains.
"use strict";
function detail(t) {
  const d = t.dataset, parts = [t.className.replace("tok ", "").replace(" selected", ""), "id " + d.id];
  if (d.w !== undefined) parts.push("weight " + Number(d.w).toPrecision(4));
  if (d.a !== undefined) parts.push("advantage " + (d.a === "None" ? "-" : Number(d.a).toFixed(4)));
  if (d.da !== undefined) parts.push("= distillation " + Number(d.da).toFixed(4));
  if (d.ra !== undefined) parts.push((d.da !== undefined ? "+ reward " : "reward-based ") + Number(d.ra).toFixed(4));
  if (d.lp !== undefined) parts.push("engine logprob " + d.lp);
  if (d.tlp !== undefined) parts.push("teacher logprob " + d.tlp);
  if (d.turn !== undefined) parts.push("turn " + d.turn);
  if (d.pos !== undefined) parts.push("prompt position " + d.pos);
  parts.push("text " + JSON.stringify(t.textContent));
  return parts.join(" · ");
}
document.addEventListener("DOMContentLoaded", () => {
  const panel = document.getElementById("token-detail");
  if (panel) {
    let chosen = null;
    const show = (e, keep) => {
      const t = e.target.closest(".tok[data-id]");
      if (!t) return;
      if (keep) { if (chosen) chosen.classList.remove("selected"); chosen = t; t.classList.add("selected"); }
      else if (chosen) return;
      panel.textContent = detail(t);  // text, never markup
    };
    document.addEventListener("mouseover", (e) => show(e, false));
    document.addEventListener("click", (e) => show(e, true));
  }
  const summary = document.getElementById("run-summary");
  if (summary) {
    const seen = summary.dataset.steps;
    setInterval(async () => {
      try {
        const r = await fetch("/api/status", {cache: "no-store"});
        if (r.ok && String((await r.json()).steps) !== seen) location.reload();
      } catch (err) { /* the viewer stopped: keep the page */ }
    }, 3000);
  }
});
