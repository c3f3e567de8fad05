// Unit tests of the extension's pure logic: `npm test` (node --test on the compiled output).
import { test } from "node:test";
import * as assert from "node:assert/strict";
import { SessionStore, askArguments, currentSession, diffLines, escapeHtml, filesToSave, statusText } from "../model";
import { renderSession } from "../panel";

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
  assert.deepEqual(s.items[0], { kind: "text", turn: 1, text: "I'll fix it." });
  assert.equal(statusText(store), "$(sync~spin) opencomposer: edit_file calc.py");
  store.apply(ev("edit", { path: "calc.py", diff: "--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a - b\n+a + b\n" }));
  store.apply(ev("tool_end", { turn: 1, call_id: "c1", name: "edit_file", status: "ok", duration_s: 0.25 }));
  store.apply(ev("session_end", { status: "completed", turns: 2, tool_calls: 1, duration_s: 1.5, trace: "/t#abc123" }));
  const call = s.items.find((i) => i.kind === "tool");
  assert.ok(call && call.kind === "tool" && call.call.status === "ok" && call.call.durationS === 0.25);
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
  assert.match(html, /class="tool error">✗ <b>edit_file<\/b>/);
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
  store.decide(sid, "calc.py", "reject");
  assert.match(renderSession(store.get(sid)!), /rejected/);
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
