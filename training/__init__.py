"""Training the bundled model (``tiny.py``) and its command, ``dls train-model`` (``cli.py``)."""
