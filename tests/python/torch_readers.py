"""The two ways the binding's fast path reads a PyTorch tensor: through
the DLPack C exchange API of torch.Tensor (PyTorch 2.10 and later: one C
call per tensor) or through the tensor's attributes (older PyTorch). A
test that uses the fixture runs once each way."""

import pytest
import torch

import ropekv


@pytest.fixture(params=["exchange-api", "attributes"])
def torch_reader(request):
    exchange = request.param == "exchange-api"
    if exchange and not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this PyTorch has no DLPack C exchange API")
    ropekv._torch_fast()  # (registers torch the first time)
    assert ropekv._register_fast_torch(torch, exchange_api=exchange) == exchange
    yield request.param
    ropekv._register_fast_torch(torch)
