/**
 * The session panel: a webview that shows each session as a conversation.
 *
 * - the user's requests, and the agent's prose as Markdown in the theme's colours
 *   (the `prose` the agent's own parser produced: no tool-call XML, no parser here);
 * - tool cards: name, arguments, duration, the result folded; the calls of one
 *   model message that ran at the same time sit side by side under "N in parallel";
 * - edit cards with the diff and Accept / Reject for the file (hunks are reviewed
 *   inline in the editor, see review.ts);
 * - a status line: model, turn, tokens, elapsed time;
 * - an input box at the bottom for a follow-up in the selected session (sent with
 *   `session_id`), and "New session".
 *
 * `renderSession` (pure, tested) turns a session into keyed parts; the page patches
 * only the parts whose HTML changed, so folded results keep their state while the
 * session streams. The page posts back {type: "decide" | "undo" | "cancel" | "ask" |
 * "target" | "open" | "submit", ...}.
 */

import MarkdownIt from "markdown-it";
import {
  FileEdit,
  Item,
  SessionState,
  ToolCall,
  diffLines,
  escapeHtml,
  formatElapsed,
  ranInParallel,
  statusLine,
} from "./model";

const markdown = new MarkdownIt({ html: false, linkify: false, breaks: false });

export interface Part {
  key: string;
  html: string;
}

export interface SessionView {
  id: string;
  parts: Part[];
  /** data-* attributes of the session's element: state and latency probes. */
  attrs: Record<string, string>;
}

export function renderMarkdown(text: string): string {
  return markdown.render(text);
}

function argSummary(args: Record<string, unknown>, limit = 80): string {
  return Object.entries(args)
    .map(([k, v]) => {
      const text = typeof v === "string" ? v : JSON.stringify(v);
      const lines = text.split("\n");
      let first = lines[0];
      if (first.length > limit) first = first.slice(0, limit - 1) + "…";
      const more = lines.length > 1 ? ` (+${lines.length - 1} lines)` : "";
      return `<span class="arg"><span class="k">${escapeHtml(k)}</span>=${escapeHtml(first)}${more}</span>`;
    })
    .join(" ");
}

export function renderTool(c: ToolCall): string {
  const mark = c.status === "running" ? '<span class="spin">◌</span>' : c.status === "ok" ? "✓" : "✗";
  const took = c.durationS !== undefined ? `<span class="dur">${formatElapsed(c.durationS)}</span>` : "";
  const out = c.output ?? "";
  const lines = out ? out.split("\n").length : 0;
  const result = out
    ? `<details data-k="${escapeHtml(c.callId)}"><summary>result · ${lines} line${lines === 1 ? "" : "s"}</summary>` +
      `<pre class="out">${escapeHtml(out)}</pre></details>`
    : "";
  return (
    `<div class="tool ${c.status}" data-call="${escapeHtml(c.callId)}">` +
    `<div class="tool-head">${mark} <b>${escapeHtml(c.name)}</b> ${took}</div>` +
    `<div class="args">${argSummary(c.args)}</div>${result}</div>`
  );
}

export function renderEdit(e: FileEdit, sessionId: string): string {
  const lines = diffLines(e.diff);
  const added = lines.filter((l) => l.kind === "add").length;
  const removed = lines.filter((l) => l.kind === "del").length;
  const body = lines.map((l) => `<div class="d-${l.kind}">${escapeHtml(l.text) || "&nbsp;"}</div>`).join("");
  const path = escapeHtml(e.path);
  const sid = escapeHtml(sessionId);
  const state = e.decision ? `<span class="decision">${e.decision === "accept" ? "accepted" : "rejected"}</span>` : "";
  const buttons = e.decision
    ? ""
    : `<button data-action="decide" data-session="${sid}" data-path="${path}" data-decision="accept">Accept file</button>` +
      `<button data-action="decide" data-session="${sid}" data-path="${path}" data-decision="reject">Reject file</button>`;
  return (
    `<div class="edit"><div class="edit-head">✎ <a href="#" data-action="open" data-path="${path}">${path}</a> ` +
    `<span class="add">+${added}</span> <span class="del">−${removed}</span> ${state}${buttons}</div>` +
    `<pre class="diff">${body}</pre></div>`
  );
}

export function renderItem(item: Item, sessionId: string): string {
  switch (item.kind) {
    case "user":
      return `<div class="user">${escapeHtml(item.text)}</div>`;
    case "text":
      return `<div class="md">${renderMarkdown(item.text)}</div>`;
    case "note":
      return `<div class="note">${escapeHtml(item.text)}</div>`;
    case "edit":
      return renderEdit(item.edit, sessionId);
    case "tools": {
      const cards = item.calls.map(renderTool).join("");
      if (item.calls.length < 2) return `<div class="tools">${cards}</div>`;
      const label = ranInParallel(item.calls) ? `⇉ ${item.calls.length} calls in parallel` : `${item.calls.length} calls`;
      return `<div class="tools parallel"><div class="lane-label">${label}</div><div class="lanes">${cards}</div></div>`;
    }
  }
}

