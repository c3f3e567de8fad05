"""System-prompt styles: the compact one is short, names every tool with a call
that parses, and is chosen by the model (its attribute or its folder's settings)."""

import json

import pytest
from opencomposer.agent.backends import make_model
from opencomposer.agent.backends._local import read_prompt_style, write_model_settings
from opencomposer.agent.prompts import system_prompt
from opencomposer.agent.session import Session, SessionConfig
from opencomposer.agent.xmlcalls import parse_all
from opencomposer.tools.specs import SPECS, parser_rules
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.conftest import scripted


def test_compact_prompt_is_short_and_every_example_parses():
    full, compact = system_prompt(), system_prompt(style="compact")
    assert len(compact) < len(full) / 2
    lines = [line for line in compact.splitlines() if line.startswith("<")]
    assert len(lines) == len(SPECS)
    for spec, line in zip(SPECS, lines, strict=True):
        call, _, what = line.partition(" — ")
        parsed = parse_all(call, *parser_rules())
        assert [(c.name, c.error) for c in parsed] == [(spec.name, None)], line
        spec.validate(parsed[0].raw)  # the example is a valid call
        assert what


def test_unknown_style_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown prompt style 'tiny'"):
        system_prompt(style="tiny")


def test_model_folder_names_its_style(tmp_path):
    assert read_prompt_style(tmp_path) == "full"
    write_model_settings(tmp_path, {"prompt_style": "compact"})
    assert read_prompt_style(tmp_path) == "compact"
    (tmp_path / "opencomposer.json").write_text(json.dumps({"prompt_style": "huge"}))
    assert read_prompt_style(tmp_path) == "full"
    (tmp_path / "opencomposer.json").write_text("{not json")
    assert read_prompt_style(tmp_path) == "full"


def test_hf_backend_reads_the_folder_style(tmp_path):
    write_model_settings(tmp_path, {"prompt_style": "compact"})
    (tmp_path / "config.json").write_text("{}")
    model = make_model(f"hf:{tmp_path}")  # nothing loads until the first turn
    assert model.prompt_style == "compact"
    assert make_model(f"hf:{tmp_path}", prompt_style="full").prompt_style == "full"


@pytest.mark.parametrize(
    ("config_style", "model_style", "expected"),
    [("auto", None, "full"), ("auto", "compact", "compact"), ("full", "compact", "full")],
)
async def test_session_uses_the_style(repo, config_style, model_style, expected):
    model = scripted("Done.")
    if model_style:
        model.prompt_style = model_style
    session = Session(
        model=model,
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all", prompt_style=config_style),
    )
    result = await session.run("say done")
    assert result.status == "completed"
    assert result.turns[0].messages[0].content == system_prompt(style=expected)


def test_a_model_folder_gives_its_turn_budget(tmp_path):
    from opencomposer.agent.backends._local import read_turn_budget, write_model_settings

    assert read_turn_budget(tmp_path) is None
    for bad in (0, -3, True, "8", 2.5):
        write_model_settings(tmp_path, {"max_turns": bad})
        assert read_turn_budget(tmp_path) is None, bad
    write_model_settings(tmp_path, {"prompt_style": "compact", "max_turns": 8})
    assert read_turn_budget(tmp_path) == 8 and read_prompt_style(tmp_path) == "compact"
