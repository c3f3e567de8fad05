// Unit tests of the extension's pure logic: `npm test` (node --test on the compiled output).
import { test } from "node:test";
import * as assert from "node:assert/strict";
import {
  SessionStore,
  askArguments,
  currentSession,
  diffLines,
  escapeHtml,
  filesToSave,
  ranInParallel,
  statusLine,
  statusText,
} from "../model";
import { renderSession as renderView, sessionHtml } from "../panel";
import type { SessionState } from "../model";

const renderSession = (s: SessionState) => sessionHtml(renderView(s));

const sid = "abc123";
const ev = (type: string, extra: Record<string, unknown> = {}) => ({ type, t: 0, session_id: sid, ...extra });

function playSession(store: SessionStore) {
  store.expect("fix add");
  store.apply(ev("session_start", { model: "scripted", workspace: "/w" }));
  store.apply(ev("model_start", { turn: 1 }));
  store.apply(ev("model_delta", { turn: 1, text: "I'll " }));
  store.apply(ev("model_delta", { turn: 1, text: "fix it." }));
  store.apply(ev("tool_start", { turn: 1, call_id: "c1", name: "edit_file", args: { path: "calc.py", old: "a - b", new: "a + b" } }));
}

test("events fold into one session: streamed text joins, tools get their durations", () => {
  const store = new SessionStore();
  playSession(store);
  const s = store.get(sid)!;
  assert.equal(s.query, "fix add");
  assert.equal(s.status, "running");
  assert.deepEqual(s.items[0], { kind: "user", text: "fix add" });
  assert.deepEqual(s.items[1], { kind: "text", turn: 1, text: "I'll fix it." });
  assert.equal(statusText(store), "$(sync~spin) opencomposer: edit_file calc.py");
  store.apply(ev("edit", { path: "calc.py", diff: "--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a - b\n+a + b\n" }));
  store.apply(ev("tool_end", { turn: 1, call_id: "c1", name: "edit_file", status: "ok", duration_s: 0.25 }));
  store.apply(ev("session_end", { status: "completed", turns: 2, tool_calls: 1, duration_s: 1.5, trace: "/t#abc123" }));
  const group = s.items.find((i) => i.kind === "tools");
  assert.ok(group && group.kind === "tools" && group.calls[0].status === "ok" && group.calls[0].durationS === 0.25);
  assert.equal(s.status, "completed");
  assert.equal(s.edits.get("calc.py")?.path, "calc.py");
  assert.equal(statusText(store), "$(sparkle) opencomposer");
  assert.equal(currentSession(store)?.id, sid);
});

test("the panel shows prose, never the tool-call XML the agent parsed out", () => {
  const store = new SessionStore();
  store.apply(ev("session_start", { model: "scripted", workspace: "/w" }));
  store.apply(ev("model_delta", { turn: 1, text: "Fixing. <edit_file path=", prose: "Fixing. " }));
  store.apply(ev("model_delta", { turn: 1, text: '"calc.py"><old>a</old><new>b</new></edit_file>', prose: "" }));
  store.apply(ev("model_delta", { turn: 1, text: " Done.", prose: " Done." }));
  const s = store.get(sid)!;
  assert.deepEqual(s.items, [{ kind: "text", turn: 1, text: "Fixing.  Done." }]);
  assert.ok(!renderSession(s).includes("edit_file path"));
});

test("a failed tool call is marked as an error", () => {
  const store = new SessionStore();
  playSession(store);
  store.apply(ev("tool_end", { turn: 1, call_id: "c1", name: "edit_file", status: "error", duration_s: 0.01 }));
  const html = renderSession(store.get(sid)!);
  assert.match(html, /class="tool error" data-call="c1"><div class="tool-head">✗ <b>edit_file<\/b>/);
});

