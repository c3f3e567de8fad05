"""The [cluster] config section and the weight payloads (whole or delta), no Ray."""

import pytest
import torch
from opencomposer.training.cluster import WeightPayload, apply_weights, bf16_state, encode_weights
from opencomposer.training.config import ConfigError, parse_config
from opencomposer.training.trainer import tiny_llama


def test_no_cluster_section_keeps_the_one_process_run():
    assert parse_config({}).cluster is None


def test_cluster_section_parses_and_rejects_bad_values():
    cfg = parse_config({"cluster": {"address": "auto", "samplers": 2, "trainer_ranks": 2}})
    assert cfg.cluster is not None and cfg.cluster.samplers == 2 and cfg.cluster.address == "auto"
    bad = [
        ({"samplers": 0}, "cluster.samplers"),
        ({"backend": "nccl"}, "trainer_gpus"),
        ({"strategy": "zero3"}, "cluster.strategy"),
        ({"sampler_gpu": 1}, "unknown key cluster.sampler_gpu"),
        ({"master_port": 70000}, "master_port"),
    ]
    for section, words in bad:
        with pytest.raises(ConfigError, match=words):
            parse_config({"cluster": section})
    with pytest.raises(ConfigError, match="warmup_rounds"):
        parse_config({"cluster": {}, "sft": {"warmup_rounds": 1}})


def test_delta_round_trip_equals_the_new_weights_and_is_small():
    """Guards the replica's copy: base + delta must be bitwise the trainer's bf16 weights."""
    old = bf16_state(tiny_llama())
    new = {k: v.clone() for k, v in old.items()}
    w = new["model.layers.0.mlp.up_proj.weight"]
    w.view(-1)[:5] += 1.0  # a few elements move
    new["model.norm.weight"] = new["model.norm.weight"] + 0.5  # a whole tensor moves
    p = encode_weights(new, old, version=2, base_version=1)
    assert set(p.sparse) == {"model.layers.0.mlp.up_proj.weight"}
    assert set(p.full) == {"model.norm.weight"}
    assert p.nbytes < 0.05 * p.total_bytes
    shadow = {k: v.clone() for k, v in old.items()}
    apply_weights(p, shadow)
    for k in new:
        assert torch.equal(shadow[k].view(torch.int16), new[k].view(torch.int16)), k


def test_full_payload_replaces_everything_and_tied_weights_go_once():
    m = tiny_llama()
    state = bf16_state(m)
    assert "lm_head.weight" not in state  # tied to the embedding: sent once
    p = encode_weights(state, None, version=1, base_version=None)
    assert isinstance(p, WeightPayload) and p.base_version is None and p.nbytes == p.total_bytes
    shadow = {"stale": torch.zeros(1)}
    apply_weights(p, shadow)
    assert set(shadow) == set(state)
    # no delta when asked for none, even with a base
    assert encode_weights(state, state, version=2, base_version=1, delta=False).nbytes == p.nbytes


def test_the_example_cluster_configs_load():
    from pathlib import Path

    from opencomposer.training.config import load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    local = load_config(root / "cluster-local.toml").cluster
    assert local is not None and local.address == "" and local.samplers == 2
    remote = load_config(root / "cluster-example.toml").cluster
    assert remote is not None and remote.backend == "nccl" and remote.strategy == "fsdp2"


def test_an_unreachable_cluster_address_is_one_line_at_once():
    """Guards against ray.init retrying a dead address for minutes."""
    import socket

    from opencomposer.training.cluster import ClusterError, check_reachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ClusterError, match="cannot reach the Ray cluster") as e:
            check_reachable(f"127.0.0.1:{port}")
    assert "\n" not in str(e.value)
    with pytest.raises(ClusterError):
        check_reachable("no-port")
    check_reachable("")  # a local Ray
    check_reachable("auto")  # Ray finds it


def test_replicas_on_different_versions_are_a_lag_error_and_episodes_go_to_the_least_busy():
    from opencomposer.training.cluster import Cluster, Slot, _least
    from opencomposer.training.weight_sync import SamplerLagError

    cfg = parse_config({"cluster": {"samplers": 2}})
    cluster = Cluster(cfg, ".", make_model=None, to_rollout=None)
    cluster.replica_versions = [3, 3]
    assert cluster.sampler.weight_version == 3
    cluster.replica_versions = [3, 2]
    with pytest.raises(SamplerLagError, match="different weight versions"):
        _ = cluster.sampler.weight_version
    slots = [Slot(index=0, inflight=2), Slot(index=1, inflight=1), Slot(index=2, inflight=1)]
    slots[1].served = 5
    assert _least(slots).index == 2  # fewest in flight, then fewest served
