"""What a denoising step commits: each model family's decoding rule in its batch and one-request forms
(``rule``) and per-request sampling (``sampling``)."""
