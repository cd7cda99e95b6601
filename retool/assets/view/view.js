"use strict";
// retool view: renders the embedded trajectories. Every string from the data goes
// through textContent (never innerHTML): model and interpreter text is hostile.

const filters = { correct: "all", tool: "all", warn: "all" };

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) el.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

async function decodePayload(text) {
  const bytes = Uint8Array.from(atob(text.trim()), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}

function fmt(value, digits) {
  return value === null || value === undefined ? "—" : Number(value).toFixed(digits);
}

function signClass(advantage) {
  if (advantage === null || advantage === undefined) return "nil";
  return advantage > 0 ? "pos" : advantage < 0 ? "neg" : "zero";
}

function summaryLine(item) {
  return h("summary", {},
    h("span", { class: "badge " + (item.correct ? "yes" : "no") }, item.correct ? "correct" : "incorrect"),
    h("span", { class: "pid" }, item.pid),
    h("span", { class: "src" }, item.src),
    h("span", { class: "num" }, "reward " + fmt(item.reward, 2)),
    h("span", { class: "num" }, "advantage " + fmt(item.adv, 3)),
    h("span", { class: "num" }, item.calls + " code call" + (item.calls === 1 ? "" : "s") +
      (item.attempts > item.calls ? " (+" + (item.attempts - item.calls) + " not run)" : "")),
    h("span", { class: "num" }, item.turns.length + " turn" + (item.turns.length === 1 ? "" : "s")),
    h("span", { class: "num" }, item.ids.length + " tokens"),
    h("span", { class: "meta" }, "stop: " + item.stop),
    item.formatted ? null : h("span", { class: "badge warn" }, "no \\boxed{}"),
    item.orig ? h("span", { class: "badge " + (flipped(item) ? "warn" : "was") },
      (flipped(item) ? "regraded: was " : "before regrade: ") + verdict(item.orig)) : null,
    item.warn.length ? h("span", { class: "badge warn" }, item.warn.length + " mask warning(s)") : null);
}

function verdict(grade) {
  return grade.correct ? "correct" : grade.formatted ? "incorrect" : "no answer";
}

function flipped(item) {
  return item.orig !== null && item.orig !== undefined && verdict(item.orig) !== verdict(item);
}

function problemSection(item) {
  const parts = [h("h3", {}, "problem")];
  if (item.q !== null) parts.push(h("pre", { class: "text" }, item.q));
  else if (item.prompt !== null) parts.push(h("pre", { class: "text" }, item.prompt));
  else parts.push(h("p", { class: "meta" }, "The question is not stored with training trajectories; " +
    "pass --tokenizer to `retool view` to decode the prompt."));
  if (item.gold !== null) parts.push(h("p", {}, "reference answer: ", h("code", {}, item.gold)));
  return parts;
}

function callSection(turn) {
  const call = turn.call;
  const parts = [];
  if (call.kind === "valid") {
    parts.push(h("div", { class: "meta" }, "code call"), h("pre", { class: "code" }, call.code));
  } else {
    parts.push(h("div", { class: "meta" }, "invalid call (" + call.reason + ")"),
      h("pre", { class: "code" }, call.raw));
  }
  const status = turn.status || (call.kind === "valid" ? "not run" : "invalid");
  parts.push(h("div", { class: "meta" }, "interpreter ",
    h("span", { class: "badge status-" + status.replace(/[^a-z_]/g, "") }, status),
    turn.exit_code !== null && turn.exit_code !== undefined ? " exit " + turn.exit_code : "",
    " · " + fmt(turn.latency, 3) + " s", turn.truncated ? " · output truncated" : ""),
  h("pre", { class: "output" }, turn.response));
  return parts;
}

function turnsSection(item) {
  const parts = [h("h3", {}, "reasoning and code calls")];
  item.turns.forEach((turn, i) => {
    const box = h("div", { class: "turn" },
      h("div", { class: "meta" }, "turn " + (i + 1) + " · " + turn.n + " tokens · stop: " + turn.stop),
      h("pre", { class: "text" }, turn.text));
    if (turn.call) box.append(...callSection(turn));
    parts.push(box);
  });
  return parts;
}

function answerSection(item) {
  return [h("h3", {}, "final answer"),
    h("p", {}, "answer: ", h("code", {}, item.pred === null ? "(none)" : item.pred),
      " · reward " + fmt(item.reward, 3) + " · " + (item.correct ? "correct" : "incorrect") +
      " · " + (item.formatted ? "formatted" : "no \\boxed{}"),
      item.grader_error ? " · grader error: " + item.grader_error : ""),
    item.orig ? h("p", { class: "meta" }, "before regrade: answer ",
      h("code", {}, item.orig.pred === null ? "(none)" : item.orig.pred),
      " · reward " + fmt(item.orig.reward, 3) + " · " + verdict(item.orig)) : null];
}

function tokenSection(item, vocab) {
  const policy = item.mask.filter((m) => m === 1).length;
  const parts = [h("h3", {}, "tokens"),
    h("p", { class: "meta" }, item.ids.length + " tokens · " + policy + " policy (mask sum) · " +
      (item.ids.length - policy) + " masked · prompt " + item.prompt_len +
      " · advantage on policy tokens " + fmt(item.adv, 3))];
  if (item.warn.length) {
    parts.push(h("ul", { class: "warnings" }, ...item.warn.map((w) => h("li", {}, w))));
  }
  const box = h("div", { class: "tokens" });
  const sign = signClass(item.adv);
  const frag = document.createDocumentFragment();
  for (let i = 0; i < item.ids.length; i++) {
    const id = item.ids[i], m = item.mask[i];
    const span = document.createElement("span");
    span.className = m === 1 ? "tok pol " + sign : m === 0 ? "tok msk" : "tok bad";
    let text = vocab ? vocab[id] : id + " ";
    if (text === null || text === undefined) text = "⟨" + id + "⟩";
    span.textContent = text === "" ? "∅" : text;
    const advantage = m === 1 ? fmt(item.adv, 3) : "0";
    span.title = "#" + i + " · id " + id + " · mask " + m + " · logprob " + fmt(item.lp[i], 3) +
      " · advantage " + advantage;
    frag.append(span);
  }
  box.append(frag);
  parts.push(box);
  return parts;
}

function card(item, vocab) {
  const details = h("details", {
    class: "traj",
    "data-correct": item.correct ? "yes" : "no",
    "data-tool": item.calls > 0 ? "yes" : "no",
    "data-warn": item.warn.length ? "yes" : "no",
  }, summaryLine(item));
  details.addEventListener("toggle", () => {
    if (!details.open || details.dataset.rendered) return;
    details.dataset.rendered = "1";
    details.append(h("div", { class: "body" }, ...problemSection(item), ...turnsSection(item),
      ...answerSection(item), ...tokenSection(item, vocab)));
  });
  return details;
}

function applyFilters() {
  const cards = document.querySelectorAll("details.traj");
  let shown = 0;
  for (const el of cards) {
    const visible = Object.entries(filters).every(([key, want]) => want === "all" || el.dataset[key] === want);
    el.hidden = !visible;
    if (visible) shown++;
  }
  const count = document.getElementById("visible-count");
  count.textContent = shown + " of " + cards.length + " trajectories shown";
  count.dataset.count = String(shown);
}

function setupFilters() {
  for (const button of document.querySelectorAll("#filters button")) {
    button.addEventListener("click", () => {
      filters[button.dataset.key] = button.dataset.value;
      for (const other of document.querySelectorAll('#filters button[data-key="' + button.dataset.key + '"]')) {
        other.classList.toggle("on", other === button);
      }
      applyFilters();
    });
  }
}

function headerText(data) {
  const items = data.items;
  const correct = items.filter((i) => i.correct).length;
  const tool = items.filter((i) => i.calls > 0).length;
  const warned = items.filter((i) => i.warn.length).length;
  document.getElementById("sources").textContent = "from: " + data.sources.join(", ");
  document.getElementById("stats").textContent = items.length + " trajectories · " + correct + " correct · " +
    tool + " used the tool · " + warned + " with mask warnings" + (items.some((i) => i.orig)
      ? " · regraded: " + items.filter(flipped).length + " verdict(s) changed" : "");
  document.getElementById("note").textContent = data.note;
}

async function main() {
  const data = await decodePayload(document.getElementById("payload").textContent);
  headerText(data);
  const list = document.getElementById("items");
  const frag = document.createDocumentFragment();
  for (const item of data.items) frag.append(card(item, data.vocab));
  list.append(frag);
  setupFilters();
  applyFilters();
  document.body.dataset.ready = "1";
}

main().catch((err) => {
  document.getElementById("items").append(h("p", { id: "error" }, "Could not render the data: " + err));
  document.body.dataset.ready = "error";
});
