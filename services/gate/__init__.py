"""The rollout gate: the Docker API as the controller's docker backend needs it, and no more."""
