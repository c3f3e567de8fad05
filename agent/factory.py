"""Every session starts here: `ask`, `serve` (and the TUI through it), `bench` and
the RL environment all call `open_session`, so the agent users talk to is the
agent training runs.

    session = open_session(model=m, workspace=LocalWorkspace(root), traces=TraceStore())
    result = await session.run("fix the failing test")

What it fixes for every caller alike:

- **tools**: every tool of `tools/specs.py`, `codebase_search` included: a session
  always has an index. `index` is an `IndexHandle` (`agent.indexing`), opened on
  the first search; without one, the workspace's own `CodebaseIndex`. Calls that
  change files mark it stale, so a later search sees the change.
- **prompt**: `SessionConfig.prompt_style`, else the model's `prompt_style`, else
  `full` (`Session.prompt_style`).
- **approvals**: the policy of `SessionConfig.approve` alone decides which calls
  need approval (`Session.needs_approval`); `approver` (a person, an editor) is
  asked only about those, and where there is none they are refused.
- **traces**: with a `TraceStore`, the session is recorded like any other.
- **follow-ups**: `history` (a finished session's `Session.history()`, or
  `History.from_trace` of its trace) with that session's `session_id` continues
  it: the new requests see the conversation so far and land in the same trace.

What differs between callers is only what they are: the workspace (the disk, an
editor's buffers, an episode's sandboxed copy), who approves, where events go.
"""

from __future__ import annotations

from opencomposer.agent.events import Event, Subscriber, ToolEnd
from opencomposer.agent.indexing import IndexHandle
from opencomposer.agent.protocols import Model
from opencomposer.agent.session import Approver, History, Session, SessionConfig
from opencomposer.agent.traces import TraceStore
from opencomposer.tools import specs
from opencomposer.tools.protocols import Workspace


def open_session(
    *,
    model: Model,
    workspace: Workspace,
    config: SessionConfig | None = None,
    index: IndexHandle | None = None,
    traces: TraceStore | None = None,
    on_event: Subscriber | None = None,
    approver: Approver | None = None,
    session_id: str | None = None,
    history: History | None = None,
) -> Session:
    """A `Session` of `model` on `workspace` (see the module docstring)."""
    handle = index if index is not None else IndexHandle(workspace.root)

    def sink(event: Event) -> None:
        if isinstance(event, ToolEnd) and not _read_only(event.name):
            handle.changed()
        if on_event is not None:
            on_event(event)

    return Session(
        model=model,
        workspace=workspace,
        config=config,
        on_event=sink,
        approver=approver,
        traces=traces,
        index_factory=handle.get,
        session_id=session_id,
        history=history,
    )


def _read_only(name: str) -> bool:
    spec = specs.BY_NAME.get(name)
    return spec is None or spec.read_only  # an unknown tool never ran
