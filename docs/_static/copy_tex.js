// The copy-as-LaTeX button beside each display equation (docs/conf.py adds the buttons; each
// carries its equation's TeX source in data-tex). A click puts that source on the clipboard.
"use strict";

function attnrefCopyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    return navigator.clipboard.writeText(text);
  }
  // file:// pages and old browsers: a selected, off-screen textarea and execCommand("copy").
  return new Promise((resolve, reject) => {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.left = "-9999px";
    document.body.appendChild(area);
    area.select();
    const ok = document.execCommand("copy");
    document.body.removeChild(area);
    if (ok) {
      resolve();
    } else {
      reject(new Error("copy refused"));
    }
  });
}

function attnrefCopyButtons() {
  for (const button of document.querySelectorAll("button.copy-tex")) {
    const label = button.textContent;
    button.addEventListener("click", () => {
      attnrefCopyText(button.dataset.tex).then(
        () => { button.textContent = "Copied"; },
        () => { button.textContent = "Copy failed"; },
      );
      setTimeout(() => { button.textContent = label; }, 1500);
    });
  }
}

if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", attnrefCopyButtons);
} else {
  attnrefCopyButtons();
}
