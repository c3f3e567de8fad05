/**
 * Inline review in the editor, as Cursor does it: the agent's edits are already in
 * the buffer; here they show as a diff against each file's baseline (review.ts) —
 * added lines with the editor's diff colours, removed lines as struck-through
 * text after the line where they were (the whole text on hover) — with CodeLens
 * actions "Accept" / "Reject" above every hunk and "Accept file" / "Reject file"
 * on the first line. "Accept all" / "Reject all" have keybindings; "Undo Session"
 * reverts every file of a session.
 *
 * A file is resolved when no hunk is left: the server then records the decision
 * (`opencomposer.decide`, accept when any hunk was kept, else reject — which also
 * deletes a file the session created).
 */

import * as vscode from "vscode";
import { Hunk, ReviewStore, minimalEdit, rejectHunk } from "./review";

export type Decide = (sessionId: string, uri: vscode.Uri, decision: "accept" | "reject") => Promise<void>;

const REMOVED_PREVIEW = 80;

export class InlineReview implements vscode.CodeLensProvider {
  readonly store = new ReviewStore();
  private readonly lensesChanged = new vscode.EventEmitter<void>();
  readonly onDidChangeCodeLenses = this.lensesChanged.event;
  private readonly added = vscode.window.createTextEditorDecorationType({
    isWholeLine: true,
    backgroundColor: new vscode.ThemeColor("diffEditor.insertedLineBackground"),
    overviewRulerColor: new vscode.ThemeColor("editorOverviewRuler.addedForeground"),
    overviewRulerLane: vscode.OverviewRulerLane.Left,
  });
  private readonly removed = vscode.window.createTextEditorDecorationType({
    isWholeLine: true,
    borderColor: new vscode.ThemeColor("editorOverviewRuler.deletedForeground"),
    borderStyle: "solid",
    borderWidth: "1px 0 0 0",
    overviewRulerColor: new vscode.ThemeColor("editorOverviewRuler.deletedForeground"),
    overviewRulerLane: vscode.OverviewRulerLane.Left,
  });

  constructor(private readonly decide: Decide) {}

  dispose(): void {
    this.added.dispose();
    this.removed.dispose();
    this.lensesChanged.dispose();
  }

  /** Record `uri`'s baseline before `sessionId`'s edit lands (first edit only). */
  async track(sessionId: string, uri: vscode.Uri): Promise<void> {
    const key = uri.toString();
    if (this.store.get(key)) return;
    const open = vscode.workspace.textDocuments.find((d) => d.uri.toString() === key);
    if (open) return this.store.track(sessionId, key, open.getText(), false);
    try {
      const bytes = await vscode.workspace.fs.readFile(uri);
      this.store.track(sessionId, key, new TextDecoder().decode(bytes), false);
    } catch {
      this.store.track(sessionId, key, "", true);
    }
  }

  private document(uri: string): vscode.TextDocument | undefined {
    return vscode.workspace.textDocuments.find((d) => d.uri.toString() === uri);
  }

  private text(uri: string): string | undefined {
    return this.document(uri)?.getText();
  }

  hunks(uri: string): Hunk[] {
    const text = this.text(uri);
    return text === undefined ? [] : this.store.hunks(uri, text);
  }

  /** Repaint decorations and lenses (all editors, or those showing `uri`). */
  refresh(uri?: string): void {
    for (const ed of vscode.window.visibleTextEditors) {
      const key = ed.document.uri.toString();
      if (uri && key !== uri) continue;
      this.paint(ed);
    }
    this.lensesChanged.fire();
    const pending = this.store.pending((u) => this.text(u)).length > 0;
    void vscode.commands.executeCommand("setContext", "opencomposer.reviewPending", pending);
  }

  private paint(ed: vscode.TextEditor): void {
    const hunks = this.store.get(ed.document.uri.toString()) ? this.hunks(ed.document.uri.toString()) : [];
    const added: vscode.DecorationOptions[] = [];
    const removed: vscode.DecorationOptions[] = [];
    const last = ed.document.lineCount - 1;
    for (const h of hunks) {
      for (let i = 0; i < h.added.length; i++) {
        const line = Math.min(h.curStart + i, last);
        added.push({ range: new vscode.Range(line, 0, line, 0) });
      }
      if (h.removed.length === 0) continue;
      const line = Math.min(h.curStart, last);
      const first = h.removed[0].trim();
      const preview = first.length > REMOVED_PREVIEW ? first.slice(0, REMOVED_PREVIEW - 1) + "…" : first;
      const more = h.removed.length > 1 ? `  (+${h.removed.length - 1} more removed)` : "";
      const hover = new vscode.MarkdownString();
      hover.appendMarkdown(`**opencomposer** removed ${h.removed.length} line${h.removed.length === 1 ? "" : "s"}:`);
      hover.appendCodeblock(h.removed.map((l) => "- " + l).join("\n"), "diff");
      removed.push({
        range: new vscode.Range(line, 0, line, 0),
        hoverMessage: hover,
        renderOptions: {
          after: {
            contentText: `   ⊖ ${preview}${more}`,
            color: new vscode.ThemeColor("editorOverviewRuler.deletedForeground"),
            textDecoration: "line-through",
            fontStyle: "italic",
          },
        },
      });
    }
    ed.setDecorations(this.added, added);
    ed.setDecorations(this.removed, removed);
  }

