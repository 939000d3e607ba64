"""OpenTinker: agentic reinforcement learning as a service."""