test("the panel escapes model text and offers accept/reject per edited file", () => {
  const store = new SessionStore();
  playSession(store);
  store.apply(ev("model_delta", { turn: 1, text: "<script>alert(1)</script>" }));
  store.apply(ev("edit", { path: "calc.py", diff: "+x < y\n" }));
  const html = renderSession(store.get(sid)!);
  assert.ok(!html.includes("<script>alert(1)"));
  assert.ok(html.includes("&lt;script&gt;"));
  assert.match(html, /data-decision="accept"/);
  assert.match(html, /data-decision="reject"/);
  assert.match(html, /<div class="d-add">\+x &lt; y<\/div>/);
  store.apply(ev("edit", { path: "calc.py", diff: "+z\n" })); // a second edit of the file
  store.decide(sid, "calc.py", "reject");
  const after = renderSession(store.get(sid)!);
  assert.equal(after.match(/rejected/g)?.length, 2); // every card of the file
  assert.ok(!after.includes('data-decision="accept"'));
});

test("askArguments builds the docs/lsp.md argument object", () => {
  const sel = { start: { line: 1, character: 0 }, end: { line: 3, character: 4 } };
  assert.deepEqual(askArguments("  why?  ", { uri: "file:///a.py", selection: sel, openFiles: ["file:///a.py"] }, { approve: "safe" }), {
    query: "why?",
    uri: "file:///a.py",
    selection: sel,
    open_files: ["file:///a.py"],
    approve: "safe",
  });
  const empty = { start: { line: 2, character: 1 }, end: { line: 2, character: 1 } };
  assert.deepEqual(askArguments("q", { uri: "file:///a.py", selection: empty }), { query: "q", uri: "file:///a.py" });
  // the editor's own edits setting travels as its own argument, never as a policy
  assert.deepEqual(askArguments("q", {}, { approve: "safe", autoApplyEdits: false }), {
    query: "q",
    approve: "safe",
    auto_apply_edits: false,
  });
  assert.throws(() => askArguments("   ", {}), /empty/);
});

test("diffLines classifies unified diff lines", () => {
  assert.deepEqual(
    diffLines("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n+new\n same\n").map((l) => l.kind),
    ["meta", "meta", "hunk", "del", "add", "ctx"],
  );
});

test("only documents that were clean before an edit are saved", () => {
  assert.deepEqual(filesToSave(["file:///a", "file:///b"], new Set(["file:///b"])), ["file:///a"]);
});

