"""BabyAI (minigrid's BabyAI levels) as a text environment: `env.BabyAIEnv`, `expert.BabyAIExpert`.

Modules: `levels` (the 40-level task catalog), `engine` (minigrid access, quiet stdout),
`world` (what the agent has seen, object names, path planning), `text` (observation wording).
"""
