"""The rollout's second way in: an OpenAI-compatible chat endpoint served per episode to an
agent program of the user's own (issue 34). ``episodes.AgentProgramLoop`` plays a batch this
way; ``server`` serves the HTTP calls; ``segments`` records each call's tokens exactly."""
