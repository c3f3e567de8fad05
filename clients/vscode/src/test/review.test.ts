// Unit tests of inline review's pure logic (review.ts).
import { test } from "node:test";
import * as assert from "node:assert/strict";
import { LCS_CELLS, ReviewStore, acceptHunk, diffHunks, minimalEdit, rejectHunk } from "../review";

const base = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a + b\n";
const agent = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    # fixed\n    return a - b\n";

test("hunks are the changed regions, with their lines on both sides", () => {
  const hunks = diffHunks(base, agent);
  assert.deepEqual(hunks, [
    { baseStart: 1, curStart: 1, removed: ["    return a - b"], added: ["    return a + b"] },
    { baseStart: 5, curStart: 5, removed: ["    return a + b"], added: ["    # fixed", "    return a - b"] },
  ]);
  assert.deepEqual(diffHunks(base, base), []);
  assert.deepEqual(diffHunks("", "x\n"), [{ baseStart: 0, curStart: 0, removed: [], added: ["x"] }]);
});

test("accepting every hunk makes the baseline the buffer; rejecting every hunk restores it", () => {
  let b = base;
  let hunks = diffHunks(b, agent);
  // accept the second, reject the first: hunk positions stay valid in both texts
  b = acceptHunk(b, hunks[1]);
  let cur = rejectHunk(agent, hunks[0]);
  assert.deepEqual(diffHunks(b, cur), []);
  assert.equal(cur, "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    # fixed\n    return a - b\n");
  // all rejected, back to the start
  hunks = diffHunks(base, agent);
  cur = agent;
  for (const h of [...hunks].reverse()) cur = rejectHunk(cur, h);
  assert.equal(cur, base);
});

test("a pure deletion and a pure insertion", () => {
  const hunks = diffHunks("a\nb\nc\n", "a\nc\nd\n");
  assert.deepEqual(hunks, [
    { baseStart: 1, curStart: 1, removed: ["b"], added: [] },
    { baseStart: 3, curStart: 2, removed: [], added: ["d"] },
  ]);
  assert.equal(rejectHunk("a\nc\nd\n", hunks[0]), "a\nb\nc\nd\n");
  assert.equal(acceptHunk("a\nb\nc\n", hunks[1]), "a\nb\nc\nd\n");
});

test("past the LCS budget the changed middle is one exact hunk", () => {
  const n = Math.ceil(Math.sqrt(LCS_CELLS)) + 10;
  const a = Array.from({ length: n }, (_, i) => `a${i}`).join("\n");
  const b = Array.from({ length: n }, (_, i) => `b${i}`).join("\n");
  const hunks = diffHunks(`head\n${a}\ntail`, `head\n${b}\ntail`);
  assert.equal(hunks.length, 1);
  assert.equal(rejectHunk(`head\n${b}\ntail`, hunks[0]), `head\n${a}\ntail`);
});

test("minimalEdit replaces only what changed", () => {
  assert.deepEqual(minimalEdit("abcXYdef", "abcZdef"), { start: 3, end: 5, text: "Z" });
  assert.deepEqual(minimalEdit("same", "same"), { start: 4, end: 4, text: "" });
  assert.deepEqual(minimalEdit("aa", "aaa"), { start: 2, end: 2, text: "a" });
});

test("the store keeps the first baseline per file and lists files still pending", () => {
  const store = new ReviewStore();
  store.track("s1", "file:///a", "one\n", false);
  store.track("s1", "file:///a", "two\n", false); // a later edit in the session: baseline stays
  store.track("s2", "file:///b", "", true);
  assert.equal(store.get("file:///a")?.base, "one\n");
  const texts: Record<string, string> = { "file:///a": "two\n", "file:///b": "" };
  assert.deepEqual(store.pending((u) => texts[u]).map((r) => r.uri), ["file:///a"]);
  assert.deepEqual(store.pending((u) => texts[u], "s2"), []);
  const [h] = store.hunks("file:///a", "two\n");
  store.accept("file:///a", h);
  assert.deepEqual(store.hunks("file:///a", "two\n"), []);
  assert.equal(store.get("file:///a")?.accepted, 1);
  assert.deepEqual(store.forgetSession("s1"), ["file:///a"]);
  assert.equal(store.files.size, 1);
});
