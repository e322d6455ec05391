"""Adding a slow tier costs one new module under ``tiers/``, one line in the registry
(``tiers/slow_tiers.py``) and one word in the package's map; the store, the engine and
the adapter are not touched.

Shown on a copy of the package: the test writes a tier as its author would, experts in
an ``.npz`` file beside the model read through numpy's reader, adds its lines, then
runs, in a fresh interpreter on the copy, the layout checks and a toy engine whose
layers the tier serves: at a quarter of the experts resident every call loads from it,
and the output equals the reference bit for bit; its stats section is there."""

from pathlib import Path

import pytest
from package_copy import add_module, copy_package, edit, layout_check, report_of, run_in_copy

TIER_MODULE = '''"""Experts in ``experts.npz`` beside the model, bf16 stored as uint16 (a toy slow
tier: read whole at open through numpy's reader)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.tiers.store import LayerExperts

FILE = "experts.npz"


class NpzPack:
    name: ClassVar[str] = "npz_pack"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.archive = np.load(path)
        self.layers_read = 0

    @classmethod
    def configured(cls, config: SpecExpertConfig, model: str) -> bool:
        return (Path(model) / FILE).exists()

    @classmethod
    def open(cls, config: SpecExpertConfig, model: str) -> NpzPack:
        return cls(Path(model) / FILE)

    def layer(self, name: str) -> LayerExperts:
        keys = [k for k in self.archive.files if k.startswith(name + "/")]
        if not keys:
            raise SpecExpertConfigError("model", f"{self.path} has no experts of {name}", "pack it")
        self.layers_read += 1
        tensors = {
            k.removeprefix(name + "/"): torch.from_numpy(self.archive[k]).view(torch.bfloat16)
            for k in keys
        }
        return LayerExperts(name=name, tensors=tensors)

    def where(self) -> str:
        return f"in {self.path}"

    def stats_dict(self) -> dict:
        return {"path": str(self.path), "layers_read": self.layers_read}

    def reset_stats(self) -> None:
        pass

    def close(self) -> None:
        self.archive.close()


SLOW_TIER = NpzPack
'''

SCRIPT = """
import json, sys
import numpy as np
import torch
import vllm_specexpert
from moe_reference import random_layer, random_routing, reference_moe, slot_kernel
from vllm_specexpert.config import SpecExpertConfig
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.phases import PassPhases
from vllm_specexpert.tiers import slow_tiers

model = sys.argv[1]
NAMES = [f"model.layers.{i}.mlp.experts" for i in range(2)]
LAYERS = {name: random_layer(seed=i) for i, name in enumerate(NAMES)}
np.savez(
    f"{model}/experts.npz",
    **{f"{n}/{k}": t.view(torch.uint16).numpy() for n, ts in LAYERS.items() for k, t in ts.items()},
)
config = SpecExpertConfig.from_dict({"budget": 0.25})
engine = OffloadEngine(config, torch.device("cpu"), reports=False)
engine.budget.sizing.moe_layers = len(NAMES)
tier = slow_tiers.open_tier(config, model)
engine.store.tiers.append(tier)
for index, name in enumerate(NAMES):
    engine.add_layer(name, tier.layer(name), top_k=4, index=index)
engine.start()
exact = True
for step in range(4):
    for name in NAMES:
        x, w, ids = random_routing(3, 16, 4, seed=step)
        out = engine.run_call(LayerCall(name, slot_kernel, x, w, ids, PassPhases.decode_only(3)))
        exact &= torch.equal(out, reference_moe(x, w, ids, *LAYERS[name].values()))
stats = engine.stats()
report = {
    "package": vllm_specexpert.__file__,
    "tier": type(tier).__name__,
    "exact": exact,
    "loads": stats["total"]["decode"]["loads"],
    "section": stats.get("npz_pack"),
    "disk": stats.get("disk", "absent"),
    "where": engine.store.where(),
}
engine.close()
print("REPORT " + json.dumps(report))
"""


def _add_tier(package: Path, name: str, module: str) -> None:
    """The whole cost of a slow tier: its module, its registry line, its word in the map."""
    line = 'REGISTRY = ("disk",)'
    registry = ("tiers/slow_tiers.py", line, f'REGISTRY = ("disk", "{name}")')
    add_module(package, f"tiers/{name}.py", module, registry)
    anchor = "besides the host's:\n                        disk)"
    edit(package / "__init__.py", anchor, anchor.replace("disk)", f"disk, {name})"))


@pytest.fixture(scope="module")
def copy_with_tier(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("copy")
    _add_tier(copy_package(root), "npz_pack", TIER_MODULE)
    return root


# (a copy of the package, linted; test_adding_a_feature does the same for a feature)
@pytest.mark.slow
def test_the_copy_with_the_tier_keeps_the_layout(copy_with_tier):
    done = layout_check(copy_with_tier)
    assert done.returncode == 0, done.stdout[-3000:]


def test_the_new_tier_serves_the_layers_exactly(copy_with_tier, tmp_path):
    report = report_of(run_in_copy(copy_with_tier, "-c", SCRIPT, str(tmp_path)))
    assert "copy" in report["package"]  # the copy's package ran, not this one
    assert report["tier"] == "NpzPack" and report["exact"]
    assert report["loads"] > 0  # (a quarter resident: the calls read from the tier)
    assert report["section"] == {"path": str(tmp_path / "experts.npz"), "layers_read": 2}
    assert report["disk"] is None  # (every registered tier has its section)
    assert report["where"] == f"in {tmp_path / 'experts.npz'}"


def test_without_its_file_no_tier_is_opened(tmp_path):
    from vllm_specexpert.config import SpecExpertConfig
    from vllm_specexpert.tiers import slow_tiers

    assert slow_tiers.open_tier(SpecExpertConfig.from_dict({"budget": 0.25}), str(tmp_path)) is None
