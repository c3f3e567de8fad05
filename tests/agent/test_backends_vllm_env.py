"""The environment the vLLM backend starts its engine processes with, on CPU: no core
kept back for the scheduler on a 2-core machine, libgomp's own wait policy where only
the llama.cpp backend's import chose "passive", and whatever the user set kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from opencomposer.agent.backends import _local
from opencomposer.agent.backends import vllm as vllm_backend
from opencomposer.agent.backends.vllm import VLLMModel, _environ

pytest.importorskip("vllm")
from vllm.platforms import current_platform  # noqa: E402

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="vLLM's CPU platform")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv(_local.DEFAULT_WAIT, raising=False)
    monkeypatch.setattr(_local, "_own_wait_policy", False)
    return monkeypatch


MARK = {_local.DEFAULT_WAIT: "1"}


def cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(vllm_backend.os, "sched_getaffinity", lambda _pid: set(range(n)))


def test_two_cores_keep_none_back_and_more_cores_keep_vllms_default(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    cores(clean_env, 2)
    assert VLLMModel(tmp_path).engine_env() == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **MARK}
    cores(clean_env, 16)
    assert VLLMModel(tmp_path).engine_env() == MARK


def test_a_reservation_the_user_set_is_kept(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    cores(clean_env, 2)
    clean_env.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert VLLMModel(tmp_path).engine_env() == MARK


def test_only_our_own_passive_wait_policy_is_lifted(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    cores(clean_env, 16)
    _local.passive_omp_wait()  # what importing the llama.cpp backend does
    assert os.environ["OMP_WAIT_POLICY"] == "passive"
    env = VLLMModel(tmp_path).engine_env()
    assert env == {"OMP_WAIT_POLICY": None, **MARK}
    with _environ(env):
        assert "OMP_WAIT_POLICY" not in os.environ
        # the engine's processes re-import our modules: they do not set it again
        clean_env.setattr(_local, "_own_wait_policy", False)
        _local.passive_omp_wait()
        assert "OMP_WAIT_POLICY" not in os.environ
    assert _local.DEFAULT_WAIT not in os.environ  # restored after the engine starts
    clean_env.setenv("OMP_WAIT_POLICY", "passive")

    clean_env.setattr(_local, "_own_wait_policy", False)
    clean_env.setenv("OMP_WAIT_POLICY", "passive")  # the user's choice
    _local.passive_omp_wait()
    assert VLLMModel(tmp_path).engine_env() == {}


def test_environ_restores_values_and_absences(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OC_TEST_A", "1")
    clean_env.delenv("OC_TEST_B", raising=False)
    with _environ({"OC_TEST_A": None, "OC_TEST_B": "2"}):
        assert "OC_TEST_A" not in os.environ and os.environ["OC_TEST_B"] == "2"
    assert os.environ["OC_TEST_A"] == "1" and "OC_TEST_B" not in os.environ


@pytest.mark.parametrize(("native", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_the_engine_loads_bf16_only_where_the_cpu_has_native_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool, dtype: str
) -> None:
    from opencomposer.index import embed

    monkeypatch.setattr(embed, "cpu_has_bf16", lambda: native)
    assert VLLMModel(tmp_path).engine_args()["dtype"] == dtype
    assert VLLMModel(tmp_path, dtype="bfloat16").engine_args()["dtype"] == "bfloat16"  # asked for
    assert VLLMModel(tmp_path).weight_dtype == dtype  # what weight sync sends it
