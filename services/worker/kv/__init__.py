"""The KV cache: the page table the engine asks (``pages``: extents, free runs, budget, compaction) and
the tensor the runner writes (``pool``)."""
