"""Workload and cluster files: good files load; bad values get an error naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.reconfigurator.core.files import (
    SpecError,
    load_cluster,
    load_workload,
    parse_cluster,
    parse_workload,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "services" / "reconfigurator" / "examples"
PROFILE_TPS = (1, 2, 4, 8)


def workload(**overrides) -> dict:
    classes = [
        {"name": "a", "prompt_tokens": 100, "output_tokens": 256, "rate": 1.0},
        {"name": "b", "prompt_tokens": 900, "output_tokens": 128, "rate": 0.5},
        {"name": "c", "prompt_tokens": 10, "output_tokens": 64, "rate": 2.0},
    ]
    return {"classes": classes, **overrides}


def cluster(**overrides) -> dict:
    nodes = [{"name": f"node-{i}", "gpu_ids": [0, 1, 2, 3]} for i in range(2)]
    placement = [
        {"node": "node-0", "tp": 4, "gpu_ids": [0, 1, 2, 3]},
        {"node": "node-1", "tp": 1, "gpu_ids": [2]},
    ]
    return {"nodes": nodes, "tp_degrees": [1, 2, 4], "placement": placement, **overrides}


def error_of(call, *args) -> str:
    with pytest.raises(SpecError) as info:
        call(*args)
    return str(info.value)


def test_examples_load():
    loaded = load_workload(EXAMPLES / "workload.json")
    assert len(loaded.classes) == 3 and loaded.thresholds == (0.5, 0.6, 0.7, 0.8, 0.9)
    assert loaded.classes[2].steps_by_threshold[0.9].cache == 112
    shape = load_cluster(EXAMPLES / "cluster-16.json", PROFILE_TPS)
    assert shape.num_gpus == 16 and shape.current_instances_by_tp() == {1: 16, 2: 0, 4: 0}


def test_negative_rate_names_the_field():
    data = workload()
    data["classes"][2]["rate"] = -1
    assert error_of(parse_workload, data, "w.json") == "w.json: classes[2].rate: expected `float` >= 0.0"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"thresholds": [0.5, 1.5]}, "thresholds[1]"),
        ({"thresholds": [0.9, 0.9]}, "thresholds"),
        ({"safety_buffer": -0.1}, "safety_buffer"),
        ({"block_length": 0}, "block_length"),
        ({"slo_s": 0}, "slo_s"),
        ({"classes": []}, "classes"),
        ({"tokens_per_step": {"x": 2.0}}, "tokens_per_step.x"),
    ],
)
def test_bad_workload_values_name_the_field(change, field):
    assert f": {field}: " in error_of(parse_workload, workload(**change), "w.json")


def test_unknown_field_is_named():
    assert "w.json: object contains unknown field `surprise`" == error_of(
        parse_workload, workload(surprise=1), "w.json"
    )


def test_bad_class_entries_name_the_field():
    data = workload()
    data["classes"][1]["output_tokens"] = 0
    assert "classes[1].output_tokens" in error_of(parse_workload, data)
    data = workload()
    data["classes"][1]["name"] = "a"
    assert "classes[1].name: duplicate" in error_of(parse_workload, data)
    data = workload()
    data["classes"][0]["steps"] = {"0.95": {"recompute": 8, "cache": 10}}
    assert "classes[0].steps.0.95: threshold not in thresholds" in error_of(parse_workload, data)


def test_unknown_tp_degree_names_the_field():
    assert "tp_degrees[1]: unknown TP degree 3" in error_of(
        parse_cluster, cluster(tp_degrees=[1, 3]), PROFILE_TPS
    )
    data = cluster()
    data["placement"][1]["tp"] = 2
    data["placement"][1]["gpu_ids"] = [2, 3]
    data["tp_degrees"] = [1, 4]
    assert "placement[1].tp: unknown TP degree 2" in error_of(parse_cluster, data, PROFILE_TPS)


def test_more_gpus_than_the_node_has_names_the_field():
    message = error_of(parse_cluster, cluster(tp_degrees=[1, 2, 4, 8]), PROFILE_TPS)
    assert "tp_degrees[3]: TP-8 needs 8 GPUs on one node, but the largest node has 4" in message
    data = cluster()
    data["placement"][1]["gpu_ids"] = [7]
    assert "placement[1].gpu_ids: GPU 7 does not exist on node 'node-1'" in error_of(
        parse_cluster, data, PROFILE_TPS
    )
    data = cluster()
    data["placement"][0]["gpu_ids"] = [0, 1, 2]
    assert "placement[0].gpu_ids: 3 GPUs listed for a TP-4 instance" in error_of(
        parse_cluster, data, PROFILE_TPS
    )


def test_gpu_used_twice_names_both_entries():
    data = cluster()
    data["placement"].append({"node": "node-0", "tp": 1, "gpu_ids": [3]})
    message = error_of(parse_cluster, data, PROFILE_TPS)
    assert "placement[2].gpu_ids: GPU 3 of node 'node-0' is already used by placement[0]" in message


def test_other_cluster_errors():
    data = cluster()
    data["placement"][0]["node"] = "node-9"
    assert "placement[0].node: no node named 'node-9'" in error_of(parse_cluster, data, PROFILE_TPS)
    data = cluster()
    data["nodes"][1]["gpu_ids"] = [0, 0]
    assert "nodes[1].gpu_ids: lists a GPU twice" in error_of(parse_cluster, data, PROFILE_TPS)
    data = cluster()
    data["nodes"][0]["gpu_ids"] = [-1]
    assert "nodes[0].gpu_ids[0]" in error_of(parse_cluster, data, PROFILE_TPS)


def test_default_tp_degrees_are_the_profiles_that_fit():
    data = cluster()
    del data["tp_degrees"]
    assert parse_cluster(data, PROFILE_TPS).tp_degrees == (1, 2, 4)


def test_unreadable_and_invalid_json(tmp_path):
    assert "cannot read" in error_of(load_workload, tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(workload())[:-3])
    assert "not valid JSON" in error_of(load_workload, bad)
