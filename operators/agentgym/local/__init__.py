"""`agentgym run`: a TrainingRun reconciled onto local processes (embedded NATS, CPU engine)."""