test("escapeHtml covers quotes", () => {
  assert.equal(escapeHtml(`<a href="x">'&'</a>`), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
});

test("two running sessions show a count", () => {
  const store = new SessionStore();
  store.apply({ type: "session_start", t: 0, session_id: "one", model: "m" });
  store.apply({ type: "session_start", t: 0, session_id: "two", model: "m" });
  assert.equal(statusText(store), "$(sync~spin) opencomposer: 2 sessions");
});

test("prose renders as Markdown, escaped: no raw HTML from the model", () => {
  const store = new SessionStore();
  store.apply(ev("session_start", { model: "m" }));
  store.apply(ev("model_delta", { turn: 1, text: "x", prose: "Use **`min`** here:\n\n```py\nx < y\n```\n<img src=x>" }));
  const html = renderSession(store.get(sid)!);
  assert.match(html, /<strong><code>min<\/code><\/strong>/);
  assert.match(html, /<pre><code class="language-py">x &lt; y\n<\/code><\/pre>/);
  assert.ok(!html.includes("<img"));
});

test("tool cards show arguments, duration and the folded result; overlapping calls are parallel", () => {
  const store = new SessionStore();
  store.apply(ev("session_start", { model: "m" }));
  store.apply({ ...ev("tool_start", { turn: 1, call_id: "a", name: "grep", args: { pattern: "def add" } }), t: 1.0 });
  store.apply({ ...ev("model_delta", { turn: 1, text: "\n", prose: "\n" }), t: 1.005 });
  store.apply({ ...ev("tool_start", { turn: 1, call_id: "b", name: "read_file", args: { path: "calc.py" } }), t: 1.01 });
  store.apply({ ...ev("tool_end", { turn: 1, call_id: "b", name: "read_file", status: "ok", duration_s: 0.02, output: "1\tdef add\n2\t  pass" }), t: 1.03 });
  store.apply({ ...ev("tool_end", { turn: 1, call_id: "a", name: "grep", status: "ok", duration_s: 0.05, output: "calc.py:1:def add" }), t: 1.05 });
  const s = store.get(sid)!;
  assert.equal(s.items.length, 1);
  const group = s.items[0];
  assert.ok(group.kind === "tools" && ranInParallel(group.calls));
  const html = renderSession(s);
  assert.match(html, /⇉ 2 calls in parallel/);
  assert.match(html, /<span class="k">pattern<\/span>=def add/);
  assert.match(html, /<details data-k="b"><summary>result · 2 lines<\/summary><pre class="out">1\tdef add\n2\t  pass<\/pre><\/details>/);
  assert.match(html, /20ms|0\.0s/);
  // calls one after the other are not parallel
  assert.equal(ranInParallel([{ callId: "x", name: "a", args: {}, status: "ok", tStart: 0, tEnd: 1 }, { callId: "y", name: "b", args: {}, status: "ok", tStart: 1, tEnd: 2 }]), false);
});

test("the status line shows model, turn, tokens and elapsed time", () => {
  const store = new SessionStore();
  store.apply(ev("session_start", { model: "scripted:x.json" }));
  const s = store.get(sid)!;
  s.startedAt = 1000;
  store.apply(ev("model_start", { turn: 2 }));
  store.apply(ev("model_end", { turn: 2, prompt_tokens: 1500, completion_tokens: 40 }));
  store.apply(ev("model_end", { turn: 2, prompt_tokens: 1600, completion_tokens: 2 }));
  assert.equal(statusLine(s, 4500), "scripted:x.json · turn 2 · 1.6k ctx · 42 out tokens · 3.5s");
});

test("a follow-up continues the session: same id, transcript kept, the ask carries session_id", () => {
  const store = new SessionStore();
  playSession(store);
  store.apply(ev("session_end", { status: "completed", turns: 1, tool_calls: 1, duration_s: 1, trace: "t" }));
  const s = store.followUp(sid, "now add tests")!;
  assert.equal(s.status, "running");
  assert.deepEqual(s.items.at(-1), { kind: "user", text: "now add tests" });
  store.apply(ev("session_start", { model: "scripted" }));
  store.apply(ev("model_delta", { turn: 2, text: "ok", prose: "ok" }));
  assert.equal(store.sessions.size, 1);
  assert.deepEqual(s.items.at(-1), { kind: "text", turn: 2, text: "ok" });
  assert.equal(store.followUp("nope", "x"), undefined);
  assert.deepEqual(askArguments("more", {}, { sessionId: sid }), { query: "more", session_id: sid });
});

test("a server that stops ends its running sessions with a note", () => {
  const store = new SessionStore();
  playSession(store);
  assert.equal(store.disconnect("[server stopped]").length, 1);
  const s = store.get(sid)!;
  assert.equal(s.status, "disconnected");
  assert.deepEqual(s.items.at(-1), { kind: "note", text: "[server stopped]" });
  assert.equal(store.running().length, 0);
});

test("the panel view carries the latency probes' event times", () => {
  const store = new SessionStore();
  store.apply(ev("session_start", { model: "m" }));
  store.apply({ ...ev("model_start", { turn: 1 }), t: 0.05 });
  store.apply({ ...ev("model_delta", { turn: 1, text: "<", prose: "" }), t: 0.06 });
  store.apply({ ...ev("model_delta", { turn: 1, text: "Hi", prose: "Hi" }), t: 0.07 });
  const view = renderView(store.get(sid)!);
  assert.equal(view.attrs.modelStartT, "0.05");
  assert.equal(view.attrs.firstProseT, "0.07");
  assert.deepEqual(view.parts.map((p) => p.key), ["head", "i0", "status"]);
});
