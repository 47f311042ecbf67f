"""Rollout plug-ins: loading a recipe's rollout function, running episodes, tool calls (docs/agents.md)."""
