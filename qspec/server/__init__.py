"""qspec's HTTP server: `qspec serve` (an OpenAI-style completions API over one Engine, qspec/server/app.py)."""
