"""OpenAI's Responses API (`/v1/responses`), a thin translation of chat completions plus what
that API keeps on the server (stored responses, background runs) and the MCP agent loop."""
