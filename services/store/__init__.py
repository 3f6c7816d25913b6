"""The trajectory store: gRPC in front of Redis (see `redis_store.RolloutStore`)."""
