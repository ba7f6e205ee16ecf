import os

# Keep the test suite to the cores it is given: torch otherwise spawns a thread per core per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
