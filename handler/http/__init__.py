"""The HTTP edge: Flask routes (app.py) over one ServerState (state.py), request schemas
(schemas.py, chat.py), generation and streaming (generation.py), /metrics (metrics.py), the
SageMaker runtime paths (sagemaker_runtime.py) and the gunicorn server (server.py)."""
