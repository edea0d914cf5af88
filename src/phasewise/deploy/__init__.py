"""`phasewise serve` past one process: the same FastAPI app as Ray Serve replicas (`ray.py`), Serve's
request-router extension point for prefix affinity (`prefix_router.py`), and the options both the CLI
and Serve's app builder parse (`options.py`, which imports no Ray). Nothing here knows the model."""
