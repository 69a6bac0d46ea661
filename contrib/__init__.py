"""Optional plugins with optional dependencies (loggers, API clients)."""
