"""Where a worker's ranks run: pinning through CUDA_VISIBLE_DEVICES, the engine's placement, and a clear
refusal when the CUDA device a worker is told to use is not there."""

from __future__ import annotations

import pytest
import torch

from services.worker.parallel.placement import rank_gpus
from services.worker.parallel.ranks import RankSpec
from services.worker.service.startup import check_device
from shared.devices import DeviceError, cuda_problem, pin
from shared.settings import WorkerSettings


def test_pin_maps_gpu_ids_through_what_the_parent_sees():
    assert pin((2, 3), None) == "2,3"
    assert pin((1,), "7,6,5") == "6" and pin((0, 2), "7, 6, 5") == "7,5"
    assert pin((0,), "") == ""  # the parent sees no GPU: nor does the child
    with pytest.raises(DeviceError, match=r"GPUs \[3\] are not among the 3 devices CUDA_VISIBLE_DEVICES='7,6,5'"):
        pin((2, 3), "7,6,5")


def test_ranks_land_on_the_pinned_gpus_as_the_engine_places_them():
    spec = RankSpec("models/dls-tiny", 2, "cuda", None, None, 10.0)
    assert [spec.rank_device(r) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert rank_gpus("cuda", 2, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert rank_gpus("cuda:1", 2, {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == ["5", "6"]
    assert rank_gpus("cuda", 2, {}) == ["0", "1"]  # unpinned: the machine's first GPUs
    assert rank_gpus("cpu", 2, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["cpu", "cpu"]
    with pytest.raises(DeviceError, match=r"cuda at TP 2 needs cuda:1, but CUDA_VISIBLE_DEVICES='3' shows 1 GPUs"):
        rank_gpus("cuda", 2, {"CUDA_VISIBLE_DEVICES": "3"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_worker_told_to_use_cuda_without_it_is_refused_naming_the_setting():
    assert cuda_problem("cpu", 4) is None
    assert "sees no CUDA device" in cuda_problem("cuda", 1)
    with pytest.raises(DeviceError, match=r"DLS_WORKER_DEVICE=cuda \(TP 2\): torch .* sees no CUDA device"):
        check_device(WorkerSettings(device="cuda", tp=2))
    check_device(WorkerSettings(device="cpu", tp=2))  # CPU needs nothing
