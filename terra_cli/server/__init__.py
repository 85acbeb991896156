"""`terra serve`: a warm world model behind an HTTP/WebSocket API and a page to drive it (see app.py)."""
