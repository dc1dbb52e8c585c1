"""OpenAI's Conversations API: conversations kept by the server (store.py, routes.py)."""
