// kimik3 atlas: formulas (KaTeX, vendored), diagram hover/click/keyboard, selection kept in the URL (#sel=<id>).
"use strict";
(function () {
  const KATEX = {
    displayMode: true, throwOnError: true, strict: "ignore",
    trust: (ctx) => ctx.command === "\\htmlData" || ctx.command === "\\htmlClass",
  };
  const root = document.body.dataset.root || "";
  const onIndex = !!document.getElementById("diagram");

  function renderMath() {
    document.querySelectorAll(".tex[data-tex]").forEach((el) => {
      katex.render(el.dataset.tex, el, KATEX);
    });
    document.querySelectorAll(".tex [data-node]").forEach((el) => {
      el.addEventListener("click", () => {
        if (onIndex) select(el.dataset.node, true);
        else window.location.href = root + "c/" + el.dataset.node + ".html";
      });
    });
  }

  function select(id, push) {
    const target = id && document.querySelector('#diagram .node[data-id="' + id + '"]');
    document.querySelectorAll("#diagram .node.sel").forEach((n) => n.classList.remove("sel"));
    document.querySelectorAll(".tex .lit").forEach((n) => n.classList.remove("lit"));
    document.querySelectorAll("#panel .pane").forEach((p) => { p.hidden = true; });
    const pane = id && document.getElementById("p-" + id);
    const none = document.getElementById("p-none");
    if (pane) { pane.hidden = false; none.hidden = true; } else { none.hidden = false; }
    if (target) target.classList.add("sel");
    if (id) document.querySelectorAll('.tex [data-node="' + id + '"]').forEach((n) => n.classList.add("lit"));
    const hash = id && pane ? "#sel=" + id : "";
    if (push && window.location.hash !== hash) history.pushState(null, "", hash || window.location.pathname);
  }

  function fromHash() {
    const m = /sel=([A-Za-z0-9_]+)/.exec(window.location.hash);
    select(m ? m[1] : null, false);
  }

  function wireDiagram() {
    const tip = document.getElementById("tip");
    document.querySelectorAll("#diagram .node").forEach((g) => {
      const title = g.querySelector("title");
      const text = title ? title.textContent : "";
      g.addEventListener("mouseenter", (ev) => {
        tip.textContent = text; tip.hidden = false; place(ev);
      });
      g.addEventListener("mousemove", place);
      g.addEventListener("mouseleave", () => { tip.hidden = true; });
      g.addEventListener("click", () => select(g.dataset.id, true));
      g.addEventListener("keydown", (ev) => {
        if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); select(g.dataset.id, true); }
      });
    });
    function place(ev) {
      tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - 360) + "px";
      tip.style.top = ev.clientY + 14 + "px";
    }
    window.addEventListener("popstate", fromHash);
    window.addEventListener("hashchange", fromHash);
    fromHash();
  }

  document.addEventListener("DOMContentLoaded", () => {
    renderMath();
    if (onIndex) wireDiagram();
  });
})();