  provideCodeLenses(doc: vscode.TextDocument): vscode.CodeLens[] {
    const uri = doc.uri.toString();
    if (!this.store.get(uri)) return [];
    const hunks = this.hunks(uri);
    if (hunks.length === 0) return [];
    const top = new vscode.Range(0, 0, 0, 0);
    const lenses = [
      new vscode.CodeLens(top, {
        title: `opencomposer: ${hunks.length} change${hunks.length === 1 ? "" : "s"} · Accept file`,
        command: "opencomposer.client.acceptFile",
        arguments: [uri],
      }),
      new vscode.CodeLens(top, { title: "Reject file", command: "opencomposer.client.rejectFile", arguments: [uri] }),
    ];
    hunks.forEach((h, index) => {
      const line = Math.min(h.curStart, doc.lineCount - 1);
      const at = new vscode.Range(line, 0, line, 0);
      const size = `+${h.added.length} −${h.removed.length}`;
      lenses.push(
        new vscode.CodeLens(at, { title: `✓ Accept (${size})`, command: "opencomposer.client.acceptHunk", arguments: [uri, index] }),
        new vscode.CodeLens(at, { title: "✗ Reject", command: "opencomposer.client.rejectHunk", arguments: [uri, index] }),
      );
    });
    return lenses;
  }

  private hunk(uri: string, index: number): Hunk | undefined {
    return this.hunks(uri)[index];
  }

  async acceptHunk(uri: string, index: number): Promise<void> {
    const h = this.hunk(uri, index);
    if (!h) return;
    this.store.accept(uri, h);
    this.refresh(uri);
    await this.settle(uri);
  }

  async rejectHunk(uri: string, index: number): Promise<void> {
    const doc = this.document(uri);
    const h = this.hunk(uri, index);
    if (!doc || !h) return;
    const before = doc.getText();
    const change = minimalEdit(before, rejectHunk(before, h));
    const edit = new vscode.WorkspaceEdit();
    edit.replace(doc.uri, new vscode.Range(doc.positionAt(change.start), doc.positionAt(change.end)), change.text);
    await vscode.workspace.applyEdit(edit);
    this.refresh(uri);
    await this.settle(uri);
  }

  /** Once no hunk is left, hand the file's decision to the server and forget it. */
  private async settle(uri: string): Promise<void> {
    const r = this.store.get(uri);
    const doc = this.document(uri);
    if (!r || !doc || this.store.hunks(uri, doc.getText()).length > 0) return;
    this.store.forget(uri);
    if (doc.isDirty) await doc.save();
    await this.decide(r.sessionId, doc.uri, r.accepted > 0 ? "accept" : "reject");
    this.refresh(uri);
  }

  async acceptFile(uri: string): Promise<void> {
    const r = this.store.get(uri);
    if (!r) return;
    this.store.forget(uri);
    this.refresh(uri);
    await this.decide(r.sessionId, vscode.Uri.parse(uri), "accept");
  }

  /** The server puts the file back as it was before the session (deleting a file the
   * session created). */
  async rejectFile(uri: string): Promise<void> {
    const r = this.store.get(uri);
    if (!r) return;
    this.store.forget(uri);
    await this.decide(r.sessionId, vscode.Uri.parse(uri), "reject");
    this.refresh(uri);
  }

  async acceptAll(): Promise<void> {
    for (const uri of [...this.store.files.keys()]) await this.acceptFile(uri);
  }

  async rejectAll(): Promise<void> {
    for (const uri of [...this.store.files.keys()]) await this.rejectFile(uri);
  }

  /** A session's files leave review (after Undo Session, or decisions in the panel). */
  forgetSession(sessionId: string): void {
    for (const uri of this.store.forgetSession(sessionId)) this.refresh(uri);
  }

  forget(uri: string): void {
    this.store.forget(uri);
    this.refresh(uri);
  }
}
