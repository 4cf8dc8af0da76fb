"""Fixtures shared by the single-process tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def world1():
    """A one-rank gloo group (in-memory store) for the duration of one test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
