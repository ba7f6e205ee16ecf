"""The mask predictor: its architecture and forwards (``dlm.py``), loading a model directory of any
supported family (``loading.py``), and the tensor-parallel layers that shard it (``parallel.py``)."""
