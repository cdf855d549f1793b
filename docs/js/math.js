/* Renders the pages' equations with the KaTeX copy shipped beside the site (docs/vendor/katex):
 * pymdownx.arithmatex leaves inline math as <span class="arithmatex">\(…\)</span> and display
 * math as <div class="arithmatex">\[…\]</div>. A formula KaTeX cannot read is shown as its
 * source in red (class katex-error) rather than stopping the page. */
(function () {
  "use strict";
  function render() {
    var nodes = document.querySelectorAll(".arithmatex");
    Array.prototype.forEach.call(nodes, function (node) {
      var tex = node.textContent.trim();
      var display = node.tagName === "DIV";
      if (/^\\[(\[]/.test(tex) && /\\[)\]]$/.test(tex)) tex = tex.slice(2, -2);
      window.katex.render(tex, node, { displayMode: display, throwOnError: false });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", render);
  else render();
})();
