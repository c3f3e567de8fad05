/**
 * The extension's pure logic: no `vscode` import, so `node --test` covers it.
 *
 * `SessionStore` folds the server's `opencomposer/event` notifications
 * (docs/lsp.md) into per-session state that the panel and the status bar show;
 * `askArguments` builds the `opencomposer.ask` argument object from the editor's
 * state; `diffLines` classifies a unified diff for display; `escapeHtml` keeps
 * model text inert inside the webview.
 */

export type Event = { type: string; t: number; session_id: string; [key: string]: unknown };

export interface ToolCall {
  callId: string;
  name: string;
  args: Record<string, unknown>;
  status: "running" | "ok" | "error";
  durationS?: number;
  output?: string; // the result, cut at head and tail by the server
  tStart: number;
  tEnd?: number;
}

export interface FileEdit {
  path: string;
  diff: string;
  decision?: "accept" | "reject";
}

/** One item of the transcript, in order: the user's request, streamed prose, the
 * tool calls of one model message (they run concurrently), an edit, a note from
 * the session or the client (errors). */
export type Item =
  | { kind: "user"; text: string }
  | { kind: "text"; turn: number; text: string }
  | { kind: "tools"; turn: number; calls: ToolCall[] }
  | { kind: "edit"; edit: FileEdit }
  | { kind: "note"; text: string };

export interface SessionState {
  id: string;
  query: string;
  model: string;
  status: string; // "running" until session_end
  items: Item[];
  edits: Map<string, FileEdit>; // latest edit per path
  turns: number;
  toolCalls: number;
  durationS: number;
  trace: string;
  answer?: string;
  lastActivity: string;
  promptTokens: number; // the latest turn's prompt: how full the context is
  completionTokens: number; // all turns
  startedAt: number; // client wall clock (ms) when the session (or its follow-up) started
  endedAt?: number;
  modelStartT?: number; // `t` of the first model_start and of the first prose (latency probes)
  firstProseT?: number;
}

export class SessionStore {
  readonly sessions = new Map<string, SessionState>();
  private pendingQueries: string[] = [];

  /** The query of the next session to start (the server names sessions, not us). */
  expect(query: string): void {
    this.pendingQueries.push(query);
  }

  get(id: string): SessionState | undefined {
    return this.sessions.get(id);
  }

  running(): SessionState[] {
    return [...this.sessions.values()].filter((s) => s.status === "running");
  }

  latest(): SessionState | undefined {
    let last: SessionState | undefined;
    for (const s of this.sessions.values()) last = s;
    return last;
  }

