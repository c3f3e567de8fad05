/**
 * Inline review's pure logic (no `vscode` import, so `node --test` covers it).
 *
 * The agent's edits land in the buffer at once (docs/lsp.md, Edits); review compares
 * each touched file's current text with its *baseline* — the text before the
 * session's first edit to it — and splits the difference into hunks. Accepting a
 * hunk moves it into the baseline (the buffer keeps it, the hunk disappears);
 * rejecting one puts the baseline's lines back into the buffer. A file is resolved
 * when no hunk is left.
 *
 * The line diff trims the common head and tail, then takes a longest common
 * subsequence of what is left; past `LCS_CELLS` cells (two very different large
 * files) the middle becomes one hunk, which is still exact, only coarser.
 */

export const LCS_CELLS = 4_000_000;

/** A changed region: baseline lines [baseStart, baseStart+removed.length) became
 * current lines [curStart, curStart+added.length). */
export interface Hunk {
  baseStart: number;
  curStart: number;
  removed: string[];
  added: string[];
}

export function splitLines(text: string): string[] {
  return text.split("\n");
}

/** The hunks that turn `base` into `current`, in order. */
export function diffHunks(base: string, current: string): Hunk[] {
  const a = splitLines(base);
  const b = splitLines(current);
  let head = 0;
  while (head < a.length && head < b.length && a[head] === b[head]) head++;
  let tail = 0;
  while (tail < a.length - head && tail < b.length - head && a[a.length - 1 - tail] === b[b.length - 1 - tail]) tail++;
  const am = a.slice(head, a.length - tail);
  const bm = b.slice(head, b.length - tail);
  if (am.length === 0 && bm.length === 0) return [];
  if (am.length * bm.length > LCS_CELLS) return [{ baseStart: head, curStart: head, removed: am, added: bm }];
  return lcsHunks(am, bm, head);
}

function lcsHunks(a: string[], b: string[], offset: number): Hunk[] {
  const n = a.length;
  const m = b.length;
  // lcs[i][j]: length of the LCS of a[i:] and b[j:], rows of m+1 numbers.
  const lcs: Uint32Array[] = [];
  for (let i = 0; i <= n; i++) lcs.push(new Uint32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) {
    for (let j = m - 1; j >= 0; j--) {
      lcs[i][j] = a[i] === b[j] ? lcs[i + 1][j + 1] + 1 : Math.max(lcs[i + 1][j], lcs[i][j + 1]);
    }
  }
  const hunks: Hunk[] = [];
  let open: Hunk | undefined;
  let i = 0;
  let j = 0;
  const hunkAt = () => (open ??= { baseStart: offset + i, curStart: offset + j, removed: [], added: [] });
  while (i < n || j < m) {
    if (i < n && j < m && a[i] === b[j]) {
      if (open) hunks.push(open);
      open = undefined;
      i++;
      j++;
    } else if (j < m && (i === n || lcs[i][j + 1] >= lcs[i + 1][j])) {
      hunkAt().added.push(b[j++]);
    } else {
      hunkAt().removed.push(a[i++]);
    }
  }
  if (open) hunks.push(open);
  return hunks;
}

function splice(lines: string[], start: number, count: number, insert: string[]): string {
  return [...lines.slice(0, start), ...insert, ...lines.slice(start + count)].join("\n");
}

/** The baseline after accepting `hunk`: the hunk's new lines become part of it. */
export function acceptHunk(base: string, hunk: Hunk): string {
  return splice(splitLines(base), hunk.baseStart, hunk.removed.length, hunk.added);
}

/** The buffer after rejecting `hunk`: its old lines come back. */
export function rejectHunk(current: string, hunk: Hunk): string {
  return splice(splitLines(current), hunk.curStart, hunk.added.length, hunk.removed);
}

/** The one replacement (character offsets into `before`) that turns `before` into
 * `after`: their common head and tail are left alone, so the editor's cursor,
 * folding and undo stop see only what changed. */
export function minimalEdit(before: string, after: string): { start: number; end: number; text: string } {
  let head = 0;
  const max = Math.min(before.length, after.length);
  while (head < max && before.charCodeAt(head) === after.charCodeAt(head)) head++;
  let tail = 0;
  while (
    tail < max - head &&
    before.charCodeAt(before.length - 1 - tail) === after.charCodeAt(after.length - 1 - tail)
  )
    tail++;
  return { start: head, end: before.length - tail, text: after.slice(head, after.length - tail) };
}

/** One file under review: its baseline and whether the session created it. */
export interface Reviewed {
  sessionId: string;
  uri: string;
  base: string;
  created: boolean;
  /** Hunks accepted so far (a file resolved with none accepted was rejected). */
  accepted: number;
}

/** Files under review, by URI; a file belongs to the session that first edited it
 * since its last resolution. */
export class ReviewStore {
  readonly files = new Map<string, Reviewed>();

  /** Record the baseline of `uri` before `sessionId` edits it (first edit only). */
  track(sessionId: string, uri: string, base: string, created: boolean): void {
    if (!this.files.has(uri)) this.files.set(uri, { sessionId, uri, base, created, accepted: 0 });
  }

  get(uri: string): Reviewed | undefined {
    return this.files.get(uri);
  }

  hunks(uri: string, current: string): Hunk[] {
    const r = this.files.get(uri);
    return r ? diffHunks(r.base, current) : [];
  }

  /** Files of `sessionId` (every session when absent) that still differ from their
   * baseline, given each file's current text. */
  pending(current: (uri: string) => string | undefined, sessionId?: string): Reviewed[] {
    return [...this.files.values()].filter((r) => {
      if (sessionId && r.sessionId !== sessionId) return false;
      const text = current(r.uri);
      return text === undefined || text !== r.base;
    });
  }

  accept(uri: string, hunk: Hunk): void {
    const r = this.files.get(uri);
    if (!r) return;
    r.base = acceptHunk(r.base, hunk);
    r.accepted += 1;
  }

  forget(uri: string): void {
    this.files.delete(uri);
  }

  forgetSession(sessionId: string): string[] {
    const gone = [...this.files.values()].filter((r) => r.sessionId === sessionId).map((r) => r.uri);
    for (const uri of gone) this.files.delete(uri);
    return gone;
  }
}
