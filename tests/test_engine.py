import pytest
import torch

from moe_reference import random_layer, random_routing, reference_moe, slot_kernel
from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.engine import OffloadEngine


def make_engine(**config):
    engine = OffloadEngine(SpecExpertConfig.from_dict(config), torch.device("cpu"))
    layers = {f"model.layers.{i}.mlp.experts": random_layer(seed=i) for i in range(2)}
    for name, tensors in layers.items():
        engine.add_layer(name, tensors, top_k=4)
    return engine, layers


def test_engine_runs_layers_exactly_and_aggregates_stats():
    engine, layers = make_engine(budget=0.25)
    for step in range(4):
        for name, tensors in layers.items():
            x, w, ids = random_routing(2, 16, 4, seed=step)
            out = engine.run(name, slot_kernel, x, w, ids)
            assert torch.equal(out, reference_moe(x, w, ids, *tensors.values()))
    stats = engine.stats()
    assert set(stats["slots_per_layer"].values()) == {4}
    per_layer = list(stats["layers"].values())
    assert stats["total"]["misses"] == sum(s["misses"] for s in per_layer) > 0
    assert stats["link"]["bytes"] == stats["total"]["bytes_loaded"]
    assert stats["total"]["max_resident"] == 4
    engine.close()


def test_reconfigure_resizes_caches_and_validates_first():
    engine, _ = make_engine(budget=0.25)
    engine.reconfigure(SpecExpertConfig.from_dict({"budget": 0.5, "cache": "lfu"}))
    assert set(engine.stats()["slots_per_layer"].values()) == {8}
    assert all(c.policy.name == "lfu" for c in engine.caches.values())
    assert engine.stats()["total"]["requests"] == 0
    with pytest.raises(SpecExpertConfigError, match="top_k=4"):
        engine.reconfigure(SpecExpertConfig.from_dict({"budget": 2}))
    assert set(engine.stats()["slots_per_layer"].values()) == {8}  # unchanged
    engine.close()


def test_stats_file(tmp_path):
    path = tmp_path / "stats-{rank}.json"
    engine, _ = make_engine(budget=0.5, stats_path=str(path))
    engine.write_stats()
    import json

    written = json.loads((tmp_path / "stats-0.json").read_text())
    assert written["config"]["budget"] == 0.5 and len(written["layers"]) == 2
    engine.close()
