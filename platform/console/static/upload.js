// The Adapters page's upload form, sent with XMLHttpRequest so that a progress bar can follow the upload (fetch
// reports no upload progress). The server answers this script in JSON: the new adapter, or problem JSON whose
// `detail` says what is wrong. Without this script the form posts normally and the page comes back with the result.
"use strict";

(() => {
  const form = document.querySelector("form[data-upload]");
  if (form === null) {
    return;
  }
  const progressBox = form.querySelector("[data-progress]");
  const progress = progressBox.querySelector("progress");
  const percent = progressBox.querySelector("[data-percent]");
  const result = form.querySelector("[data-result]");
  const submit = form.querySelector("button[type=submit]");
  const token = document.querySelector('meta[name="csrf-token"]').content;

  function size(numBytes) {
    // As the page's `size` filter writes it: 512 B, 1.5 KiB, 7.63 MiB.
    if (numBytes < 1024) {
      return `${numBytes} B`;
    }
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    const exponent = Math.min(Math.floor(Math.log(numBytes) / Math.log(1024)), 4);
    return `${(numBytes / 1024 ** exponent).toFixed(exponent < 2 ? 1 : 2)} ${units[exponent]}`;
  }

  function show(message, ok) {
    result.textContent = message;
    result.className = ok ? "upload-result notice" : "upload-result notice bad";
    result.setAttribute("role", ok ? "status" : "alert");
    result.hidden = false;
  }

  function setProgress(fraction) {
    const value = Math.round(fraction * 100);
    progress.value = value;
    percent.textContent = `${value}%`;
  }

  async function refreshList() {
    // The list as the server renders it, so the new row looks exactly like the others.
    const answer = await fetch(window.location.pathname, { headers: { Accept: "text/html" } });
    if (!answer.ok) {
      return;
    }
    const fresh = new DOMParser().parseFromString(await answer.text(), "text/html");
    const list = fresh.querySelector("[data-adapter-list]");
    const current = document.querySelector("[data-adapter-list]");
    if (list !== null && current !== null) {
      current.replaceWith(document.importNode(list, true));
    }
  }

  function answered(xhr) {
    let body = null;
    try {
      body = JSON.parse(xhr.responseText);
    } catch {
      body = null;
    }
    if (xhr.status === 201 && body !== null && body.object === "adapter") {
      setProgress(1);
      percent.textContent = "100%: validated";
      show(`Uploaded ${body.name} v${body.version}: ${body.status}, rank ${body.rank}, ${size(body.size_bytes)}.`, true);
      form.reset();
      refreshList().catch(() => {});
      return;
    }
    const detail = body !== null && typeof body.detail === "string" ? body.detail : `The server answered ${xhr.status}.`;
    percent.textContent = "refused";
    show(`Not uploaded: ${detail}`, false);
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    // Messages of an earlier upload (the server-rendered ones too) are about another upload now.
    for (const old of document.querySelectorAll("[data-upload-outcome] > *")) {
      old.remove();
    }
    const data = new FormData(form);
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.setRequestHeader("X-CSRF-Token", token);
    xhr.setRequestHeader("Accept", "application/json");
    xhr.upload.addEventListener("progress", (progressEvent) => {
      if (progressEvent.lengthComputable && progressEvent.total > 0) {
        setProgress(progressEvent.loaded / progressEvent.total);
      }
    });
    xhr.upload.addEventListener("load", () => {
      setProgress(1);
      percent.textContent = "100%: validating…";
    });
    xhr.addEventListener("load", () => {
      submit.disabled = false;
      answered(xhr);
    });
    xhr.addEventListener("error", () => {
      submit.disabled = false;
      percent.textContent = "failed";
      show("Not uploaded: the connection to the server failed. Try again.", false);
    });
    setProgress(0);
    progressBox.hidden = false;
    result.hidden = true;
    submit.disabled = true;
    xhr.send(data);
  });
})();
