/* attnkit's interactive attention views (attnkit.viz.head_view): plain JavaScript, no
 * library, nothing loaded from the network.
 *
 * A head view is a <div class="ak-head-view"> holding its data as JSON in a script element
 * of type application/json and class ak-data: {"layers": [...], "heads": [...], "left": [...],
 * "right": [...], "weights": [layer][head][query][key], "layer": 0, "selected": [...]}.
 * It draws the query tokens on the left, the key tokens on the right and, for every selected
 * head of the shown layer, one line per non-zero weight, its opacity the weight and its colour
 * the head's. A click on a head's button shows or hides that head, a double click shows it
 * alone; the layer menu switches layers (the selected heads stay selected); pointing at a token
 * shows only its lines. The view's state is mirrored on the div as data-layer and data-heads.
 */
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
  ];
  var ROW = 20; // pixels per token row
  var GAP = 220; // pixels between the two token columns, where the lines run
  var PAD = 8; // pixels between a token's text and the end of its lines

  function colour(head) {
    return PALETTE[head % PALETTE.length];
  }

  function make(tag, attrs, parent, ns) {
    var node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) {
      node.setAttribute(key, attrs[key]);
    });
    if (parent) parent.appendChild(node);
    return node;
  }

  function HeadView(root) {
    var data = JSON.parse(root.querySelector("script.ak-data").textContent);
    var state = {
      layer: data.layer,
      selected: data.selected.slice(),
      focus: null, // {side: "left" | "right", index}
    };
    var controls = make("div", { class: "ak-controls" }, root);
    var layerLabel = make("label", { class: "ak-layer-label" }, controls);
    layerLabel.appendChild(document.createTextNode("Layer "));
    var menu = make("select", { class: "ak-layer" }, layerLabel);
    data.layers.forEach(function (name, i) {
      var option = make("option", { value: String(i) }, menu);
      option.textContent = name;
    });
    menu.value = String(state.layer);
    if (data.layers.length < 2) menu.disabled = true;
    var chips = make("span", { class: "ak-heads" }, controls);
    chips.appendChild(document.createTextNode(" Heads "));
    var buttons = data.heads.map(function (name, h) {
      var button = make("button", { type: "button", class: "ak-head", "data-head": String(h),
        title: name + " (click: show or hide; double click: this head alone)" }, chips);
      button.style.setProperty("--ak-colour", colour(h));
      button.textContent = name;
      button.addEventListener("click", function () {
        var at = state.selected.indexOf(h);
        if (at >= 0) state.selected.splice(at, 1);
        else state.selected.push(h);
        draw();
      });
      button.addEventListener("dblclick", function () {
        state.selected = [h];
        draw();
      });
      return button;
    });
    menu.addEventListener("change", function () {
      state.layer = Number(menu.value);
      draw();
    });

    var rows = Math.max(data.left.length, data.right.length);
    var svg = make("svg", { class: "ak-lines", height: String(rows * ROW + 10) }, root, SVG);
    var linesGroup = make("g", { class: "ak-line-group" }, svg, SVG);
    function tokens(list, side) {
      return list.map(function (text, i) {
        var node = make("text", { class: "ak-token ak-" + side, "data-index": String(i),
          y: String(i * ROW + ROW * 0.75) }, svg, SVG);
        node.textContent = text;
        node.addEventListener("mouseenter", function () {
          state.focus = { side: side, index: i };
          draw();
        });
        node.addEventListener("mouseleave", function () {
          state.focus = null;
          draw();
        });
        return node;
      });
    }
    var left = tokens(data.left, "left");
    var right = tokens(data.right, "right");
    function widest(nodes) {
      return nodes.reduce(function (w, node) {
        return Math.max(w, node.getComputedTextLength ? node.getComputedTextLength() : 0);
      }, 0);
    }
    var leftWidth = Math.ceil(widest(left)) + 4;
    var x0 = leftWidth + PAD;
    var x1 = leftWidth + GAP - PAD;
    left.forEach(function (node) {
      node.setAttribute("x", String(leftWidth));
      node.setAttribute("text-anchor", "end");
    });
    right.forEach(function (node) {
      node.setAttribute("x", String(leftWidth + GAP));
    });
    svg.setAttribute("width", String(leftWidth + GAP + Math.ceil(widest(right)) + 8));

    function draw() {
      while (linesGroup.firstChild) linesGroup.removeChild(linesGroup.firstChild);
      var layer = data.weights[state.layer];
      var heads = state.selected.slice().sort(function (a, b) { return a - b; });
      heads.forEach(function (h) {
        var matrix = layer[h];
        for (var i = 0; i < matrix.length; i++) {
          if (state.focus && state.focus.side === "left" && state.focus.index !== i) continue;
          for (var j = 0; j < matrix[i].length; j++) {
            if (state.focus && state.focus.side === "right" && state.focus.index !== j) continue;
            var w = matrix[i][j];
            if (!(w > 0)) continue; // an exact zero (sparse alignments, masks) draws nothing
            make("line", {
              class: "ak-line", x1: String(x0), y1: String(i * ROW + ROW / 2),
              x2: String(x1), y2: String(j * ROW + ROW / 2), stroke: colour(h),
              "stroke-opacity": String(w), "data-head": String(h), "data-query": String(i),
              "data-key": String(j),
            }, linesGroup, SVG);
          }
        }
      });
      buttons.forEach(function (button, h) {
        var on = state.selected.indexOf(h) >= 0;
        button.setAttribute("aria-pressed", on ? "true" : "false");
      });
      [["left", left], ["right", right]].forEach(function (pair) {
        pair[1].forEach(function (node, i) {
          var focused = state.focus && state.focus.side === pair[0] && state.focus.index === i;
          node.classList.toggle("ak-focus", Boolean(focused));
        });
      });
      root.setAttribute("data-layer", String(state.layer));
      root.setAttribute("data-heads", heads.join(","));
    }
    draw();
  }

  function start() {
    var views = document.querySelectorAll("div.ak-head-view:not([data-ready])");
    Array.prototype.forEach.call(views, function (root) {
      root.setAttribute("data-ready", "true");
      HeadView(root);
    });
  }

  window.attnkitViews = { start: start };
  // The views already parsed are drawn now (the script placed after them); views further down
  // the page when the document has loaded.
  start();
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
})();
