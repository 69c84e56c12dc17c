"""qspec's HTTP server: `qspec serve`, an OpenAI-style completions API over one Engine.

app.py: the endpoints, the request queue and `serve`/`listen_socket`; completions.py: what a request does with the
engine (prompt, sampler, choices); requests.py: the request bodies and their validation; errors.py: the error contract
(OpenAI error bodies for every error, the body-size limit); tools.py: tool calls apart from a reply's content,
call_formats.py: the formats they are written in; reasoning.py: think blocks; anthropic.py and responses.py:
Anthropic's Messages API and OpenAI's Responses API over the chat endpoint.
"""
