"""EnvHub: the registry of environment servers, the router of episodes, the built-in envs."""
