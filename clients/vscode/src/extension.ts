/**
 * opencomposer for VS Code: a client of `opencomposer serve --stdio` (docs/lsp.md).
 *
 * Commands (palette, category "opencomposer"): Ask, Cancel, Search, Undo Session,
 * Submit Session, Show Session Panel, and the review actions (Accept / Reject a
 * hunk, a file, everything). The panel (panel.ts) streams every session and takes
 * follow-up requests; the status bar shows what the agent is doing. The agent's
 * edits arrive as `workspace/applyEdit`: they land in documents (Ctrl+Z undoes
 * them), files that had no unsaved changes are saved so the agent's commands see
 * them, and they show inline as a diff to accept or reject (inline.ts).
 * Approvals (`window/showMessageRequest`) use VS Code's standard message buttons.
 * A server that crashes is restarted by the language client; sessions it was
 * running end as "disconnected".
 */

import * as crypto from "crypto";
import * as vscode from "vscode";
import {
  ApplyWorkspaceEditParams,
  ApplyWorkspaceEditRequest,
  ApplyWorkspaceEditResult,
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  State,
  TransportKind,
} from "vscode-languageclient/node";
import { InlineReview } from "./inline";
import { Event, SessionStore, askArguments, currentSession, filesToSave, statusText } from "./model";
import { pageHtml, renderSession } from "./panel";

let client: LanguageClient | undefined;
const store = new SessionStore();
let panel: vscode.WebviewPanel | undefined;
let status: vscode.StatusBarItem;
let review: InlineReview;
let serverState = "starting";
/** The session the panel's input box continues; undefined: the next request starts one. */
let target: string | undefined;
/** >0 while our own decide/undo runs: the edits it brings are reverts, not the agent's. */
let reverting = 0;
let ticker: NodeJS.Timeout | undefined;

function config() {
  return vscode.workspace.getConfiguration("opencomposer");
}

async function startClient(context: vscode.ExtensionContext): Promise<LanguageClient> {
  const [command, ...args] = config().get<string[]>("serverCommand") ?? ["opencomposer", "serve", "--stdio"];
  const model = config().get<string>("model");
  if (model) args.push("--model", model);
  const serverOptions: ServerOptions = { command, args, transport: TransportKind.stdio };
  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ scheme: "file" }],
    initializationOptions: model ? { model } : {},
    outputChannelName: "opencomposer",
    middleware: {
      // The code action "Ask opencomposer about this selection" runs opencomposer.ask with
      // {prompt: true}: let the user edit the question first.
      executeCommand: async (cmd, cmdArgs, next) => {
        if (cmd === "opencomposer.ask" && cmdArgs[0]?.prompt) {
          const { prompt, ...preset } = cmdArgs[0];
          void prompt;
          return ask(context, preset);
        }
        return next(cmd, cmdArgs);
      },
    },
  };
  const c = new LanguageClient("opencomposer", "opencomposer", serverOptions, clientOptions);
  c.onDidChangeState((e) => {
    if (e.newState === State.Running) serverState = "running";
    else if (e.newState === State.Starting) serverState = "starting";
    else {
      serverState = "stopped";
      for (const s of store.disconnect("[the opencomposer server stopped; it restarts by itself]")) post(s.id);
    }
    updateStatus();
  });
  c.onNotification("opencomposer/event", (ev: Event) => onEvent(context, ev));
  c.onRequest(ApplyWorkspaceEditRequest.type, (params) => applyEdit(c, params));
  await c.start();
  return c;
}

function updateStatus() {
  if (serverState === "running") status.text = statusText(store);
  else status.text = serverState === "starting" ? "$(sync~spin) opencomposer: starting server" : "$(error) opencomposer: server stopped";
}

