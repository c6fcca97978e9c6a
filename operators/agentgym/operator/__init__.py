"""The TrainingRun operator (kopf): reconciles a TrainingRun into env services, inference, rollout, trainer."""
