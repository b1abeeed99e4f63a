// The dashboard's only script: the overview refreshes its panel, and the
// dead letters' header box selects every row.
(function () {
  var panel = document.getElementById("panel");
  if (panel) {
    var every = parseInt(panel.dataset.refresh, 10) || 5000;
    setInterval(function () {
      fetch("?partial=1", { credentials: "same-origin", headers: { Accept: "text/html" } })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) { if (html !== null) { panel.innerHTML = html; } })
        .catch(function () {});
    }, every);
  }
  var all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", function () {
      document.querySelectorAll("input.pick").forEach(function (b) { b.checked = all.checked; });
    });
  }
})();
