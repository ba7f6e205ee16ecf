"""A model instance over ``d`` GPUs: the one factory of an instance (``build.make_engine``), the
tensor-parallel engine and its runner (``tp_engine``), the rank processes (``ranks``) and where each
rank runs (``placement``)."""
