"""``specexpert widen``: each expert computes what it computed before (zero rows and
columns added), every other tensor is copied, and the result is sharded with an index."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vllm_specexpert.cli import main

MODEL = Path(__file__).parent.parent / "vllm_specexpert" / "assets" / "tiny-qwen3-moe"
EXPERT = "model.layers.3.mlp.experts.17"


def tensors_of(model: Path) -> dict[str, torch.Tensor]:
    index = model / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for file in files:
        with safe_open(str(model / file), "pt") as f:
            names = f.keys()  # (a safetensors handle is not iterable)
            out.update({k: f.get_tensor(k) for k in names})
    return out


def expert_out(t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU output, in float64 (so that only the weights can differ)."""
    gate, up, down = (
        t[f"{EXPERT}.{p}.weight"].double() for p in ("gate_proj", "up_proj", "down_proj")
    )
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


@pytest.fixture(scope="module")
def widened(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wide") / "model"
    main(["widen", str(MODEL), str(out), "--intermediate", "160", "--shard-gib", "0.05"])
    return out


def test_every_expert_computes_what_it_did_and_nothing_else_changes(widened):
    before, after = tensors_of(MODEL), tensors_of(widened)
    assert before.keys() == after.keys()
    x = torch.randn(5, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert after[f"{EXPERT}.gate_proj.weight"].shape == (160, 256)
    assert after[f"{EXPERT}.down_proj.weight"].shape == (256, 160)
    assert torch.allclose(expert_out(after, x), expert_out(before, x), rtol=1e-12, atol=1e-12)
    assert not after[f"{EXPERT}.up_proj.weight"][64:].any()  # the added rows are zeros
    for name, tensor in before.items():
        if ".experts." not in name:
            assert torch.equal(after[name], tensor), name
    config = json.loads((widened / "config.json").read_text())
    assert config["moe_intermediate_size"] == 160
    assert len(list(widened.glob("model-*-of-*.safetensors"))) > 1  # 0.05 GiB shards


def test_expert_mib_sets_the_size_of_one_expert(tmp_path):
    out = tmp_path / "model"
    main(["widen", str(MODEL), str(out), "--expert-mib", "1.5"])
    config = json.loads((out / "config.json").read_text())
    # 1.5 MiB = 3 projections x 256 (hidden) x I x 2 bytes -> I = 1024
    assert config["moe_intermediate_size"] == 1024


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--intermediate", "32"], "below the model's intermediate size 64"),
        (["--expert-mib", "-1"], "expert-mib"),
    ],
)
def test_bad_sizes_are_refused_before_any_work(extra, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["widen", str(MODEL), str(tmp_path / "out"), *extra])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_not_enough_disk_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1 << 20))
    with pytest.raises(SystemExit) as exit_:
        main(["widen", str(MODEL), str(tmp_path / "out"), "--intermediate", "128"])
    assert exit_.value.code == 2 and "needs 0.11 GB" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


CALIBRATION = MODEL.parent / "tiny-qwen3-moe-calibration"


def test_carried_artifacts_are_accepted_for_the_widened_model_only(tmp_path):
    from vllm_specexpert.calibration import load_calibration
    from vllm_specexpert.config import SpecExpertConfigError

    out = tmp_path / "model"
    main(["widen", str(MODEL), str(out), "--intermediate", "96", "--carry", str(CALIBRATION)])
    carried = out / "artifacts" / CALIBRATION.name
    # the original is refused for the widened model (its fingerprint names I = 64) ...
    with pytest.raises(SpecExpertConfigError, match="moe_intermediate_size"):
        load_calibration(CALIBRATION, str(out))
    # ... the carried copy is accepted, holds the same tensors, and is refused for the
    # model it came from
    assert load_calibration(carried, str(out)).manifest["num_experts"] == 64
    assert (carried / "calibration.safetensors").read_bytes() == (
        CALIBRATION / "calibration.safetensors"
    ).read_bytes()
    with pytest.raises(SpecExpertConfigError, match="made for another model"):
        load_calibration(carried, str(MODEL))


def test_an_artifact_of_another_model_is_not_carried(tmp_path, capsys):
    stale = tmp_path / "stale"
    shutil.copytree(CALIBRATION, stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    manifest["model_fingerprint"]["router_sha256"] = "0" * 64
    (stale / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "widen",
                str(MODEL),
                str(tmp_path / "out"),
                "--intermediate",
                "96",
                "--carry",
                str(stale),
            ]
        )
    assert exit_.value.code == 2 and "was not made for" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
