// Shared by every console page: copy buttons. <button data-copy="ID"> copies the text of the element with that id.
"use strict";

document.addEventListener("click", async (event) => {
  const button = event.target instanceof Element ? event.target.closest("button[data-copy]") : null;
  if (button === null) {
    return;
  }
  event.preventDefault();
  const source = document.getElementById(button.dataset.copy);
  if (source === null) {
    return;
  }
  const text = source.textContent.trim();
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard permission (plain http on another host, say): select the text so Ctrl+C copies it.
    const range = document.createRange();
    range.selectNodeContents(source);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = label; }, 1500);
});
