"""The rollout's link to EnvHub: the RunEpisodes stream, its episodes, its faults."""
