"""cluster.yaml against the Ray cluster launcher's own schema (ray/autoscaler/ray-schema.json in the ray wheel)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from tests.conftest import ROOT


def test_cluster_yaml_validates_against_the_launcher_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    nodes = config["available_node_types"]
    assert nodes[config["head_node_type"]]["resources"].get("GPU", 0) == 0, "a CPU head"
    gpu_types = [n for n in nodes.values() if n["resources"].get("GPU", 0) >= 8]
    assert gpu_types and all(0 <= n["min_workers"] <= n["max_workers"] for n in gpu_types)
    assert any("pip install" in c and ".[gpu]" in c for c in config["setup_commands"])


def test_a_broken_cluster_yaml_is_caught_by_the_same_check():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["available_node_types"]["head"]["max_workers"] = "eight"
    with pytest.raises(jsonschema.ValidationError, match="'eight' is not of type 'integer'"):
        jsonschema.validate(config, schema)