/** Apply the server's edit to documents, then save those that were clean before. */
async function applyEdit(c: LanguageClient, params: ApplyWorkspaceEditParams): Promise<ApplyWorkspaceEditResult> {
  const edit = await c.protocol2CodeConverter.asWorkspaceEdit(params.edit);
  const touched = edit.entries().map(([uri]) => uri);
  const session = store.running().at(-1);
  if (session && reverting === 0) for (const uri of touched) await review.track(session.id, uri);
  const dirty = new Set(vscode.workspace.textDocuments.filter((d) => d.isDirty).map((d) => d.uri.toString()));
  const applied = await vscode.workspace.applyEdit(edit);
  if (!applied) return { applied: false, failureReason: "VS Code could not apply the edit" };
  if (config().get<boolean>("saveEdits", true)) {
    for (const uri of filesToSave(touched.map(String), dirty)) {
      const doc = vscode.workspace.textDocuments.find((d) => d.uri.toString() === uri);
      if (doc && doc.isDirty) await doc.save();
    }
  }
  for (const uri of touched) review.refresh(uri.toString());
  return { applied: true };
}

function onEvent(context: vscode.ExtensionContext, ev: Event) {
  const s = store.apply(ev);
  updateStatus();
  if (!panel) showPanel(context);
  if (ev.type === "session_start" && target === undefined) setTarget(s.id);
  post(s.id);
}

/** Send one session's view to the panel. */
function post(id: string) {
  const s = store.get(id);
  if (s && panel) void panel.webview.postMessage({ type: "session", view: renderSession(s, { target: target === id }) });
}

function setTarget(id: string | undefined) {
  const previous = target;
  target = id;
  const label = id ? `Follow-up in session ${id}` : "New session";
  void panel?.webview.postMessage({ type: "target", id: id ?? null, label });
  if (previous) post(previous);
  if (id) post(id);
}

function showPanel(context: vscode.ExtensionContext) {
  if (panel) {
    panel.reveal(vscode.ViewColumn.Beside, true);
    return;
  }
  panel = vscode.window.createWebviewPanel("opencomposer", "opencomposer", { viewColumn: vscode.ViewColumn.Beside, preserveFocus: true }, {
    enableScripts: true,
    retainContextWhenHidden: true,
  });
  const nonce = crypto.randomBytes(16).toString("hex");
  panel.webview.html = pageHtml(nonce, panel.webview.cspSource);
  panel.webview.onDidReceiveMessage((m) => onPanelMessage(context, m), undefined, context.subscriptions);
  panel.onDidDispose(() => (panel = undefined), undefined, context.subscriptions);
  ticker ??= setInterval(() => {
    for (const s of store.running()) post(s.id); // the status line's elapsed time
  }, 1000);
}

type PanelMessage = { type: string; session_id?: string | null; path?: string; decision?: "accept" | "reject"; query?: string };

async function onPanelMessage(context: vscode.ExtensionContext, m: PanelMessage) {
  const sid = m.session_id ?? undefined;
  if (m.type === "ready") {
    for (const s of store.sessions.values()) post(s.id);
    setTarget(target);
  } else if (m.type === "ask" && m.query) {
    await ask(context, { query: m.query }, sid && store.get(sid) ? sid : undefined);
  } else if (m.type === "new") {
    setTarget(undefined);
  } else if (m.type === "target" && sid) {
    setTarget(sid);
  } else if (m.type === "decide" && sid && m.path && m.decision) {
    const root = vscode.workspace.workspaceFolders?.[0]?.uri;
    if (root) review.forget(vscode.Uri.joinPath(root, m.path).toString());
    await decide(sid, m.path, m.decision);
  } else if (m.type === "undo" && sid) {
    await undo(sid);
  } else if (m.type === "cancel" && sid) {
    await execute("opencomposer.cancel", { session_id: sid });
  } else if (m.type === "submit" && sid) {
    await submit(sid);
  } else if (m.type === "open" && m.path) {
    const root = vscode.workspace.workspaceFolders?.[0]?.uri;
    if (root) await vscode.window.showTextDocument(vscode.Uri.joinPath(root, m.path), { viewColumn: vscode.ViewColumn.One });
  }
}

async function execute(command: string, arg: Record<string, unknown>): Promise<any> {
  if (!client || serverState !== "running") {
    vscode.window.showErrorMessage(`opencomposer: the server is ${serverState === "running" ? "not started" : serverState}`);
    return undefined;
  }
  try {
    return await client.sendRequest("workspace/executeCommand", { command, arguments: [arg] });
  } catch (e: any) {
    // a server that died mid-request: the panel already says so, and it restarts
    if (serverState === "running") vscode.window.showErrorMessage(`opencomposer: ${e?.message ?? e}`);
    return undefined;
  }
}