  /** Fold one event in; returns the session it belongs to. */
  apply(ev: Event): SessionState {
    let s = this.sessions.get(ev.session_id);
    if (!s) {
      s = {
        id: ev.session_id,
        query: this.pendingQueries.shift() ?? "",
        model: "",
        status: "running",
        items: [],
        edits: new Map(),
        turns: 0,
        toolCalls: 0,
        durationS: 0,
        trace: "",
        lastActivity: "starting",
        promptTokens: 0,
        completionTokens: 0,
        startedAt: Date.now(),
      };
      if (s.query) s.items.push({ kind: "user", text: s.query });
      this.sessions.set(ev.session_id, s);
    }
    switch (ev.type) {
      case "session_start":
        s.model = String(ev.model ?? "");
        s.status = "running";
        s.lastActivity = "started";
        break;
      case "model_start":
        s.turns = Number(ev.turn);
        s.modelStartT ??= ev.t;
        s.lastActivity = `thinking (turn ${ev.turn})`;
        break;
      case "model_end":
        s.promptTokens = Number(ev.prompt_tokens ?? s.promptTokens);
        s.completionTokens += Number(ev.completion_tokens ?? 0);
        break;
      case "model_delta": {
        // `prose`: the reply without its tool-call XML, as the agent's parser decided it
        // (the calls show as tool items); `text` from servers that do not send it.
        const piece = typeof ev.prose === "string" ? ev.prose : String(ev.text);
        if (!piece) break;
        const last = s.items[s.items.length - 1];
        const turn = Number(ev.turn);
        if (last && last.kind === "text" && last.turn === turn) last.text += piece;
        else if (piece.trim()) s.items.push({ kind: "text", turn, text: piece.replace(/^\s*\n/, "") });
        else break; // the newline between two calls: the calls stay one group
        s.firstProseT ??= ev.t;
        break;
      }
      case "message":
        // deltas carry the text; a message that starts with "[" is the session's own note (errors)
        if (typeof ev.text === "string" && ev.text.startsWith("[")) {
          s.items.push({ kind: "note", text: ev.text });
        }
        break;
      case "tool_start": {
        const call: ToolCall = {
          callId: String(ev.call_id),
          name: String(ev.name),
          args: (ev.args as Record<string, unknown>) ?? {},
          status: "running",
          tStart: ev.t,
        };
        const turn = Number(ev.turn);
        const last = s.items[s.items.length - 1];
        if (last && last.kind === "tools" && last.turn === turn) last.calls.push(call);
        else s.items.push({ kind: "tools", turn, calls: [call] });
        s.toolCalls += 1;
        s.lastActivity = `${call.name} ${summarizeArgs(call.args)}`.trim();
        break;
      }
      case "tool_end": {
        const call = findCall(s, String(ev.call_id));
        if (call) {
          call.status = ev.status === "ok" ? "ok" : "error";
          call.durationS = Number(ev.duration_s);
          call.tEnd = ev.t;
          if (typeof ev.output === "string") call.output = ev.output;
        }
        break;
      }
      case "edit": {
        const previous = s.edits.get(String(ev.path));
        const edit: FileEdit = { path: String(ev.path), diff: String(ev.diff), decision: previous?.decision };
        s.edits.set(edit.path, edit);
        s.items.push({ kind: "edit", edit });
        s.lastActivity = `edited ${edit.path}`;
        break;
      }
      case "session_end":
        s.status = String(ev.status);
        s.turns = Number(ev.turns ?? s.turns);
        s.toolCalls = Number(ev.tool_calls ?? s.toolCalls);
        s.durationS = Number(ev.duration_s ?? 0);
        s.trace = String(ev.trace ?? "");
        s.lastActivity = s.status;
        s.endedAt = Date.now();
        break;
    }
    return s;
  }

  /** A follow-up request in session `id` (sent with `session_id`): the session runs
   * again, its transcript kept. */
  followUp(id: string, query: string): SessionState | undefined {
    const s = this.sessions.get(id);
    if (!s) return undefined;
    s.items.push({ kind: "user", text: query });
    s.status = "running";
    s.lastActivity = "starting";
    s.startedAt = Date.now();
    s.endedAt = undefined;
    return s;
  }

  /** The server went away: sessions it was running end here, with a note. */
  disconnect(reason: string): SessionState[] {
    const hit = this.running();
    for (const s of hit) {
      s.status = "disconnected";
      s.lastActivity = "disconnected";
      s.endedAt = Date.now();
      s.items.push({ kind: "note", text: reason });
    }
    return hit;
  }

  /** Record the user's accept/reject of one file's edits. */
  decide(sessionId: string, path: string, decision: "accept" | "reject"): void {
    const s = this.sessions.get(sessionId);
    for (const item of s?.items ?? []) if (item.kind === "edit" && item.edit.path === path) item.edit.decision = decision;
    const edit = s?.edits.get(path);
    if (edit) edit.decision = decision;
  }
}

function findCall(s: SessionState, callId: string): ToolCall | undefined {
  for (let i = s.items.length - 1; i >= 0; i--) {
    const item = s.items[i];
    if (item.kind !== "tools") continue;
    const call = item.calls.find((c) => c.callId === callId);
    if (call) return call;
  }
  return undefined;
}

export function summarizeArgs(args: Record<string, unknown>, limit = 60): string {
  const main = args.path ?? args.pattern ?? args.query ?? args.command ?? "";
  const text = String(main).split("\n")[0];
  return text.length > limit ? text.slice(0, limit - 1) + "…" : text;
}

