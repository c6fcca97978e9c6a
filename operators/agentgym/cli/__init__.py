"""agentgym CLI."""