async function decide(sessionId: string, path: string, decision: "accept" | "reject") {
  reverting++;
  try {
    await execute("opencomposer.decide", { session_id: sessionId, path, decision });
  } finally {
    reverting--;
  }
  store.decide(sessionId, path, decision);
  post(sessionId);
}

function editorState() {
  const ed = vscode.window.activeTextEditor;
  const openFiles = vscode.window.tabGroups.all
    .flatMap((g) => g.tabs)
    .map((t) => (t.input instanceof vscode.TabInputText ? t.input.uri : undefined))
    .filter((u): u is vscode.Uri => !!u && u.scheme === "file")
    .map((u) => u.toString());
  if (!ed || ed.document.uri.scheme !== "file") return { openFiles };
  const sel = ed.selection;
  return {
    uri: ed.document.uri.toString(),
    selection: {
      start: { line: sel.start.line, character: sel.start.character },
      end: { line: sel.end.line, character: sel.end.character },
    },
    openFiles,
  };
}

/** Ask: a new session, or with `sessionId` a follow-up that continues it. Without a
 * preset query the user types it in an input box. */
async function ask(context: vscode.ExtensionContext, preset?: Record<string, unknown>, sessionId?: string) {
  let query = typeof preset?.query === "string" && !preset.uri ? preset.query : undefined;
  if (!query) {
    showPanel(context); // it loads while the question is typed
    query = await vscode.window.showInputBox({
      prompt: "Ask opencomposer",
      value: typeof preset?.query === "string" ? preset.query : "",
      placeHolder: "fix the failing test in tests/test_retry.py",
    });
  }
  if (!query) return;
  const base = preset?.uri ? { uri: preset.uri as string, selection: preset.selection as any } : editorState();
  const arg = askArguments(query, base, {
    model: config().get<string>("model") || undefined,
    approve: config().get<string>("approve"),
    autoApplyEdits: config().get<boolean>("autoApplyEdits"),
    reveal: config().get<boolean>("revealEdits", true),
    sessionId,
  });
  if (sessionId) {
    store.followUp(sessionId, query);
    post(sessionId);
  } else {
    store.expect(query);
    setTarget(undefined);
  }
  showPanel(context);
  const result = await execute("opencomposer.ask", arg);
  if (result) {
    const s = store.get(result.session_id);
    if (s) {
      s.answer = result.answer;
      s.status = result.status;
      post(s.id);
    }
    updateStatus();
    if (result.status !== "completed") vscode.window.showWarningMessage(`opencomposer: session ${result.status}`);
  } else if (sessionId && store.get(sessionId)?.status === "running") {
    // the follow-up was refused (an unknown or running session): the session stands as it was
    const s = store.get(sessionId)!;
    s.status = "error";
    s.items.push({ kind: "note", text: "[the follow-up was refused]" });
    post(sessionId);
    updateStatus();
  }
}

async function undo(sessionId?: string) {
  const id = sessionId ?? currentSession(store)?.id;
  if (!id) {
    vscode.window.showInformationMessage("opencomposer: no session to undo");
    return;
  }
  review.forgetSession(id);
  reverting++;
  let result: any;
  try {
    result = await execute("opencomposer.undo", { session_id: id });
  } finally {
    reverting--;
  }
  if (result) vscode.window.showInformationMessage(`opencomposer: reverted ${result.reverted.join(", ") || "nothing"}`);
}

