"""`lingls serve`: the OpenAI-compatible HTTP server (`http_server.py`) and its tensor-parallel processes
(`tensor_parallel.py`)."""
