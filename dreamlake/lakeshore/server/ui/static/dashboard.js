// The dashboard's own script (a file: the dashboard's Content-Security-Policy allows no inline
// script). Two jobs:
// - the live output (#output) follows its tail as htmx swaps the invocation fragment in every
//   second, unless the reader scrolled up (then it stays where they are);
// - the overview's charts (.chart[data-chart], JSON made by server/ui/charts.py) are drawn with
//   uPlot (uPlot.iife.min.js, vendored), again after each swap of their fragment.
(function () {
  "use strict";
  var FOLLOW_SLACK_PX = 24;
  var follow = true;
  var COLORS = ["#1e4e8c", "#b5481c", "#1b6b2f", "#7a3fa0", "#8a6d00", "#0f7173", "#555"];

  function output() { return document.getElementById("output"); }

  function atBottom(el) { return el.scrollHeight - el.scrollTop - el.clientHeight <= FOLLOW_SLACK_PX; }

  function keepTail() {
    var el = output();
    if (el && follow) { el.scrollTop = el.scrollHeight; }
    if (el) { el.dataset.following = follow ? "yes" : "no"; }
  }

  function drawCharts(root) {
    if (typeof uPlot === "undefined") { return; }
    var boxes = (root || document).querySelectorAll(".chart[data-chart]:not([data-drawn])");
    boxes.forEach(function (box) {
      var spec;
      try { spec = JSON.parse(box.dataset.chart); } catch (e) { return; }
      box.textContent = "";
      box.dataset.drawn = "yes";
      if (!spec.series.length) {
        var p = document.createElement("p");
        p.className = "muted empty-chart";
        p.textContent = "no activity in the last hour";
        box.appendChild(p);
        return;
      }
      var stepped = spec.kind === "bars" ? uPlot.paths.stepped({ align: 1 }) : undefined;
      var series = [{}].concat(spec.series.map(function (s, i) {
        var color = COLORS[i % COLORS.length];
        return { label: s.label, stroke: color, fill: color + "22", width: 2, paths: stepped };
      }));
      var data = [spec.x].concat(spec.series.map(function (s) { return s.values; }));
      var opts = {
        width: Math.max(320, box.clientWidth || 560),
        height: 200,
        series: series,
        scales: { x: { time: true }, y: { range: function (u, lo, hi) { return [0, Math.max(1, hi)]; } } },
        axes: [{}, { size: 48 }],
        cursor: { drag: { x: false, y: false } },
      };
      box.uplot = new uPlot(opts, data, box);
    });
  }

  document.addEventListener("htmx:beforeSwap", function () {
    var el = output();
    follow = !el || atBottom(el);
  });
  document.addEventListener("htmx:afterSettle", function (evt) {
    keepTail();
    drawCharts(document);
  });
  document.addEventListener("scroll", function (evt) {
    if (evt.target === output()) { follow = atBottom(evt.target); keepTail(); }
  }, true);
  document.addEventListener("DOMContentLoaded", function () { keepTail(); drawCharts(document); });
})();