async function search() {
  const query = await vscode.window.showInputBox({ prompt: "opencomposer: search the codebase" });
  if (!query) return;
  const hits: any[] = (await execute("opencomposer.search", { query, k: 20 })) ?? [];
  const root = vscode.workspace.workspaceFolders?.[0]?.uri;
  const pick = await vscode.window.showQuickPick(
    hits.map((h) => ({
      label: `${h.path}:${h.start_line}-${h.end_line}`,
      description: h.score.toFixed(3),
      detail: String(h.text ?? "").split("\n")[0],
      hit: h,
    })),
    { matchOnDetail: true, placeHolder: `${hits.length} results for "${query}"` },
  );
  if (pick && root) {
    const doc = await vscode.workspace.openTextDocument(vscode.Uri.joinPath(root, pick.hit.path));
    const line = Math.max(0, pick.hit.start_line - 1);
    await vscode.window.showTextDocument(doc, { selection: new vscode.Range(line, 0, line, 0) });
  }
}

async function submit(sessionId?: string) {
  let id = sessionId;
  if (!id) {
    const sessions: any[] = (await execute("opencomposer.sessions", { limit: 30 })) ?? [];
    const pick = await vscode.window.showQuickPick(
      sessions.map((s) => ({ label: s.query || s.session_id, description: `${s.status} · ${s.edits} edits`, id: s.session_id })),
      { placeHolder: "Session to submit as a training task" },
    );
    id = pick?.id;
  }
  if (!id) return;
  const verify = await vscode.window.showInputBox({ prompt: "Verify command (exit 0 = solved); empty: the session's last passing test command" });
  if (verify === undefined) return;
  const arg: Record<string, unknown> = { session_id: id };
  if (verify) arg.verify = verify;
  const result = await execute("opencomposer.submit", arg);
  if (result) vscode.window.showInformationMessage(`opencomposer: task written to ${result.task_dir}`);
}

async function decideFromReview(sessionId: string, uri: vscode.Uri, decision: "accept" | "reject") {
  await decide(sessionId, vscode.workspace.asRelativePath(uri, false), decision);
}

export async function activate(context: vscode.ExtensionContext) {
  status = vscode.window.createStatusBarItem("opencomposer.status", vscode.StatusBarAlignment.Left, 100);
  status.name = "opencomposer";
  status.command = "opencomposer.client.panel";
  status.tooltip = "opencomposer: show the session panel";
  updateStatus();
  status.show();
  review = new InlineReview(decideFromReview);
  const register = (id: string, fn: (...a: any[]) => unknown) => context.subscriptions.push(vscode.commands.registerCommand(id, fn));
  register("opencomposer.client.ask", () => ask(context));
  register("opencomposer.client.cancel", () => execute("opencomposer.cancel", {}));
  register("opencomposer.client.search", search);
  register("opencomposer.client.undo", () => undo());
  register("opencomposer.client.submit", () => submit());
  register("opencomposer.client.panel", () => showPanel(context));
  register("opencomposer.client.newSession", () => {
    showPanel(context);
    setTarget(undefined);
    void panel?.webview.postMessage({ type: "focus" });
  });
  register("opencomposer.client.acceptHunk", (uri: string, index: number) => review.acceptHunk(uri, index));
  register("opencomposer.client.rejectHunk", (uri: string, index: number) => review.rejectHunk(uri, index));
  register("opencomposer.client.acceptFile", (uri?: string) => review.acceptFile(uri ?? activeUri()));
  register("opencomposer.client.rejectFile", (uri?: string) => review.rejectFile(uri ?? activeUri()));
  register("opencomposer.client.acceptAll", () => review.acceptAll());
  register("opencomposer.client.rejectAll", () => review.rejectAll());
  context.subscriptions.push(
    status,
    review,
    vscode.languages.registerCodeLensProvider({ scheme: "file" }, review),
    vscode.window.onDidChangeVisibleTextEditors(() => review.refresh()),
    vscode.workspace.onDidChangeTextDocument((e) => {
      if (review.store.get(e.document.uri.toString())) review.refresh(e.document.uri.toString());
    }),
    { dispose: () => ticker && clearInterval(ticker) },
  );
  try {
    client = await startClient(context);
  } catch (e: any) {
    serverState = "stopped";
    updateStatus();
    vscode.window.showErrorMessage(`opencomposer: could not start the server: ${e?.message ?? e}`);
  }
}

function activeUri(): string {
  return vscode.window.activeTextEditor?.document.uri.toString() ?? "";
}

export async function deactivate() {
  await client?.stop();
}
