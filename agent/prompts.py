"""The system prompt and the user message of a session, rendered from the tool specs.

Two styles of system prompt:

- `full` (~1,000 tokens): every parameter of every tool, with rules; for models
  that can use the detail.
- `compact` (~300 tokens): one line per tool, its example call and what it does;
  for small models such as the embedded SmolLM2-135M, whose context is short and
  whose every prompt token costs sampling and training time. A model folder can
  ask for it (see `agent.backends.model_prompt_style`), and the RL loop trains
  with the same style the production agent then uses.
"""

from __future__ import annotations

from opencomposer.tools import specs as registry
from opencomposer.tools.specs import ToolSpec, render_prompt

SYSTEM = """You are opencomposer, a coding agent working in the user's repository.
You act by writing tool calls as XML elements in your reply. Short parameters are
attributes; long ones are child elements whose text is taken exactly as written
(do not escape < or &). Gather evidence before you edit: search and read first,
and put independent calls in the same reply — they run in parallel, and their
results come back together in the next message as <tool_result> elements.
When the task is done, reply with a short answer and no tool call.

Rules:
- Paths are relative to the repository root.
- Do not put tool calls inside ``` code fences.
{rules}
# Tools

{tools}
"""


COMPACT = """You are opencomposer, a coding agent in the user's repository. Act by writing \
tool calls as XML; independent calls in one reply run in parallel, and their results \
come back in the next message. Read or search before you edit. Paths are relative to \
the repository root. When the task is done, reply with a short answer and no tool call.

Tools:
{tools}
"""

STYLES = ("full", "compact")


def system_prompt(specs: tuple[ToolSpec, ...] | None = None, *, style: str = "full") -> str:
    """The system prompt over `specs` (default: every registered tool)."""
    specs = registry.SPECS if specs is None else specs
    if style == "compact":
        return COMPACT.format(tools=render_prompt(specs, compact=True))
    if style != "full":
        raise ValueError(f"unknown prompt style {style!r}: expected {' or '.join(STYLES)}")
    rules = "".join(f"- {s.rule}\n" for s in specs if s.rule)
    return SYSTEM.format(tools=render_prompt(specs), rules=rules)


def user_message(query: str, context: str | None = None) -> str:
    if not context:
        return query
    return f"{query}\n\n<context>\n{context}\n</context>"
