"""qspec's HTTP server: `qspec serve`, an OpenAI-style completions API over one Engine.

app.py: the endpoints, the request queue and `serve`/`listen_socket`; requests.py: the request bodies and their
validation; errors.py: the error contract (OpenAI error bodies for every error, the body-size limit).
"""
