"""Shared test configuration: GPU tests skip cleanly where CUDA is absent."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def no_tf32():
    """fp32 matmuls and convolutions without TF32 for one test, then as before. Through the
    precision API and cudnn.flags: newer torch has no `matmul.allow_tf32` to patch."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
