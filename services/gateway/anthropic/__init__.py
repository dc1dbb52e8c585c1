"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), a thin translation of
chat completions: translate.py (request → chat body), message.py / events.py (results → Anthropic
objects and stream events), errors.py (Anthropic's error envelope), routes.py (the handlers)."""
