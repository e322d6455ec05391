import numpy as np
import torch

from vllm_specexpert.tiers.staging import HostReader


def test_packed_read_returns_each_tensor_and_survives_later_reads():
    # The CUDA path (one packed copy) run on the CPU: every tensor comes back with its
    # shape, dtype and values, whatever the byte offsets of the others.
    reader = HostReader(torch.device("cpu"), packed=True)
    g = torch.Generator().manual_seed(0)
    ids32 = torch.randint(0, 64, (3, 4), generator=g, dtype=torch.int32)
    ids64 = torch.randint(-1, 64, (5, 2), generator=g)
    weights = torch.rand(3, 4, generator=g)
    scalar = torch.tensor([7], dtype=torch.int32)
    first = reader.read([scalar, ids64, weights, ids32])
    for got, tensor in zip(first, [scalar, ids64, weights, ids32], strict=True):
        assert got.dtype == tensor.numpy().dtype and got.shape == tuple(tensor.shape)
        assert np.array_equal(got, tensor.numpy())
    reader.read([torch.zeros(64, dtype=torch.int64)])  # overwrites the staging buffer
    assert np.array_equal(first[1], ids64.numpy()) and np.array_equal(first[3], ids32.numpy())
