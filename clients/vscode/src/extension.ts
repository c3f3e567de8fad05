/**
 * opencomposer for VS Code: a client of `opencomposer serve --stdio` (docs/lsp.md).
 *
 * Commands (palette, category "opencomposer"): Ask, Cancel, Search, Undo Session,
 * Submit Session, Show Session Panel. The panel streams every session; the status
 * bar shows what the agent is doing. The agent's edits arrive as
 * `workspace/applyEdit`: they land in documents (Ctrl+Z undoes them), and files
 * that had no unsaved changes are saved so the agent's commands see them.
 * Approvals (`window/showMessageRequest`) use VS Code's standard message buttons.
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
  TransportKind,
} from "vscode-languageclient/node";
import { Event, SessionStore, askArguments, currentSession, filesToSave, statusText } from "./model";
import { pageHtml, renderSession } from "./panel";

let client: LanguageClient | undefined;
const store = new SessionStore();
let panel: vscode.WebviewPanel | undefined;
let status: vscode.StatusBarItem;

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
  await c.start();
  c.onNotification("opencomposer/event", (ev: Event) => onEvent(context, ev));
  c.onRequest(ApplyWorkspaceEditRequest.type, (params) => applyEdit(c, params));
  return c;
}

/** Apply the server's edit to documents, then save those that were clean before. */
async function applyEdit(c: LanguageClient, params: ApplyWorkspaceEditParams): Promise<ApplyWorkspaceEditResult> {
  const edit = await c.protocol2CodeConverter.asWorkspaceEdit(params.edit);
  const touched = edit.entries().map(([uri]) => uri.toString());
  const dirty = new Set(vscode.workspace.textDocuments.filter((d) => d.isDirty).map((d) => d.uri.toString()));
  const applied = await vscode.workspace.applyEdit(edit);
  if (!applied) return { applied: false, failureReason: "VS Code could not apply the edit" };
  if (config().get<boolean>("saveEdits", true)) {
    for (const uri of filesToSave(touched, dirty)) {
      const doc = vscode.workspace.textDocuments.find((d) => d.uri.toString() === uri);
      if (doc && doc.isDirty) await doc.save();
    }
  }
  return { applied: true };
}

function onEvent(context: vscode.ExtensionContext, ev: Event) {
  const s = store.apply(ev);
  status.text = statusText(store);
  if (!panel) showPanel(context);
  panel?.webview.postMessage({ id: s.id, html: renderSession(s) });
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
  for (const s of store.sessions.values()) panel.webview.postMessage({ id: s.id, html: renderSession(s) });
  panel.webview.onDidReceiveMessage((m) => onPanelMessage(m), undefined, context.subscriptions);
  panel.onDidDispose(() => (panel = undefined), undefined, context.subscriptions);
}

async function onPanelMessage(m: { type: string; session_id: string; path?: string; decision?: "accept" | "reject" }) {
  if (m.type === "decide" && m.path && m.decision) {
    await execute("opencomposer.decide", { session_id: m.session_id, path: m.path, decision: m.decision });
    store.decide(m.session_id, m.path, m.decision);
  } else if (m.type === "undo") {
    await undo(m.session_id);
  } else if (m.type === "cancel") {
    await execute("opencomposer.cancel", { session_id: m.session_id });
  }
  const s = store.get(m.session_id);
  if (s) panel?.webview.postMessage({ id: s.id, html: renderSession(s) });
}

async function execute(command: string, arg: Record<string, unknown>): Promise<any> {
  if (!client) throw new Error("the opencomposer server is not running");
  try {
    return await client.sendRequest("workspace/executeCommand", { command, arguments: [arg] });
  } catch (e: any) {
    vscode.window.showErrorMessage(`opencomposer: ${e?.message ?? e}`);
    return undefined;
  }
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

async function ask(context: vscode.ExtensionContext, preset?: Record<string, unknown>) {
  const query = await vscode.window.showInputBox({
    prompt: "Ask opencomposer",
    value: typeof preset?.query === "string" ? preset.query : "",
    placeHolder: "fix the failing test in tests/test_retry.py",
  });
  if (!query) return;
  const base = preset ? { uri: preset.uri as string | undefined, selection: preset.selection as any } : editorState();
  const arg = askArguments(query, base, {
    model: config().get<string>("model") || undefined,
    approve: config().get<string>("approve"),
    autoApplyEdits: config().get<boolean>("autoApplyEdits"),
  });
  store.expect(query);
  showPanel(context);
  const result = await execute("opencomposer.ask", arg);
  if (result) {
    status.text = statusText(store);
    const s = store.get(result.session_id);
    if (s) {
      s.answer = result.answer;
      s.status = result.status;
    }
    if (result.status !== "completed") vscode.window.showWarningMessage(`opencomposer: session ${result.status}`);
  }
}

async function undo(sessionId?: string) {
  const id = sessionId ?? currentSession(store)?.id;
  if (!id) {
    vscode.window.showInformationMessage("opencomposer: no session to undo");
    return;
  }
  const result = await execute("opencomposer.undo", { session_id: id });
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
    { matchOnDetail: true },
  );
  if (pick && root) {
    const doc = await vscode.workspace.openTextDocument(vscode.Uri.joinPath(root, pick.hit.path));
    const line = Math.max(0, pick.hit.start_line - 1);
    await vscode.window.showTextDocument(doc, { selection: new vscode.Range(line, 0, line, 0) });
  }
}

async function submit() {
  const sessions: any[] = (await execute("opencomposer.sessions", { limit: 30 })) ?? [];
  const pick = await vscode.window.showQuickPick(
    sessions.map((s) => ({ label: s.query || s.session_id, description: `${s.status} · ${s.edits} edits`, id: s.session_id })),
    { placeHolder: "Session to submit as a training task" },
  );
  if (!pick) return;
  const verify = await vscode.window.showInputBox({ prompt: "Verify command (exit 0 = solved); empty: the session's last passing test command" });
  const arg: Record<string, unknown> = { session_id: pick.id };
  if (verify) arg.verify = verify;
  const result = await execute("opencomposer.submit", arg);
  if (result) vscode.window.showInformationMessage(`opencomposer: task written to ${result.task_dir}`);
}

export async function activate(context: vscode.ExtensionContext) {
  status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Left, 100);
  status.text = statusText(store);
  status.command = "opencomposer.client.panel";
  status.tooltip = "opencomposer: show the session panel";
  status.show();
  const register = (id: string, fn: (...a: any[]) => unknown) => context.subscriptions.push(vscode.commands.registerCommand(id, fn));
  register("opencomposer.client.ask", () => ask(context));
  register("opencomposer.client.cancel", () => execute("opencomposer.cancel", {}));
  register("opencomposer.client.search", search);
  register("opencomposer.client.undo", () => undo());
  register("opencomposer.client.submit", submit);
  register("opencomposer.client.panel", () => showPanel(context));
  context.subscriptions.push(status);
  try {
    client = await startClient(context);
  } catch (e: any) {
    vscode.window.showErrorMessage(`opencomposer: could not start the server: ${e?.message ?? e}`);
    return;
  }
}

export async function deactivate() {
  await client?.stop();
}