export function renderSession(s: SessionState, opts: { target?: boolean; now?: number } = {}): SessionView {
  const sid = escapeHtml(s.id);
  const running = s.status === "running";
  const buttons = running
    ? `<button data-action="cancel" data-session="${sid}">Cancel</button>`
    : (s.edits.size > 0 ? `<button data-action="undo" data-session="${sid}">Undo session</button>` : "") +
      `<button data-action="submit" data-session="${sid}">Submit as task</button>` +
      (opts.target ? "" : `<button data-action="target" data-session="${sid}">Follow up here</button>`);
  const head =
    `<div class="head"><span class="sid">session ${sid}</span> ` +
    `<span class="status ${escapeHtml(s.status)}">${escapeHtml(s.status)}</span>${buttons}</div>`;
  const parts: Part[] = [{ key: "head", html: head }];
  s.items.forEach((item, i) => parts.push({ key: `i${i}`, html: renderItem(item, s.id) }));
  parts.push({ key: "status", html: `<div class="statusline">${escapeHtml(statusLine(s, opts.now))}</div>` });
  const attrs: Record<string, string> = { status: s.status, target: opts.target ? "1" : "0" };
  if (s.modelStartT !== undefined) attrs.modelStartT = String(s.modelStartT);
  if (s.firstProseT !== undefined) attrs.firstProseT = String(s.firstProseT);
  return { id: s.id, parts, attrs };
}

/** The whole session as one HTML string (tests, and the page's first paint). */
export function sessionHtml(view: SessionView): string {
  return view.parts.map((p) => `<div data-key="${p.key}">${p.html}</div>`).join("");
}

