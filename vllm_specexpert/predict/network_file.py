"""A trained network's directory (the estimator's, the path predictor's): its weights and
``manifest.json`` (format, the network's shape, the MoE layers it serves, the model it
was made for). One saver and one loader for every such network, so each is checked
alike on read: the manifest against its schema, the model, the shape against the
model's fingerprint, then the weights against a build on the meta device, before
anything is allocated. Anything wrong is one config error naming the config field that
points at the directory and the command that remakes it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from vllm_specexpert.artifacts import (
    ArtifactManifest,
    LayerIndices,
    check_matches_model,
    check_shapes,
    check_tensors,
    read_manifest,
    stored_shapes,
)
from vllm_specexpert.config import SpecExpertConfigError

SHAPE_SIZES = ("hidden_size", "num_experts", "top_k", "vocab_size")
"""The sizes a shape may state that a model fingerprint states too
(:meth:`~vllm_specexpert.artifacts.ModelFingerprint.disagreement`)."""


class LayeredNetwork(nn.Module):
    """A network over a model's MoE layers: its shape (the manifest's, a pydantic
    dataclass) and the model's decoder-layer index of each MoE layer it serves."""

    shape: Any
    layer_indices: list[int]


class NetworkManifest(ArtifactManifest):
    """What a network's manifest holds besides an artifact's: its shape (each network's
    own type) and its MoE layers, in that order (validators of the layers read the
    shape)."""

    shape: Any
    moe_layer_indices: LayerIndices


Manifest = TypeVar("Manifest", bound=NetworkManifest)
Network = TypeVar("Network", bound=LayeredNetwork)


@dataclass(frozen=True)
class NetworkFile(Generic[Manifest, Network]):
    """How one kind of network is stored, and its saver and loader."""

    field: str
    """The config field that points at the directory (every error names it)."""
    command: str
    """The ``specexpert`` command that trains one (``train-path``)."""
    format: str
    weights_file: str
    schema: type[Manifest]
    build: Callable[[Any, list[int]], Network]
    """An untrained network of a shape over those MoE layers."""
    remake: str
    """The fix of anything wrong in the directory itself."""

    def save(self, out: Path, network: Network, manifest: dict) -> None:
        """``network``'s weights and its manifest: format, shape and layers, then the
        keys of ``manifest`` (the model, its fingerprint, how it was trained)."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        weights = {k: v.contiguous() for k, v in network.state_dict().items()}
        save_file(weights, str(out / self.weights_file))
        written = {
            "format": self.format,
            "shape": asdict(network.shape),
            "moe_layer_indices": network.layer_indices,
            **manifest,
        }
        (out / "manifest.json").write_text(json.dumps(written, indent=1))

    def read(
        self, path: str | Path, model: str | None = None, hf_config: object | None = None
    ) -> Manifest:
        """The directory's manifest, checked: format and schema, made for ``model`` if
        given, its shape's sizes those of the model its fingerprint names."""
        path = Path(path)
        manifest = read_manifest(
            path, self.field, self.weights_file, self.format, self.remake, self.schema
        )
        if model is not None:
            check_matches_model(
                manifest,
                model,
                hf_config,
                field=self.field,
                fix=f"run `specexpert {self.command} {model} --out DIR`",
            )
        if manifest.model_fingerprint is not None:
            sizes = {name: getattr(manifest.shape, name, None) for name in SHAPE_SIZES}
            differs = manifest.model_fingerprint.disagreement(**sizes)
            if differs:
                raise SpecExpertConfigError(
                    self.field, f"{path / 'manifest.json'}: key shape: {differs}", self.remake
                )
        return manifest

    def network(self, path: str | Path, manifest: Manifest) -> Network:
        """The network of ``manifest`` (:meth:`read` from ``path``) with the directory's
        weights, in eval mode. Its tensor shapes are first taken from a build on the meta
        device and compared with the file's header, so a manifest asking for a huge
        network is refused before anything is allocated. An unreadable file, a missing,
        extra, misshapen or non-finite tensor is one config error."""
        from safetensors.torch import load_file

        field, fix = self.field, self.remake
        file = Path(path) / self.weights_file
        layers = list(manifest.moe_layer_indices)
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            built = self.build(manifest.shape, layers)
            expected = {k: tuple(v.shape) for k, v in built.state_dict().items()}
        check_shapes(field, file, stored_shapes(field, file, fix), expected, fix)
        try:
            state = load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - changed or damaged since the header was read
            raise SpecExpertConfigError(
                field, f"{file}: unreadable ({str(exc).splitlines()[0]})", fix
            ) from None
        check_tensors(field, file, state, expected, fix)
        network = self.build(manifest.shape, layers)
        network.load_state_dict(state)
        return network.eval()

    def load(
        self, path: str | Path, model: str | None = None, hf_config: object | None = None
    ) -> Network:
        """:meth:`network` of the checked :meth:`read` of ``path``."""
        return self.network(path, self.read(path, model, hf_config))
