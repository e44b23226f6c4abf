// The playground: a chat with one model, kept in this page's memory only (a reload or "New chat" starts over).
// Each Send posts the system prompt and the whole conversation as an OpenAI chat completion request, streamed, to
// the console's chat path (the API's own handler, for the key this session signed in with), and writes the reply's
// text into the page as it arrives: always as text (textContent), never as markup, since a model writes anything.
// A reasoning model's think block (the deltas' reasoning_content) is shown apart, above its answer.
"use strict";

(() => {
  const form = document.getElementById("chat-form");
  if (form === null) {
    return;
  }
  const chatPath = form.dataset.chatPath;
  const csrfToken = document.querySelector('meta[name="csrf-token"]').content;
  const log = document.getElementById("chat-log");
  const model = document.getElementById("model");
  const system = document.getElementById("system");
  const maxTokens = document.getElementById("max-tokens");
  const temperature = document.getElementById("temperature");
  const message = document.getElementById("message");
  const send = document.getElementById("send");
  const status = document.getElementById("chat-status");
  const numbers = new Intl.NumberFormat("en-US");

  let conversation = []; // the user's and the model's messages so far, oldest first (the system prompt apart)
  let chat = 0; // which chat this is: a reply that arrives after "New chat" belongs to none
  let running = null; // the AbortController of the reply being streamed

  function counted(count, singular, plural) {
    return `${numbers.format(count)} ${count === 1 ? singular : (plural || `${singular}s`)}`;
  }

  function addTurn(role, who) {
    const turn = document.createElement("div");
    turn.className = `turn ${role}`;
    const label = document.createElement("div");
    label.className = "who";
    label.textContent = who;
    const text = document.createElement("div");
    text.className = "text";
    turn.append(label, text);
    log.append(turn);
    return { turn, text };
  }

  function showUsage(reply, usage) {
    const line = document.createElement("div");
    line.className = "usage";
    if (usage) {
      const prompt = usage.prompt_tokens || 0;
      const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
      const completion = usage.completion_tokens || 0;
      const reasoning = (usage.completion_tokens_details && usage.completion_tokens_details.reasoning_tokens) || 0;
      line.dataset.promptTokens = String(prompt);
      line.dataset.cachedTokens = String(cached);
      line.dataset.completionTokens = String(completion);
      line.dataset.reasoningTokens = String(reasoning);
      const counts = [
        counted(prompt, "prompt token"),
        counted(cached, "cached token"),
        counted(completion, "completion token"),
      ];
      if (reasoning > 0) {
        counts.push(`${counted(reasoning, "reasoning token")} of them`);
      }
      line.textContent = counts.join(" · ");
    } else {
      line.textContent = "No token counts came back with this reply.";
    }
    reply.turn.append(line);
  }

  function showError(reply, text) {
    const line = document.createElement("p");
    line.className = "error";
    line.setAttribute("role", "alert");
    line.textContent = text;
    reply.turn.classList.add("failed");
    reply.turn.append(line);
  }

  async function errorMessage(response) {
    const fallback = `The request failed (HTTP ${response.status}).`;
    try {
      const body = await response.json();
      // The console's errors carry `detail` (problem details); the API's, `error.message` (OpenAI's envelope).
      return (body.error && body.error.message) || body.detail || body.message || fallback;
    } catch {
      return fallback;
    }
  }

  // Posts `body` and streams its answer into `reply`: resolves to the reply's text and its usage (the last chunk's,
  // as stream_options.include_usage asks), or throws an Error whose message is the one to show.
  async function stream(body, reply, signal) {
    const response = await fetch(chatPath, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrfToken, Accept: "text/event-stream" },
      body: JSON.stringify(body),
      credentials: "same-origin",
      signal,
    });
    if (!response.ok) {
      throw new Error(await errorMessage(response));
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let text = "";
    let thought = "";
    let usage = null;
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value, { stream: !done }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data === "") {
          continue;
        }
        if (data === "[DONE]") {
          return { text, usage };
        }
        const chunk = JSON.parse(data);
        if (chunk.error) {
          throw new Error(chunk.error.message || "The model failed while answering.");
        }
        for (const choice of chunk.choices || []) {
          const thinking = choice.delta && choice.delta.reasoning_content;
          if (thinking) {
            thought += thinking;
            if (!reply.thinking) {
              reply.thinking = document.createElement("div");
              reply.thinking.className = "thinking";
              reply.turn.insertBefore(reply.thinking, reply.text);
            }
            reply.thinking.textContent = thought;
          }
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            text += piece;
            reply.text.textContent = text;
          }
        }
        if (chunk.usage) {
          usage = chunk.usage;
        }
      }
      if (done) {
        throw new Error("The reply ended before it was complete.");
      }
    }
  }

  function setBusy(busy) {
    send.disabled = busy;
    status.textContent = busy ? "Answering…" : "";
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (running !== null) {
      return;
    }
    const text = message.value;
    if (text.trim() === "") {
      status.textContent = "Write a message first.";
      message.focus();
      return;
    }
    if (model.value === "") {
      status.textContent = "There is no model to send it to.";
      return;
    }
    const user = { role: "user", content: text };
    const messages = system.value.trim() === "" ? [] : [{ role: "system", content: system.value }];
    messages.push(...conversation, user);
    const body = {
      model: model.value,
      messages,
      max_tokens: Number(maxTokens.value),
      temperature: Number(temperature.value),
      stream: true,
      stream_options: { include_usage: true },
    };
    addTurn("user", "You").text.textContent = text;
    const reply = addTurn("assistant", model.value);
    message.value = "";
    const thisChat = chat;
    running = new AbortController();
    setBusy(true);
    try {
      const answer = await stream(body, reply, running.signal);
      if (thisChat === chat) {
        conversation.push(user, { role: "assistant", content: answer.text });
        if (answer.text === "") {
          reply.text.textContent = "(an empty reply)";
        }
        showUsage(reply, answer.usage);
      }
    } catch (error) {
      if (thisChat === chat) {
        showError(reply, error.name === "AbortError" ? "Stopped." : error.message);
        if (message.value === "") {
          message.value = text; // so that it can be sent again
        }
      }
    } finally {
      running = null;
      setBusy(false);
    }
  });

  document.getElementById("new-chat").addEventListener("click", () => {
    chat += 1;
    if (running !== null) {
      running.abort();
    }
    conversation = [];
    log.replaceChildren();
    status.textContent = "";
    message.focus();
  });

  message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
})();
