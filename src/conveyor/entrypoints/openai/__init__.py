"""The OpenAI-compatible HTTP server: protocol models, errors, metrics, handlers and the app."""
