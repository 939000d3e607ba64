"""EnvHub's built-in environments (games, math, tools, text worlds) and what they need (the
code sandbox, the math grader, the generated datasets). The hub's registry and routing stand
apart from them in the package above: a game is an ``AbstractGame`` like any user's."""
