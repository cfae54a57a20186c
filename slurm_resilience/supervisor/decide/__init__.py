"""Pure decisions: ``decide(state, observation, now, policy) -> (state, actions)``."""
