"""pagoda: the public face of the engine (CLI, offline LLM, client library)."""
