/**
 * The session panel: a webview that streams the session (text, tool calls with
 * their durations, diffs of edits) and offers Accept / Reject per file and Undo
 * for the whole session. The HTML is built by `renderSession` (pure, tested);
 * the webview posts back {type: "decide" | "undo" | "cancel", ...}.
 */

import { Item, SessionState, diffLines, escapeHtml, summarizeArgs } from "./model";

export function renderItem(item: Item, sessionId: string): string {
  if (item.kind === "text") {
    return `<div class="text">${escapeHtml(item.text)}</div>`;
  }
  if (item.kind === "tool") {
    const c = item.call;
    const mark = c.status === "running" ? "⏳" : c.status === "ok" ? "✓" : "✗";
    const took = c.durationS !== undefined ? ` <span class="dur">${c.durationS.toFixed(2)}s</span>` : "";
    return `<div class="tool ${c.status}">${mark} <b>${escapeHtml(c.name)}</b> ${escapeHtml(summarizeArgs(c.args))}${took}</div>`;
  }
  const e = item.edit;
  const lines = diffLines(e.diff)
    .map((l) => `<div class="d-${l.kind}">${escapeHtml(l.text) || "&nbsp;"}</div>`)
    .join("");
  const state = e.decision ? `<span class="decision">${e.decision}ed</span>` : "";
  const path = escapeHtml(e.path);
  const sid = escapeHtml(sessionId);
  return (
    `<div class="edit"><div class="edit-head">✎ ${path} ${state}` +
    `<button data-action="decide" data-session="${sid}" data-path="${path}" data-decision="accept">Accept</button>` +
    `<button data-action="decide" data-session="${sid}" data-path="${path}" data-decision="reject">Reject</button>` +
    `</div><pre class="diff">${lines}</pre></div>`
  );
}

export function renderSession(s: SessionState): string {
  const sid = escapeHtml(s.id);
  const head =
    `<div class="head"><b>${escapeHtml(s.query || "session")}</b> <span class="sid">${sid}</span> ` +
    `<span class="status ${escapeHtml(s.status)}">${escapeHtml(s.status)}</span>`;
  const buttons =
    s.status === "running"
      ? `<button data-action="cancel" data-session="${sid}">Cancel</button>`
      : s.edits.size > 0
        ? `<button data-action="undo" data-session="${sid}">Undo session</button>`
        : "";
  const foot =
    s.status === "running"
      ? ""
      : `<div class="foot">${s.turns} turns, ${s.toolCalls} tool calls, ${s.durationS.toFixed(1)}s · trace ${escapeHtml(s.trace)}</div>`;
  return `<section id="s-${sid}">${head} ${buttons}</div>${s.items.map((i) => renderItem(i, s.id)).join("")}${foot}</section>`;
}

export function pageHtml(nonce: string, cspSource: string): string {
  return `<!DOCTYPE html>
<html><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src ${cspSource} 'unsafe-inline'; script-src 'nonce-${nonce}';">
<style>
body { font-family: var(--vscode-font-family); font-size: var(--vscode-font-size); color: var(--vscode-foreground); }
section { border-bottom: 1px solid var(--vscode-panel-border); padding: 6px 0; }
.text { white-space: pre-wrap; margin: 4px 0; }
.tool { font-family: var(--vscode-editor-font-family); opacity: .9; }
.tool.error { color: var(--vscode-errorForeground); }
.dur, .sid, .foot { opacity: .6; }
.diff { margin: 2px 0 8px; font-family: var(--vscode-editor-font-family); }
.d-add { background: var(--vscode-diffEditor-insertedLineBackground, rgba(0,160,0,.2)); }
.d-del { background: var(--vscode-diffEditor-removedLineBackground, rgba(200,0,0,.2)); }
.d-hunk, .d-meta { opacity: .6; }
button { margin-left: 6px; }
</style></head>
<body><div id="sessions"></div>
<script nonce="${nonce}">
const vscode = acquireVsCodeApi();
window.addEventListener("message", (e) => {
  const { id, html } = e.data;
  let el = document.getElementById("s-" + id);
  const wrap = document.createElement("div");
  wrap.innerHTML = html;
  const fresh = wrap.firstElementChild;
  if (el) el.replaceWith(fresh); else document.getElementById("sessions").prepend(fresh);
});
document.addEventListener("click", (e) => {
  const b = e.target.closest("button[data-action]");
  if (!b) return;
  vscode.postMessage({ type: b.dataset.action, session_id: b.dataset.session, path: b.dataset.path, decision: b.dataset.decision });
});
</script></body></html>`;
}