/** The status-bar text for the current sessions. */
export function statusText(store: SessionStore): string {
  const running = store.running();
  if (running.length === 0) return "$(sparkle) opencomposer";
  if (running.length === 1) return `$(sync~spin) opencomposer: ${running[0].lastActivity}`;
  return `$(sync~spin) opencomposer: ${running.length} sessions`;
}

export interface EditorState {
  uri?: string;
  selection?: { start: { line: number; character: number }; end: { line: number; character: number } };
  openFiles?: string[];
}

/** The `opencomposer.ask` argument object (docs/lsp.md). */
export function askArguments(
  query: string,
  editor: EditorState,
  options: { model?: string; approve?: string; autoApplyEdits?: boolean; sessionId?: string; reveal?: boolean } = {},
): Record<string, unknown> {
  const q = query.trim();
  if (!q) throw new Error("the question is empty");
  const arg: Record<string, unknown> = { query: q };
  if (options.sessionId) arg.session_id = options.sessionId;
  if (editor.uri) arg.uri = editor.uri;
  const sel = editor.selection;
  if (editor.uri && sel && (sel.start.line !== sel.end.line || sel.start.character !== sel.end.character)) {
    arg.selection = sel;
  }
  if (editor.openFiles && editor.openFiles.length > 0) arg.open_files = editor.openFiles.slice(0, 50);
  if (options.model) arg.model = options.model;
  if (options.approve) arg.approve = options.approve;
  if (options.autoApplyEdits !== undefined) arg.auto_apply_edits = options.autoApplyEdits;
  if (options.reveal) arg.reveal = true;
  return arg;
}

/** Whether some of these calls ran at the same time (one started before another ended). */
export function ranInParallel(calls: ToolCall[]): boolean {
  const spans = calls.map((c) => [c.tStart, c.tEnd ?? Infinity]).sort((x, y) => x[0] - y[0]);
  for (let i = 1; i < spans.length; i++) if (spans[i][0] < spans[i - 1][1]) return true;
  return false;
}

export function formatTokens(n: number): string {
  return n >= 1000 ? `${(n / 1000).toFixed(1)}k` : String(n);
}

export function formatElapsed(seconds: number): string {
  if (seconds < 60) return `${seconds.toFixed(1)}s`;
  return `${Math.floor(seconds / 60)}m${String(Math.floor(seconds % 60)).padStart(2, "0")}s`;
}

/** The panel's status line: model, turn, tokens (context now / generated), elapsed. */
export function statusLine(s: SessionState, now = Date.now()): string {
  const elapsed = ((s.endedAt ?? now) - s.startedAt) / 1000;
  const parts = [
    s.model || "model …",
    `turn ${s.turns}`,
    `${formatTokens(s.promptTokens)} ctx · ${formatTokens(s.completionTokens)} out tokens`,
    formatElapsed(Math.max(0, elapsed)),
  ];
  return parts.join(" · ");
}

export type DiffLineKind = "add" | "del" | "hunk" | "meta" | "ctx";

/** Classify the lines of a unified diff for colouring. */
export function diffLines(diff: string): { kind: DiffLineKind; text: string }[] {
  return diff
    .split("\n")
    .filter((line, i, all) => !(i === all.length - 1 && line === ""))
    .map((text) => {
      if (text.startsWith("+++") || text.startsWith("---")) return { kind: "meta" as const, text };
      if (text.startsWith("@@")) return { kind: "hunk" as const, text };
      if (text.startsWith("+")) return { kind: "add" as const, text };
      if (text.startsWith("-")) return { kind: "del" as const, text };
      return { kind: "ctx" as const, text };
    });
}

export function escapeHtml(text: string): string {
  return text
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;")
    .replace(/'/g, "&#39;");
}

/** Files whose edits were applied to documents that were clean (or closed) before. */
export function filesToSave(touched: string[], dirtyBefore: Set<string>): string[] {
  return touched.filter((uri) => !dirtyBefore.has(uri));
}

/** The session the panel's session-scoped commands act on: running first, else latest. */
export function currentSession(store: SessionStore): SessionState | undefined {
  const running = store.running();
  return running.length > 0 ? running[running.length - 1] : store.latest();
}