export function pageHtml(nonce: string, cspSource: string): string {
  return `<!DOCTYPE html>
<html><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src ${cspSource} 'unsafe-inline'; script-src 'nonce-${nonce}';">
<style>
html, body { height: 100%; margin: 0; }
body { display: flex; flex-direction: column; font-family: var(--vscode-font-family); font-size: var(--vscode-font-size);
  color: var(--vscode-foreground); background: var(--vscode-sideBar-background, var(--vscode-editor-background)); }
#sessions { flex: 1; overflow-y: auto; padding: 0 10px; }
section.session { border-bottom: 1px solid var(--vscode-panel-border); padding: 8px 0; }
section.session[data-target="1"] { border-left: 2px solid var(--vscode-focusBorder); padding-left: 8px; }
.head { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; }
.sid, .dur, .statusline, .lane-label, .args .k { color: var(--vscode-descriptionForeground); }
.status { padding: 0 6px; border-radius: 8px; background: var(--vscode-badge-background); color: var(--vscode-badge-foreground); font-size: 90%; }
.status.error, .status.disconnected { background: var(--vscode-inputValidation-errorBackground); }
.user { margin: 8px 0; padding: 6px 8px; border-radius: 4px; white-space: pre-wrap;
  background: var(--vscode-input-background); border: 1px solid var(--vscode-input-border, transparent); }
.md { line-height: 1.45; }
.md p { margin: 4px 0; }
.md code { font-family: var(--vscode-editor-font-family); background: var(--vscode-textCodeBlock-background); padding: 0 3px; border-radius: 3px; }
.md pre { background: var(--vscode-textCodeBlock-background); padding: 6px; overflow-x: auto; }
.md pre code { background: none; padding: 0; }
.md a { color: var(--vscode-textLink-foreground); }
.md blockquote { border-left: 3px solid var(--vscode-textBlockQuote-border); margin: 4px 0; padding-left: 8px; background: var(--vscode-textBlockQuote-background); }
.note { color: var(--vscode-errorForeground); margin: 4px 0; white-space: pre-wrap; }
.tools { margin: 6px 0; }
.tools.parallel { border-left: 2px solid var(--vscode-charts-blue, var(--vscode-focusBorder)); padding-left: 6px; }
.lanes { display: flex; gap: 6px; flex-wrap: wrap; align-items: flex-start; }
.lanes .tool { flex: 1 1 180px; min-width: 0; }
.tool { border: 1px solid var(--vscode-panel-border); border-radius: 4px; padding: 4px 6px; margin: 3px 0;
  background: var(--vscode-editorWidget-background); font-size: 92%; }
.tool.error .tool-head { color: var(--vscode-errorForeground); }
.tool.ok .tool-head { color: var(--vscode-testing-iconPassed, var(--vscode-foreground)); }
.tool-head b { color: var(--vscode-foreground); }
.args { font-family: var(--vscode-editor-font-family); overflow-wrap: anywhere; }
.out, .diff { font-family: var(--vscode-editor-font-family); font-size: var(--vscode-editor-font-size); margin: 2px 0; max-height: 240px; overflow: auto; }
summary { cursor: pointer; color: var(--vscode-descriptionForeground); }
.edit { margin: 6px 0; border: 1px solid var(--vscode-panel-border); border-radius: 4px; padding: 4px 6px; }
.edit-head { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; }
.edit-head a { color: var(--vscode-textLink-foreground); }
.add { color: var(--vscode-gitDecoration-addedResourceForeground, green); }
.del { color: var(--vscode-gitDecoration-deletedResourceForeground, red); }
.decision { font-style: italic; color: var(--vscode-descriptionForeground); }
.d-add { background: var(--vscode-diffEditor-insertedLineBackground, rgba(0,160,0,.2)); }
.d-del { background: var(--vscode-diffEditor-removedLineBackground, rgba(200,0,0,.2)); }
.d-hunk, .d-meta { color: var(--vscode-descriptionForeground); }
.statusline { font-size: 90%; margin-top: 4px; }
.spin { display: inline-block; animation: spin 1s linear infinite; }
@keyframes spin { to { transform: rotate(360deg); } }
button { color: var(--vscode-button-secondaryForeground); background: var(--vscode-button-secondaryBackground);
  border: none; padding: 2px 8px; border-radius: 2px; cursor: pointer; font-family: inherit; }
button:hover { background: var(--vscode-button-secondaryHoverBackground); }
button.primary { color: var(--vscode-button-foreground); background: var(--vscode-button-background); }
#composer { border-top: 1px solid var(--vscode-panel-border); padding: 6px 10px 10px; }
#target { color: var(--vscode-descriptionForeground); font-size: 90%; margin-bottom: 4px; display: flex; justify-content: space-between; align-items: center; }
#input { width: 100%; box-sizing: border-box; resize: vertical; min-height: 44px; font-family: inherit; font-size: inherit;
  color: var(--vscode-input-foreground); background: var(--vscode-input-background); border: 1px solid var(--vscode-input-border, var(--vscode-panel-border)); padding: 4px; }
#input:focus { outline: 1px solid var(--vscode-focusBorder); }
.row { display: flex; gap: 6px; justify-content: flex-end; margin-top: 4px; }
</style></head>
<body><div id="sessions"></div>
<div id="composer">
  <div id="target"><span id="target-label">New session</span><button id="new" data-action="new">New session</button></div>
  <textarea id="input" rows="2" placeholder="Ask opencomposer (Enter sends, Shift+Enter: new line)"></textarea>
  <div class="row"><button id="send" class="primary">Send</button></div>
</div>
<script nonce="${nonce}">
const vscode = acquireVsCodeApi();
const sessions = document.getElementById("sessions");
const input = document.getElementById("input");
let target = null;
const wall = () => performance.timeOrigin + performance.now();

function patch(view) {
  let sec = document.getElementById("s-" + view.id);
  if (!sec) {
    sec = document.createElement("section");
    sec.id = "s-" + view.id;
    sec.className = "session";
    sessions.append(sec);
  }
  const stick = sessions.scrollTop + sessions.clientHeight >= sessions.scrollHeight - 30;
  for (const [k, v] of Object.entries(view.attrs)) sec.dataset[k] = v;
  const seen = new Set();
  let prev = null;
  for (const p of view.parts) {
    let el = sec.querySelector(':scope > [data-key="' + p.key + '"]');
    if (!el) {
      el = document.createElement("div");
      el.dataset.key = p.key;
      if (prev) prev.after(el); else sec.prepend(el);
    }
    if (el._html !== p.html) {
      const open = new Set([...el.querySelectorAll("details[open]")].map((d) => d.dataset.k));
      el.innerHTML = p.html;
      el._html = p.html;
      for (const d of el.querySelectorAll("details")) if (open.has(d.dataset.k)) d.open = true;
    }
    prev = el;
    seen.add(p.key);
  }
  for (const el of [...sec.children]) if (!seen.has(el.dataset.key)) el.remove();
  if (!sec.dataset.firstTextWall) {
    const md = sec.querySelector(".md");
    if (md && md.textContent.trim()) sec.dataset.firstTextWall = String(wall());
  }
  if (stick) sessions.scrollTop = sessions.scrollHeight;
}

function setTarget(id, label) {
  target = id;
  document.getElementById("target-label").textContent = label;
}

function send() {
  const query = input.value.trim();
  if (!query) return;
  input.value = "";
  vscode.postMessage({ type: "ask", query, session_id: target });
}

window.addEventListener("message", (e) => {
  const m = e.data;
  if (m.type === "session") patch(m.view);
  else if (m.type === "target") setTarget(m.id, m.label);
  else if (m.type === "focus") input.focus();
});
input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
document.getElementById("send").addEventListener("click", send);
document.addEventListener("click", (e) => {
  const b = e.target.closest("[data-action]");
  if (!b || b.id === "send") return;
  e.preventDefault();
  const d = b.dataset;
  vscode.postMessage({ type: d.action, session_id: d.session, path: d.path, decision: d.decision });
});
vscode.postMessage({ type: "ready" });
</script></body></html>`;
}
