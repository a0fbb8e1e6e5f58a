"""OpenAI-compatible HTTP server: app factory, schemas, error table. Routes translate; the library works."""
