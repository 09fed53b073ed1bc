// Partial refresh without full page reloads: every element with data-live="URL" is
// re-fetched every data-interval seconds (same origin, session cookie) and its inner HTML
// replaced. Paused while the tab is hidden or while the user is typing in it.
(function () {
  "use strict";
  function refresh(el) {
    if (document.hidden || el.contains(document.activeElement)) return;
    if (el.dataset.busy === "1") return;
    el.dataset.busy = "1";
    fetch(el.dataset.live, {
      credentials: "same-origin",
      headers: { "X-Requested-With": "fetch", "Accept": "text/html" },
      cache: "no-store",
      redirect: "error",
    })
      .then(function (r) {
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.text();
      })
      .then(function (html) {
        el.innerHTML = html;
        el.classList.remove("stale");
        el.dataset.updated = String(Date.now());
        el.dispatchEvent(new CustomEvent("live:updated", { bubbles: true }));
      })
      .catch(function () {
        el.classList.add("stale");
      })
      .finally(function () {
        el.dataset.busy = "0";
      });
  }
  function start() {
    document.querySelectorAll("[data-live]").forEach(function (el) {
      var secs = Math.max(1, parseFloat(el.dataset.interval || "5"));
      setInterval(function () { refresh(el); }, secs * 1000);
    });
    document.addEventListener("visibilitychange", function () {
      if (!document.hidden) document.querySelectorAll("[data-live]").forEach(refresh);
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
