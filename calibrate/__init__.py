"""`dls calibrate`: the latency profile, step predictor and quality curve of one model on one kind of
device, written as a calibration bundle (``shared.calibration``) that every service reads. See README.md."""
