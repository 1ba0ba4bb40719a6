// draws every figure of the page in turn (one per frame, so a long report stays responsive); the shared
// plotly templates are stored once and put back into each layout
(function () {
  var banner = document.getElementById("wb-plotly-banner");
  var plots = Array.prototype.slice.call(document.querySelectorAll("div.wb-plot[data-figure]"));
  if (typeof window.Plotly === "undefined") {
    banner.hidden = false;
    plots.forEach(function (el) { el.style.height = "auto"; el.innerHTML = banner.innerHTML; });
    return;
  }
  var templates = JSON.parse(document.getElementById("wb-templates").textContent);
  function next() {
    var el = plots.shift(); if (!el) { document.body.setAttribute("data-plots-drawn", "1"); return; }
    var f = JSON.parse(document.getElementById(el.getAttribute("data-figure")).textContent);
    if (f.layout && typeof f.layout.template === "string") f.layout.template = templates[f.layout.template];
    window.Plotly.newPlot(el, f.data, f.layout, {responsive: true, displaylogo: false})
      .then(function () { el.setAttribute("data-drawn", "1"); window.requestAnimationFrame(next); },
            function (e) { el.textContent = "this figure could not be drawn: " + e; window.requestAnimationFrame(next); });
  }
  next();
})();
